"""Reading a model's answer: the ``<kernel.py>`` and ``<SKILL.md>`` tagged blocks.

An answer is usable when it holds exactly one complete ``<kernel.py>`` block whose content is
non-empty Python within the size limit, and at most one ``<SKILL.md>`` block. Anything else is
*malformed*: the loop sends back the one-line reason (precise: which tag, which line) and the
answer does not spend a submission. A single Markdown code fence wrapped around a block's content
is tolerated and removed, since models add them by habit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mkb_eval.harness.policy import parse_python

KERNEL_TAG = "kernel.py"
SKILL_TAG = "SKILL.md"
_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+.-]*[ \t]*\n(.*?)\n?[ \t]*```\s*$", re.S)


@dataclass(frozen=True)
class Answer:
    """A usable answer: the kernel source and, when given, the SKILL.md text."""

    kernel: str
    skill: str | None


@dataclass(frozen=True)
class Malformed:
    """An unusable answer and the reason sent back to the model."""

    reason: str


def _blocks(text: str, tag: str) -> tuple[list[str], str | None]:
    """Contents of every ``<tag>...</tag>`` block, or a reason when the tags do not pair up."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    found: list[str] = []
    pos = 0
    while True:
        start = text.find(open_t, pos)
        stray_close = text.find(close_t, pos)
        if start < 0:
            if stray_close >= 0:
                return found, f"found {close_t} without a matching {open_t} before it"
            return found, None
        if 0 <= stray_close < start:
            return found, f"found {close_t} without a matching {open_t} before it"
        end = text.find(close_t, start + len(open_t))
        nested = text.find(open_t, start + len(open_t))
        if end < 0:
            return found, f"the {open_t} block is never closed with {close_t} (the answer may have hit the token limit)"
        if 0 <= nested < end:
            return found, f"a second {open_t} starts before the first one is closed"
        found.append(text[start + len(open_t):end])
        pos = end + len(close_t)


def _unfence(body: str) -> str:
    m = _FENCE.match(body)
    return m.group(1) if m else body


def parse_answer(text: str, *, max_kernel_bytes: int = 300_000) -> Answer | Malformed:
    """Parse one answer; never raises."""
    kernels, why = _blocks(text, KERNEL_TAG)
    if why:
        return Malformed(why)
    if not kernels:
        return Malformed(f"the answer has no <{KERNEL_TAG}> ... </{KERNEL_TAG}> block")
    if len(kernels) > 1:
        return Malformed(f"the answer has {len(kernels)} <{KERNEL_TAG}> blocks; give exactly one, with the whole file")
    kernel = _unfence(kernels[0]).strip("\n")
    if not kernel.strip():
        return Malformed(f"the <{KERNEL_TAG}> block is empty")
    size = len(kernel.encode("utf-8"))
    if size > max_kernel_bytes:
        return Malformed(f"kernel.py is {size} bytes, over the limit of {max_kernel_bytes}")
    try:
        parse_python(kernel)
    except SyntaxError as e:
        line = (e.text or "").strip()
        where = f"line {e.lineno}" + (f" ({line[:80]!r})" if line else "")
        return Malformed(f"kernel.py is not valid Python: {e.msg} at {where}")
    except ValueError as e:  # e.g. NUL bytes
        return Malformed(f"kernel.py cannot be parsed: {e}")
    skills, why = _blocks(text, SKILL_TAG)
    if why:
        return Malformed(why)
    if len(skills) > 1:
        return Malformed(f"the answer has {len(skills)} <{SKILL_TAG}> blocks; give at most one, with the whole file")
    skill = _unfence(skills[0]).strip() if skills else None
    return Answer(kernel=kernel + "\n", skill=skill)
