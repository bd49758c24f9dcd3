"""A scripted backend for tests: answers come from a function of (trial text, turn), no model.

Only the model is replaced; parsing, the loop, the store, the planner and (unless a test says
otherwise) the verifier are the real ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mkb_eval.agent.backends import Generation, Message, Sampling

GOOD_TIRX = '''import torch
import tvm
from tvm.script import tirx as T

@T.prim_func
def copy(x_handle: T.handle, y_handle: T.handle):
    n = T.int32()
    X = T.match_buffer(x_handle, (n,), "float32")
    Y = T.match_buffer(y_handle, (n,), "float32")
    T.device_entry()
    cta = T.cta_id([T.ceildiv(n, 256)])
    tid = T.thread_id([256])
    if cta * 256 + tid < n:
        Y[cta * 256 + tid] = X[cta * 256 + tid]

def solve(*inputs):
    return inputs[0]
'''


def answer(kernel: str | None, skill: str | None = None, prose: str = "Here is my submission.") -> str:
    out = prose + "\n"
    if kernel is not None:
        out += f"<kernel.py>\n{kernel}</kernel.py>\n"
    if skill is not None:
        out += f"<SKILL.md>\n{skill}\n</SKILL.md>\n"
    return out


class ScriptedBackend:
    """Returns ``script(messages, turn)`` for each conversation; records every batch it was given."""

    def __init__(self, script: Callable[[Sequence[Message], int], str], name: str = "scripted-model",
                 max_context: int | None = None, tokens_per_answer: int = 10) -> None:
        self.script = script
        self.name = name
        self.max_context = max_context
        self.tokens_per_answer = tokens_per_answer
        self.batches: list[int] = []
        self.sampling: list[Sampling] = []

    def identity(self) -> dict[str, Any]:
        return {"kind": "scripted", "model": self.name}

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return sum(len(m["content"]) // 4 for m in messages)

    def generate(self, conversations: Sequence[Sequence[Message]], sampling: Sequence[Sampling]) -> list[Generation]:
        self.batches.append(len(conversations))
        self.sampling.extend(sampling)
        out = []
        for conv in conversations:
            turn = sum(1 for m in conv if m["role"] == "assistant")
            text = self.script(conv, turn)
            out.append(Generation(text=text, prompt_tokens=self.count_prompt_tokens(conv) or 0,
                                  completion_tokens=self.tokens_per_answer, finish_reason="stop"))
        return out

    def close(self) -> None:
        pass
