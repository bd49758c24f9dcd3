"""What every backend hands the attempt loop: messages, sampling settings, one generation, a backend error.

A leaf of the agent package, so a backend module (the replay backend) and the dispatcher in
:mod:`mkb_eval.agent.backends` import these without importing each other.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

Message = dict[str, str]


class BackendError(RuntimeError):
    """The backend cannot serve; the message is one line and says what is wrong."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request (recorded with every attempt)."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 8192
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Generation:
    """One model answer and its token usage."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    seconds: float = 0.0
    error: str | None = None
    """Set when this one request failed (the trial's infrastructure error); the text is then empty."""


def failed(message: str, t0: float) -> Generation:
    """A request that failed: that trial's infrastructure error; the batch's other requests go on."""
    return Generation(text="", prompt_tokens=0, completion_tokens=0, finish_reason="error",
                      seconds=time.perf_counter() - t0, error=message)
