"""Runs with a scripted model and the real CPU-tier verifier: a skill-transfer cell, skips, errors, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mkb_eval.agent.backends import BackendError, Sampling
from mkb_eval.agent.launch import RunOptions, run_trials
from mkb_eval.agent.loop import Budget
from mkb_eval.metrics.inputs import read_attempts
from tests.agent.conftest import solution_script
from tests.agent.scripted import ScriptedBackend, answer

CELL = "solo_cutedsl,solo_tirx,cutedsl2tirx_skill"


def opts(run_dir: Path, root: Path | None = None, **kw: object) -> RunOptions:
    base = dict(problems="28", arms=CELL, run_dir=str(run_dir), budget=Budget(submissions=1),
                sampling=Sampling(seed=1), workers=2, progress=False, root=str(root) if root else None)
    base.update(kw)
    return RunOptions(**base)  # type: ignore[arg-type]


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cell_runs_and_transfers_the_source_skill(tmp_path: Path, solution_backend: ScriptedBackend) -> None:
    run = tmp_path / "run"
    summary, planned = run_trials(opts(run), backend=solution_backend, log=lambda s: None)
    assert summary is not None and len(summary.finished) == 3
    recs = {r["trial"]: r for r in lines(run)}
    assert set(recs) == {"p28_r1_solo_cutedsl", "p28_r1_solo_tirx", "p28_r1_cutedsl2tirx_skill"}
    for r in recs.values():
        assert r["status"] == "unverified", r["message"]      # the shipped kernels compile on the CPU tier
        assert r["usage"]["submissions"] == 1 and r["error"] is None
        assert r["model"] == "scripted-model" and r["tier"] == "cpu"
    skill = recs["p28_r1_cutedsl2tirx_skill"]
    src_skill = (run / "trials" / "p28_r1_solo_cutedsl" / "SKILL.md").read_text()
    attached = (run / "skills" / "p28_r1_cutedsl2tirx_skill.md").read_text()
    assert attached.startswith("## Skill from a prior attempt\n") and src_skill.strip() in attached
    first = json.loads((run / "trials" / "p28_r1_cutedsl2tirx_skill" / "transcript.jsonl").read_text().splitlines()[0])
    base = json.loads((run / "trials" / "p28_r1_solo_tirx" / "transcript.jsonl").read_text().splitlines()[0])
    assert first["content"] == base["content"] + "\n" + attached      # the skill is the only difference
    assert skill["skill_sha256"] and skill["source_trial"] == "p28_r1_solo_cutedsl"
    assert skill["task_prompt_sha256"] == recs["p28_r1_solo_tirx"]["task_prompt_sha256"]
    # artifacts: the final kernel, the verification record of each submission
    tdir = run / "trials" / "p28_r1_solo_tirx"
    assert (tdir / "kernel.py").read_text().startswith("# Fused residual add")
    assert json.loads((tdir / "submissions" / "01_verification.json").read_text())["status"] == "unverified"
    # the metrics read the run as written
    loaded = read_attempts(run)
    assert len(loaded.outcomes) == 3 and not loaded.warnings
    # the two solos were generated in one batch; the skill trial after its source
    assert solution_backend.batches[0] == 2

    # rerunning reuses everything and writes nothing
    before = (run / "attempts.jsonl").read_bytes()
    summary2, planned2 = run_trials(opts(run), backend=solution_backend, log=lambda s: None)
    assert summary2 is None and {p.status for p in planned2} == {"reuse"}
    assert (run / "attempts.jsonl").read_bytes() == before


def test_blank_skill_is_recorded_as_skipped(tmp_path: Path) -> None:
    def script(messages, turn):
        return answer("def solve(*xs):\n    return xs[0]\n", skill="   ")

    run = tmp_path / "run"
    calls: list[str] = []

    def fake_verify(problem, dsl, kernel, tier="cpu", **kw):
        calls.append(dsl)
        from mkb_eval.records import VerificationRecord

        return VerificationRecord(status="compile_error", problem_id=problem.id, problem=problem.name,
                                  problem_hash=problem.hash, dsl=dsl, kernel_sha256="0", tier=tier, size="smoke",
                                  message="no DSL kernel in this file")

    summary, _ = run_trials(opts(run, arms="cutedsl2tirx_skill"), backend=ScriptedBackend(script),
                            verify_fn=fake_verify, log=lambda s: None)
    recs = {r["trial"]: r for r in lines(run)}
    assert recs["p28_r1_cutedsl2tirx_skill"]["status"] == "skipped"
    assert recs["p28_r1_cutedsl2tirx_skill"]["skipped"] is True
    assert recs["p28_r1_solo_cutedsl"]["status"] == "compile_error"
    assert calls == ["cutedsl"]          # the skipped trial never ran
    # a skipped record is a finished trial: reused next time
    _, planned = run_trials(opts(run, arms="cutedsl2tirx_skill"), backend=ScriptedBackend(script),
                            verify_fn=fake_verify, log=lambda s: None)
    assert {p.status for p in planned} == {"reuse"}


class FlakyBackend(ScriptedBackend):
    """Fails every generation of the solo CuTe DSL trial (an engine error), answers the others."""

    def generate(self, conversations, sampling):
        if any("_cutedsl`" in c[0]["content"] for c in conversations):
            raise BackendError("the engine died")
        return super().generate(conversations, sampling)


def test_source_error_blocks_its_skill_trial_and_is_rerun(tmp_path: Path) -> None:
    run = tmp_path / "run"
    backend = FlakyBackend(solution_script)
    summary, _ = run_trials(opts(run, arms="solo_cutedsl,cutedsl2tirx_skill"), backend=backend,
                            log=lambda s: None)
    assert summary is not None and summary.skipped_no_record == ["p28_r1_cutedsl2tirx_skill"]
    recs = {r["trial"]: r for r in lines(run)}
    assert set(recs) == {"p28_r1_solo_cutedsl"}
    assert "the engine died" in recs["p28_r1_solo_cutedsl"]["error"]
    _, planned = run_trials(opts(run, arms="solo_cutedsl,cutedsl2tirx_skill", dry_run=True),
                            backend=backend, log=lambda s: None)
    assert {p.key.id: p.status for p in planned} == {"p28_r1_solo_cutedsl": "rerun", "p28_r1_cutedsl2tirx_skill": "run"}


def test_gpu_tier_pool_spreads_over_gpus_with_one_lane_each(tmp_path: Path) -> None:
    """Each submission goes to the least busy GPU (in turn among equally busy ones), verified with that
    GPU's timing lane."""
    from mkb_eval import problems as P
    from mkb_eval.agent.runner import VerificationPool
    from mkb_eval.harness.lanes import GpuLane
    from mkb_eval.records import VerificationRecord

    seen: list[tuple[str, int, int]] = []

    def fake_verify(problem, dsl, kernel, tier="cpu", gpu=0, lane=None, **kw):
        assert isinstance(lane, GpuLane) and lane.index == gpu
        seen.append((tier, gpu, id(lane)))
        return VerificationRecord(status="ok", problem_id=problem.id, problem=problem.name, problem_hash=problem.hash,
                                  dsl=dsl, kernel_sha256="0", tier=tier, size="full")

    pool = VerificationPool("gpu", workers=4, gpus=2, verify_fn=fake_verify)
    prob = P.find(28)
    results = [pool.submit(prob, "tirx", tmp_path / f"k{i}.py").result() for i in range(4)]
    pool.close()
    assert [r["status"] for r in results] == ["ok"] * 4
    assert [g for _, g, _ in seen] == [0, 1, 0, 1] and {t for t, _, _ in seen} == {"gpu"}
    assert seen[0][2] == seen[2][2] != seen[1][2]          # one lane object per GPU, reused
    with pytest.raises(ValueError, match="needs at least one GPU"):
        VerificationPool("gpu", workers=1, gpus=0, verify_fn=fake_verify)


def test_warm_pool_hands_each_verification_a_started_worker() -> None:
    """With warm workers the real verifier gets a worker started ahead of need, and close() stops the rest."""
    from mkb_eval import problems as P
    from mkb_eval.agent.runner import VerificationPool

    pool = VerificationPool("cpu", workers=1, warm=True)
    prob = P.find(36)
    rec = pool.submit(prob, "tirx", prob.solution_path("tirx")).result()
    idle = [w for ws in pool._warm._idle.values() for w in ws]
    pool.close()
    assert rec["status"] == "unverified" and rec["sandbox"]["worker"].startswith("warm"), rec["message"]
    assert idle and all(w.proc.poll() is not None for w in idle)


class OneFailedRequestBackend(ScriptedBackend):
    """Answers every conversation of a batch, except that the solo CuTe DSL trial's request failed (as the
    OpenAI backend reports a failed request: a Generation with ``error``)."""

    def generate(self, conversations, sampling):
        from mkb_eval.agent.backends import Generation

        gens = super().generate(conversations, sampling)
        return [Generation(text="", prompt_tokens=0, completion_tokens=0, finish_reason="error",
                           error="http://127.0.0.1:1/v1/chat/completions answered HTTP 500: engine dead")
                if "_cutedsl`" in c[0]["content"] else g for c, g in zip(conversations, gens, strict=True)]


def test_one_failed_request_is_that_trials_error_and_the_run_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary, _ = run_trials(opts(run, arms="solo_cutedsl,solo_tirx"), backend=OneFailedRequestBackend(solution_script),
                            log=lambda s: None)
    assert summary is not None
    recs = {r["trial"]: r for r in lines(run)}
    assert "answered HTTP 500" in recs["p28_r1_solo_cutedsl"]["error"]
    assert recs["p28_r1_solo_tirx"]["error"] is None and recs["p28_r1_solo_tirx"]["status"] == "unverified"
