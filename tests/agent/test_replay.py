"""The replay backend through the real loop, parser, store and (end to end) the real CPU-tier verifier;
shared baselines, the verification cache and resumable paired re-timing with a fake clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mkb_eval import problems as P
from mkb_eval.agent import replay
from mkb_eval.agent.backends import BackendError, Sampling, parse_model_spec
from mkb_eval.agent.launch import RunOptions, run_trials
from mkb_eval.agent.loop import _turn_seed
from mkb_eval.agent.parse import Answer, parse_answer
from mkb_eval.agent.prompts import render_skill_task, render_task
from mkb_eval.agent.retiming import RETIME_FILE, done_keys
from mkb_eval.metrics import read_attempts, score
from mkb_eval.metrics.retimed import read_retimes
from mkb_eval.records import VerificationRecord
from tests.agent.fake_retime import FakeRetime
from tests.helpers import attempt


def _conv(pid: int, dsl: str, skill: bool = False, answers: int = 0) -> list[dict[str, str]]:
    task = render_task(P.find(pid), dsl)
    first = render_skill_task(task, "- a note") if skill else task
    conv = [{"role": "user", "content": first.text}]
    for _ in range(answers):
        conv += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "feedback"}]
    return conv


_SAMPLING = Sampling()


def _parsed(backend: replay.ReplayBackend, conv: list[dict[str, str]], sampling: Sampling = _SAMPLING) -> Any:
    return parse_answer(backend.generate([conv], [sampling])[0].text)


def test_solutions_answer_with_the_shipped_kernel_and_a_skill() -> None:
    b = replay.ReplayBackend(replay.open_source("solutions"))
    for dsl in ("cutedsl", "tirx"):
        a = _parsed(b, _conv(28, dsl))
        assert isinstance(a, Answer) and a.kernel == P.find(28).solution_path(dsl).read_text()
        assert a.skill                                   # a skill arm is run, not skipped
    ident = b.identity()
    assert ident["kind"] == "replay" and len(ident["source_sha256"]) == 64 and b.name.startswith("replay-solutions-")
    assert "has no submission 2" in b.generate([_conv(28, "tirx", answers=1)], [Sampling()])[0].text


def test_folder_overrides_by_arm_and_replicate(tmp_path: Path) -> None:
    (tmp_path / "28_tirx.py").write_text("def solve(*x):\n    return 'plain'\n")
    (tmp_path / "28_tirx.cutedsl2tirx_skill.py").write_text("def solve(*x):\n    return 'skill'\n")
    (tmp_path / "28_tirx.cutedsl2tirx_skill.r2.py").write_text("def solve(*x):\n    return 'skill r2'\n")
    (tmp_path / "28_tirx.SKILL.md").write_text("- tirx note\n")
    (tmp_path / "notes.txt").write_text("ignored")
    b = replay.ReplayBackend(replay.open_source(str(tmp_path)), seed=7)
    assert "'plain'" in _parsed(b, _conv(28, "tirx")).kernel and _parsed(b, _conv(28, "tirx")).skill == "- tirx note"
    seed_r1 = _turn_seed(7, "p28_r1_cutedsl2tirx_skill", 0)
    seed_r2 = _turn_seed(7, "p28_r2_cutedsl2tirx_skill", 0)
    assert "'skill'" in _parsed(b, _conv(28, "tirx", skill=True), Sampling(seed=seed_r1)).kernel
    assert "'skill r2'" in _parsed(b, _conv(28, "tirx", skill=True), Sampling(seed=seed_r2)).kernel
    assert not isinstance(_parsed(b, _conv(36, "tirx")), Answer)          # no kernel for it: no blocks
    (tmp_path / "28_cutedsl.solo_tirx.py").write_text("x = 1\n")
    with pytest.raises(BackendError, match="does not run in cutedsl"):
        replay.open_source(str(tmp_path))


def test_run_folder_replays_every_submission_in_order(tmp_path: Path) -> None:
    d = tmp_path / "trials" / "p28_r1_solo_tirx" / "submissions"
    d.mkdir(parents=True)
    for k in (1, 2):
        (d / f"{k:02d}_kernel.py").write_text(f"def solve(*x):\n    return {k}\n")
    (d.parent / "SKILL.md").write_text("- learnt\n")
    (tmp_path / "attempts.jsonl").write_text(json.dumps(attempt("p28_r1_solo_tirx", "incorrect")) + "\n")
    src = replay.open_source(str(tmp_path))
    assert src.kind == "run" and src.max_submissions == 2
    b = replay.ReplayBackend(src, seed=0)
    s0, s1 = (Sampling(seed=_turn_seed(0, "p28_r1_solo_tirx", t)) for t in (0, 1))
    assert "return 1" in _parsed(b, _conv(28, "tirx"), s0).kernel
    assert "return 2" in _parsed(b, _conv(28, "tirx", answers=1), s1).kernel


def test_bad_sources_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="no folder at"):
        parse_model_spec(f"replay:{tmp_path / 'missing'}")
    with pytest.raises(BackendError, match="holds no kernels"):
        parse_model_spec(f"replay:{tmp_path}")


def _fake_verify(calls: list[dict[str, Any]]) -> Any:
    def verify(problem, dsl, kernel, tier="cpu", gpu=0, lane=None, **kw):
        calls.append({"problem": problem.id, "dsl": dsl, "tier": tier, **kw})
        status = "ok" if tier == "gpu" else "unverified"
        rec = VerificationRecord(status=status, problem_id=problem.id, problem=problem.name, problem_hash=problem.hash,
                                 dsl=dsl, kernel_sha256="0", tier=tier, size="full")
        if status == "ok":
            rec.timing.kernel_ms, rec.timing.eager_ms, rec.timing.speedup = 0.5, 1.0, 2.0
        return rec
    return verify


def _opts(run: Path, problems: str = "28", device: str = "cpu", **kw: Any) -> RunOptions:
    base = dict(model="replay:solutions", problems=problems, arms="all", run_dir=str(run), device=device,
                sampling=Sampling(seed=0), workers=2, progress=False, submissions_given=False)
    base.update(kw)
    return RunOptions(**base)  # type: ignore[arg-type]


@pytest.mark.slow
def test_replay_end_to_end_on_the_cpu_tier_leaves_every_unit_unresolved(tmp_path: Path) -> None:
    """Real loop, parser, CPU-tier verifier (compile-only) and store; the re-timing is the CPU tier's."""
    run = tmp_path / "run"
    fake = FakeRetime(tier="cpu")
    summary, _ = run_trials(_opts(run), retime_fn=fake)
    assert summary is not None and len(summary.finished) == 4
    recs = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert {r["status"] for r in recs} == {"unverified"}, [r["message"] for r in recs]
    assert all(r["backend"]["kind"] == "replay" and len(r["backend"]["source_sha256"]) == 64 for r in recs)
    assert all(r["budget"]["submissions"] == 1 and not r["skipped"] for r in recs)
    subs = [json.loads((run / "trials" / r["trial"] / "submissions" / "01_verification.json").read_text()) for r in recs]
    assert sum("verification_reused" in s["flags"] for s in subs) == 2          # the skill arms' identical kernels
    assert len(fake.calls) == 1 and fake.calls[0]["labels"] == sorted(r["arm"] for r in recs)
    res = score(read_attempts(run), timings=read_retimes(run))
    o = res["overall"]
    assert res["params"]["verdict"] == "paired"
    assert o["n_units"] == 2 and o["n_resolved"] == 0 and o["n_unresolved_unverified"] == 2
    assert o["paired"]["helped"] == o["paired"]["harmed"] == 0


def test_resume_in_the_middle_of_retiming(tmp_path: Path) -> None:
    """A group whose re-timing did not finish (the harness failed, or the run was killed) is re-timed by the
    next run, and only it; a torn last line of retime.jsonl is repaired, not glued to the next."""
    run = tmp_path / "run"
    calls: list[dict[str, Any]] = []
    first = FakeRetime(fail_on={36})
    run_trials(_opts(run, "28,36"), verify_fn=_fake_verify(calls), retime_fn=first)
    assert len(first.calls) == 2 and len(done_keys(run)) == 1
    with open(run / RETIME_FILE, "a") as f:
        f.write('{"kind": "retime", "key": "torn')                     # a write cut by a kill
    second = FakeRetime()
    summary, _ = run_trials(_opts(run, "28,36"), verify_fn=_fake_verify(calls), retime_fn=second)
    assert summary is None                                             # every trial reused
    assert [c["problem_id"] for c in second.calls] == [36] and len(done_keys(run)) == 2
    third = FakeRetime()
    run_trials(_opts(run, "28,36"), verify_fn=_fake_verify(calls), retime_fn=third)
    assert third.calls == []
    assert len(read_retimes(run)) == 4                                 # 2 problems x 2 directions


def test_gpu_run_shares_baselines_and_verifies_an_identical_kernel_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    calls: list[dict[str, Any]] = []
    measured: list[tuple[int, bool]] = []

    def measure(problem: P.Problem, compiled: bool, lane: Any) -> float:
        measured.append((problem.id, compiled))
        return 2.0 if compiled else 4.0

    verified_before: list[int] = []            # verifications done when each re-timed window was timed
    fake = FakeRetime(speed=lambda label, sha: verified_before.append(len(calls)) or 0.5)
    run_trials(_opts(run, "28,36", device="cuda", gpus=1), verify_fn=_fake_verify(calls), retime_fn=fake,
               baseline_measure=measure)
    assert verified_before and min(verified_before) == 4           # re-timed after the run's verifications
    assert [c["quiet_alone"] for c in fake.calls] == [True, True]  # and with the host quiet
    assert sorted(measured) == [(28, False), (28, True), (36, False), (36, True)]
    assert len(calls) == 4                                         # 8 trials, 4 distinct kernels
    assert all(c["compile_baseline"] == "cached" and c["reuse_eager"] is True and
               c["cache_dir"] == run / "baselines" for c in calls)
    for kind in ("eager", "compile"):
        lines = (run / "baselines" / f"{kind}_baselines.jsonl").read_text().splitlines()
        assert len(lines) == 2
    assert all(c["lane"] is not None for c in fake.calls)
    res = score(read_attempts(run), timings=read_retimes(run))
    assert res["overall"]["n_resolved"] == 4 and res["overall"]["paired"]["neutral"] == 4

    from mkb_eval.agent import baselines
    from mkb_eval.env import describe

    again = baselines.prepare([P.find(28)], run, None, describe(gpu=True), measure=measure)
    assert len(measured) == 4 and all(b.reused for b in again)     # a rerun times nothing again
