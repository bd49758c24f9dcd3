"""Planning: run / rerun / stale / reuse, and the stale trials refused without --rerun-stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mkb_eval.agent import plan as PL
from mkb_eval.agent.arms import TrialKey, parse_arms, parse_trial
from mkb_eval.agent.backends import Sampling
from mkb_eval.agent.launch import RunOptions, run_trials
from mkb_eval.agent.loop import Budget
from mkb_eval.records import VerificationRecord
from tests.agent.scripted import ScriptedBackend, answer

S = PL.Stamps("ph", "pp", "proto")


def rec(trial: str, **kw: object) -> dict:
    return {"trial": trial, "problem_hash": "ph", "prompt_set_sha256": "pp", "protocol_sha256": "proto",
            "error": None, "skill_sha256": None, **kw}


def test_select_pulls_in_sources() -> None:
    keys = PL.select([28], ["tirx2cutedsl_skill"], 2)
    assert [k.id for k in keys] == ["p28_r1_solo_tirx", "p28_r1_tirx2cutedsl_skill",
                                    "p28_r2_solo_tirx", "p28_r2_tirx2cutedsl_skill"]
    assert parse_trial("p28_r2_solo_tirx") == TrialKey(28, 2, "solo_tirx")
    assert parse_arms("all")[0] == "solo_cutedsl"


def test_statuses() -> None:
    keys = PL.select([28], ["cutedsl2tirx_skill", "solo_tirx"], 1)
    skill_text = "- a finding"
    records = {
        "p28_r1_solo_cutedsl": rec("p28_r1_solo_cutedsl"),
        "p28_r1_solo_tirx": rec("p28_r1_solo_tirx", error="backend: died"),
        "p28_r1_cutedsl2tirx_skill": rec("p28_r1_cutedsl2tirx_skill", skill_sha256=PL.skill_sha256(skill_text)),
    }
    got = {p.key.id: p.status for p in PL.plan(keys, records, {28: S}, {"p28_r1_solo_cutedsl": skill_text})}
    assert got == {"p28_r1_solo_cutedsl": "reuse", "p28_r1_solo_tirx": "rerun", "p28_r1_cutedsl2tirx_skill": "reuse"}


@pytest.mark.parametrize("change, reason", [
    ({"problem_hash": "other"}, "the problem changed"),
    ({"prompt_set_sha256": "other"}, "the prompts changed"),
    ({"protocol_sha256": "other"}, "budget, sampling or tier"),
])
def test_stale_by_stamp(change: dict, reason: str) -> None:
    keys = [TrialKey(28, 1, "solo_tirx")]
    p = PL.plan(keys, {"p28_r1_solo_tirx": rec("p28_r1_solo_tirx", **change)}, {28: S}, {})
    assert p[0].status == "stale" and reason in p[0].reason
    with pytest.raises(PL.PlanError, match="1 finished trial"):
        PL.check_stale(p, rerun_stale=False)
    PL.check_stale(p, rerun_stale=True)


def test_skill_stale_when_source_skill_changed_or_source_reruns() -> None:
    keys = PL.select([28], ["cutedsl2tirx_skill"], 1)
    sk = rec("p28_r1_cutedsl2tirx_skill", skill_sha256=PL.skill_sha256("- old"))
    p = {x.key.id: x for x in PL.plan(keys, {"p28_r1_solo_cutedsl": rec("p28_r1_solo_cutedsl"),
                                             "p28_r1_cutedsl2tirx_skill": sk}, {28: S}, {"p28_r1_solo_cutedsl": "- new"})}
    assert p["p28_r1_cutedsl2tirx_skill"].status == "stale" and "SKILL.md" in p["p28_r1_cutedsl2tirx_skill"].reason
    p = {x.key.id: x for x in PL.plan(keys, {"p28_r1_cutedsl2tirx_skill": sk}, {28: S}, {})}
    assert p["p28_r1_cutedsl2tirx_skill"].status == "stale" and "is to be run" in p["p28_r1_cutedsl2tirx_skill"].reason


def _fake_verify(problem, dsl, kernel, tier="cpu", **kw):
    """Stands in for the verifier where a test is about planning, not verification."""
    return VerificationRecord(status="unverified", problem_id=problem.id, problem=problem.name,
                              problem_hash=problem.hash, dsl=dsl, kernel_sha256="0", tier=tier, size="smoke",
                              message="compiled")


def test_changed_problem_and_source_skill_make_a_finished_run_stale(tmp_path: Path, problems_root: Path) -> None:
    turns = {"n": 0}

    def script(messages, turn):
        turns["n"] += 1
        return answer("def solve(*xs):\n    return xs[0]\n", skill=f"- finding {turns['n']}")

    run = tmp_path / "run"
    o = RunOptions(problems="28", arms="cutedsl2tirx_skill", run_dir=str(run), budget=Budget(submissions=1),
                   sampling=Sampling(seed=0), progress=False, root=str(problems_root))
    run_trials(o, backend=ScriptedBackend(script), verify_fn=_fake_verify, log=lambda s: None)
    n_lines = len((run / "attempts.jsonl").read_text().splitlines())
    assert n_lines == 2

    # 1) the source's SKILL.md is edited: the skill trial is stale, the source is not
    skill = run / "trials" / "p28_r1_solo_cutedsl" / "SKILL.md"
    skill.write_text(skill.read_text() + "- edited\n")
    with pytest.raises(PL.PlanError, match="p28_r1_cutedsl2tirx_skill: the SKILL.md of its source"):
        run_trials(o, backend=ScriptedBackend(script), verify_fn=_fake_verify, log=lambda s: None)
    assert len((run / "attempts.jsonl").read_text().splitlines()) == n_lines   # refused: nothing written

    # 2) the problem changes: both are stale; --rerun-stale reruns them and archives the old artifacts
    ref = next(problems_root.glob("*/28_*")) / "reference.py"
    ref.write_text(ref.read_text().replace("EPS = 1e-5", "EPS = 1e-6"))
    with pytest.raises(PL.PlanError, match="2 finished trial.*the problem changed"):
        run_trials(o, backend=ScriptedBackend(script), verify_fn=_fake_verify, log=lambda s: None)
    o.rerun_stale = True
    summary, planned = run_trials(o, backend=ScriptedBackend(script), verify_fn=_fake_verify, log=lambda s: None)
    assert summary is not None and len(summary.finished) == 2
    lines = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and len({x["problem_hash"] for x in lines}) == 2
    assert len(list((run / "archive").glob("*__p28_r1_*"))) == 2
    o.rerun_stale = False
    _, planned = run_trials(o, backend=ScriptedBackend(script), verify_fn=_fake_verify, log=lambda s: None)
    assert {p.status for p in planned} == {"reuse"}
