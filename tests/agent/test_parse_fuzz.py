"""Property-based: any model output parses to an Answer or a Malformed with a reason, never raises."""

import ast

from hypothesis import given, settings
from hypothesis import strategies as st

from mkb_eval.agent.parse import Answer, Malformed, parse_answer

pieces = st.sampled_from(["<kernel.py>", "</kernel.py>", "<SKILL.md>", "</SKILL.md>", "```python\n", "```\n",
                          "def solve(x):\n    return x\n", "import torch\n", "\n", "def (", "\x00", "é", "    "])
texts = st.one_of(st.text(max_size=300), st.lists(pieces, max_size=14).map("".join))


@settings(max_examples=400, deadline=None)
@given(texts)
def test_any_output_is_an_answer_or_a_reason(text):
    res = parse_answer(text)
    assert isinstance(res, (Answer, Malformed))
    if isinstance(res, Answer):
        ast.parse(res.kernel)                         # a usable answer is valid Python
        assert res.kernel.strip()
    else:
        assert res.reason.strip() and "\n" not in res.reason.strip()


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_well_formed_answer_round_trips(skill):
    kernel = "def solve(x):\n    return x\n"
    text = f"Here you go.\n<kernel.py>\n{kernel}</kernel.py>\n<SKILL.md>\n{skill.replace('<', '')}\n</SKILL.md>\n"
    res = parse_answer(text)
    assert isinstance(res, Answer) and res.kernel.strip() == kernel.strip()
