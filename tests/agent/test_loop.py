"""The attempt conversation: submissions, corrections, budgets, final and best kernels."""

from __future__ import annotations

from typing import Any

from mkb_eval.agent.backends import Generation, Sampling
from mkb_eval.agent.loop import DONE, GENERATE, VERIFY, Attempt, Budget

K = "def solve(x):\n    return x\n"


def gen(text: str, n: int = 10) -> Generation:
    return Generation(text=text, prompt_tokens=100, completion_tokens=n, finish_reason="stop")


def ok(text: str = "K", skill: str | None = "- note") -> str:
    s = f"<SKILL.md>\n{skill}\n</SKILL.md>" if skill is not None else ""
    return f"<kernel.py>\n{K}# {text}\n</kernel.py>{s}"


def rec(status: str, speedup: float | None = None) -> dict[str, Any]:
    t = {"speedup": speedup, "kernel_ms": 1.0 / speedup if speedup else None, "eager_ms": 1.0 if speedup else None}
    return {"status": status, "message": f"{status} msg", "stage": "", "timing": t, "stages_s": {"total": 1.0},
            "tier": "cpu"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def attempt(**budget: Any) -> Attempt:
    return Attempt("p28_r1_solo_tirx", "TASK", Budget(**budget), Sampling(seed=3), tier="cpu", clock=Clock())


def test_submissions_then_done_final_is_last_best_is_fastest() -> None:
    a = attempt(submissions=3)
    for i, r in enumerate([rec("ok", 2.0), rec("ok", 3.0), rec("incorrect")]):
        assert a.state == GENERATE
        msgs, s = a.request(100, 8192)
        assert s.max_tokens == 8192 - 100 and s.seed is not None   # what the context still holds
        sub = a.on_answer(gen(ok(str(i))))
        assert sub is not None and sub.k == i + 1 and a.state == VERIFY
        a.on_verified(r)
    assert a.state == DONE and a.stop_reason == "submissions"
    assert a.final.k == 3 and a.final.status == "incorrect"
    assert a.best.k == 2 and a.best.speedup == 3.0
    feedback = [m["content"] for m in a.messages if m["role"] == "user"][1:]
    assert "submission 1 of 3" in feedback[0] and "2 submissions" in feedback[0]
    assert "last submission" in feedback[-1]


def test_malformed_answers_spend_no_submission_and_end_after_the_cap() -> None:
    a = attempt(submissions=2, max_corrections=2)
    a.request(None, None)
    assert a.on_answer(gen("I will write it later")) is None
    assert a.state == GENERATE and len(a.submissions) == 0
    assert "no <kernel.py>" in a.messages[-1]["content"] and "no submission was spent" in a.messages[-1]["content"]
    a.request(None, None)
    assert a.on_answer(gen(ok())) is not None       # a good answer resets the run of corrections
    a.on_verified(rec("unverified"))
    a.request(None, None)
    a.on_answer(gen("still nothing"))
    a.request(None, None)
    a.on_answer(gen("nothing again"))
    assert a.state == DONE and a.stop_reason == "corrections"
    assert a.corrections == 3 and len(a.submissions) == 1


def test_token_budget_shrinks_turns_and_ends_the_attempt() -> None:
    a = attempt(submissions=5, max_tokens_per_turn=100, max_total_tokens=130)
    _, s = a.request(10, 8192)
    assert s.max_tokens == 100
    a.on_answer(gen("no tags", n=100))
    _, s = a.request(10, 8192)
    assert s.max_tokens == 30
    a.on_answer(gen("no tags", n=30))
    assert a.request(10, 8192) is None
    assert a.state == DONE and a.stop_reason == "tokens"


def test_context_and_wall_clock() -> None:
    a = attempt()
    assert a.request(8190, 8192) is None and a.stop_reason == "context"
    b = attempt(wall_s=10)
    b._clock.t = 11.0   # type: ignore[attr-defined]
    assert b.request(10, 8192) is None and b.stop_reason == "wall_clock"


def test_skill_is_kept_from_the_last_answer_that_had_one() -> None:
    a = attempt(submissions=2)
    a.request(None, None)
    a.on_answer(gen(ok(skill="- first")))
    a.on_verified(rec("unverified"))
    a.request(None, None)
    a.on_answer(gen(ok(skill=None)))
    assert a.skill == "- first"


def test_turn_seeds_differ_and_are_reproducible() -> None:
    a, b = attempt(), attempt()
    s1 = a.request(None, None)[1].seed
    a.on_answer(gen("x"))
    s2 = a.request(None, None)[1].seed
    assert s1 != s2 and b.request(None, None)[1].seed == s1
