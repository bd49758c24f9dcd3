"""Tagged-block parsing: usable answers, and a precise reason for every malformed one."""

from __future__ import annotations

import pytest

from mkb_eval.agent.parse import Answer, Malformed, parse_answer

K = "def solve(x):\n    return x\n"


def test_kernel_and_skill() -> None:
    a = parse_answer(f"thinking...\n<kernel.py>\n{K}</kernel.py>\n<SKILL.md>\n- a finding\n</SKILL.md>")
    assert isinstance(a, Answer)
    assert a.kernel == K and a.skill == "- a finding"


def test_fenced_content_is_unwrapped_and_skill_is_optional() -> None:
    a = parse_answer(f"<kernel.py>\n```python\n{K}```\n</kernel.py>")
    assert isinstance(a, Answer)
    assert a.kernel == K and a.skill is None


@pytest.mark.parametrize("text, reason", [
    ("no tags at all, just prose", "no <kernel.py>"),
    (f"```python\n{K}```", "no <kernel.py>"),
    (f"<kernel.py>\n{K}", "never closed with </kernel.py>"),
    (f"{K}</kernel.py>", "</kernel.py> without a matching <kernel.py>"),
    (f"<kernel.py>\n{K}<kernel.py>\n{K}</kernel.py>", "second <kernel.py> starts before"),
    (f"<kernel.py>{K}</kernel.py><kernel.py>{K}</kernel.py>", "2 <kernel.py> blocks"),
    ("<kernel.py>\n   \n</kernel.py>", "block is empty"),
    ("<kernel.py>\ndef solve(x:\n    return x\n</kernel.py>", "not valid Python"),
    (f"<kernel.py>{K}</kernel.py><SKILL.md>unclosed", "<SKILL.md> block is never closed"),
    (f"<kernel.py>{K}</kernel.py><SKILL.md>a</SKILL.md><SKILL.md>b</SKILL.md>", "2 <SKILL.md> blocks"),
])
def test_malformed_answers_name_the_problem(text: str, reason: str) -> None:
    m = parse_answer(text)
    assert isinstance(m, Malformed), m
    assert reason in m.reason
    assert "\n" not in m.reason


def test_syntax_error_reports_the_line() -> None:
    m = parse_answer("<kernel.py>\nimport torch\n\ndef solve(x)\n    return x\n</kernel.py>")
    assert isinstance(m, Malformed)
    assert "line 3" in m.reason


def test_size_limit() -> None:
    m = parse_answer("<kernel.py>\nx = 1\n" + "# pad\n" * 100 + "</kernel.py>", max_kernel_bytes=200)
    assert isinstance(m, Malformed) and "over the limit of 200" in m.reason
