"""Shared test helpers."""

import time

from mkb_eval import problems as P


def until(cond, timeout: float = 10.0) -> bool:
    """Whether ``cond()`` came true within ``timeout`` s (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def loadable() -> list[P.Problem]:
    """Every problem folder that validates (tests/test_problem_set.py reports the ones that do not)."""
    out = []
    for folder in P.discover():
        try:
            out.append(P.load_problem(folder))
        except P.ProblemError:
            continue
    return out


def attempt(trial: str, status: str = "ok", speedup: float | None = None, **extra) -> dict:
    """A full attempt record (built through the typed model) for a fixture's run folder; ``extra`` overrides."""
    from mkb_eval.attempt_record import AttemptRecord
    from mkb_eval.metrics.inputs import family_of
    from mkb_eval.vocab import ARM_DSL

    pid, rep, arm = int(trial[1:3]), int(trial.split("_")[1][1:]), trial.split("_", 2)[2]
    skill = arm.endswith("_skill")
    rec = {"trial": trial, "problem_id": pid, "problem": f"problem_{pid:02d}", "family": family_of(pid), "arm": arm,
           "dsl": ARM_DSL[arm], "replicate": rep, "status": status, "speedup": speedup,
           "kernel_ms": round(1.0 / speedup, 6) if speedup else None, "eager_ms": 1.0 if speedup else None,
           "skipped": status == "skipped", "error": None, "skill_sha256": None, "model": "test-org/test-model",
           "message": "", "tier": "cpu", "created_at": "2026-12-01T00:00:00+00:00",
           "direction": arm.removesuffix("_skill") if skill else None,
           "source_trial": f"p{pid:02d}_r{rep}_solo_{arm.split('2')[0]}" if skill else None,
           "problem_hash": "0" * 64, "prompt_set_sha256": "1" * 64, "protocol_sha256": "2" * 64,
           "prompt_version": "1", "prompts": {}, "task_prompt_sha256": None, "first_message_sha256": None,
           "backend": {"kind": "test"}, "sampling": {}, "budget": {}, "stop_reason": "done", "usage": None,
           "final": None, "best": None, "submissions": [], "skill_md_sha256": None, "skill_md_written": False,
           "final_kernel_sha256": None}
    return AttemptRecord(**{**rec, **extra}).to_json()
