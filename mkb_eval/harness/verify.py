"""Verify one kernel against one problem: the orchestration of worker (untrusted) and judge (trusted).

GPU tier: static policy → worker phase 1 (5 secret-seed draws + the DSL-dependence draw) →
judge → worker phase 2 under the GPU's exclusive lane: 10 warmup + 50 event-timed draws (their seeds
sent at the timing gate), then a parent-attested window (:mod:`mkb_eval.harness.attest`) and the eager
baseline with its own window → the timing verdict (re-timed once when in doubt) → torch.compile
baseline → judge the 3 window outputs chosen after the window → record. CPU tier: static policy, the reference at smoke
size, and a compile-only run of the candidate; what needs a GPU is marked ``unverified``.

This module is the order of those steps; the steps are in their own modules: the worker process
(:mod:`.spawn`), its job (:mod:`.jobs`), the lane hold (:mod:`.lane_hold`), phase 1 (:mod:`.phase1`),
the timed phase (:mod:`.timed`), the baselines (:mod:`.baselines`) and path redaction (:mod:`.redact`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.env import describe
from mkb_eval.harness import attest, timed
from mkb_eval.harness.baselines import eager_baseline, time_compile_baseline
from mkb_eval.harness.job import Job
from mkb_eval.harness.jobs import CORRECTNESS_DRAWS, TIMING_DRAWS, WARMUP_DRAWS, make_job
from mkb_eval.harness.lane_hold import Held
from mkb_eval.harness.lanes import GpuLane
from mkb_eval.harness.phase1 import judge_phase1, run_phase1
from mkb_eval.harness.policy import check_source
from mkb_eval.harness.protocol import EventsOp, EventsReport, Final, Phase1Report
from mkb_eval.harness.redact import redact_paths
from mkb_eval.harness.spawn import Limits, Worker, fail_from_worker, host_gpu, spawn_worker, stage_times, tail
from mkb_eval.records import Env, SandboxFacts, VerificationRecord, artifacts_from_worker

__all__ = ["Limits", "default_cache_dir", "spawn_worker", "verify", "verify_source", "warn_unconfined"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MKB_CACHE_DIR", Path.home() / ".cache" / "mkb"))


def verify(problem: P.Problem | str | int, dsl: str, kernel: str | Path, *, tier: str = "auto",
           size: str | None = None, gpu: int = 0, lane: GpuLane | None = None, limits: Limits | None = None,
           compile_baseline: bool | str = True, cache_dir: Path | None = None, keep_dir: bool = False,
           pool: Any = None, reuse_eager: bool = False) -> VerificationRecord:
    """Verify ``kernel`` (a path to kernel.py) for ``problem`` in ``dsl``; never raises for candidate faults.

    ``gpu`` picks the device; ``lane`` is that GPU's timing lane when several evaluations run at
    once (a private one otherwise). ``compile_baseline="cached"`` takes the torch.compile time
    from the cache only, so a sweep never compiles a reference inside a timing lane; ``reuse_eager``
    measures the eager time once per problem (size, GPU model, torch) in the cache and reuses it
    (flag ``eager_baseline_from_cache``): the other DSL's evaluation skips it inside its timing lane. ``pool`` (a
    :class:`~mkb_eval.harness.pool.WarmPool`) supplies a worker started ahead of need.
    """
    if dsl not in P.DSLS:
        raise ValueError(f"unknown DSL '{dsl}' (choose from {', '.join(P.DSLS)})")
    prob = problem if isinstance(problem, P.Problem) else P.find(problem)
    kernel = Path(kernel)
    source = kernel.read_text(errors="replace")
    import torch

    if tier == "auto":
        tier = "gpu" if torch.cuda.is_available() else "cpu"
    if tier not in ("gpu", "cpu"):
        raise ValueError(f"tier must be gpu, cpu or auto, not {tier!r}")
    size = size or ("full" if tier == "gpu" else "smoke")
    limits = limits or Limits()
    cache_dir = cache_dir or default_cache_dir()
    t_start = time.perf_counter()
    rec = VerificationRecord(
        status="crashed", problem_id=prob.id, problem=prob.name, problem_hash=prob.hash, dsl=dsl,
        kernel_sha256=hashlib.sha256(source.encode()).hexdigest(), tier=tier, size=size,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        env=Env(**describe(gpu=tier == "gpu"), gpu_index=host_gpu(gpu) if tier == "gpu" else None))
    pol = check_source(source, kernel.name)
    rec.flags, rec.policy_details = list(pol.flags), list(pol.details)
    if {"syntax_error", "missing_solve"} & set(pol.flags):
        rec.status, rec.stage = "compile_error", "parse"
        rec.message = ("SyntaxError: " if "syntax_error" in pol.flags else "") + "; ".join(pol.details)
        return rec
    if pol.violations:
        rec.status, rec.stage = "policy_violation", "static_check"
        rec.message = "forbidden: " + "; ".join(d for d in pol.details if d.split(":")[0] in pol.violations)
        return rec

    w = (pool.take(tier, gpu, limits) if pool is not None else None) or spawn_worker(tier, gpu, limits)
    root = w.root
    shutil.copyfile(kernel, root / "work" / "kernel.py")
    try:
        if tier == "cpu":
            _run_cpu(rec, prob, dsl, w, limits)
        else:
            _run_gpu(rec, prob, dsl, w, size, gpu, lane or GpuLane(gpu), limits, compile_baseline, cache_dir,
                     reuse_eager)
    finally:
        w.kill()
        rec.message, rec.stdout_tail, rec.stderr_tail = (
            redact_paths(x, root) for x in (rec.message, rec.stdout_tail, rec.stderr_tail))
        rec.stages_s["total"] = round(time.perf_counter() - t_start, 3)
        warn_unconfined(rec.sandbox)
        if not keep_dir:
            shutil.rmtree(root, ignore_errors=True)
    return rec


_WARNED: list[str] = []


def warn_unconfined(facts: SandboxFacts) -> None:
    """Warn once per process when a worker could write outside its evaluation folder (no Landlock)."""
    ow = facts.outside_write or "unknown"
    if _WARNED or ow in ("denied", "unknown") or ow.startswith("denied"):
        return
    _WARNED.append(ow)
    import warnings

    warnings.warn(f"the worker could write outside its evaluation folder ({facts.confinement or '?'}): "
                  "candidate code runs with this user's rights on files; see the record's sandbox facts",
                  RuntimeWarning, stacklevel=3)


def verify_source(problem: P.Problem | str | int, dsl: str, source: str, **kwargs: Any) -> dict[str, Any]:
    """Verify kernel source text; returns the record as a dict (for the metric's GPU mode)."""
    with tempfile.TemporaryDirectory(prefix="mkb-src-") as d:
        path = Path(d) / "kernel.py"
        path.write_text(source)
        return verify(problem, dsl, path, **kwargs).to_dict()


def _run_cpu(rec: VerificationRecord, prob: P.Problem, dsl: str, w: Worker, limits: Limits) -> None:
    import torch

    from mkb_eval.harness.judge import Judge

    from mkb_eval.harness import transport
    from mkb_eval.harness.tolerance import Mismatch, check_descriptor

    root = w.root
    job = make_job(prob, dsl, root, "cpu", "smoke", "cpu", user=w.limits.sandbox.run_as)
    t0 = time.perf_counter()
    judge = Judge(prob, "smoke", "cpu")
    ref, _ = judge.expected(judge.inputs(job.correctness_seeds[0]))   # reference and anchor at smoke size
    rec.stages_s["reference_smoke"] = round(time.perf_counter() - t0, 3)
    rec.correctness.reference_smoke = "ok"
    del torch
    w.start(job)
    try:
        msg, how = w.wait_for(("final",), limits.cpu_s)
        out_path = root / "out" / "cpu_out.pt"
        bad = None
        if msg and os.path.lexists(out_path):
            try:                                  # the worker's file: strictly parsed, structure only
                with transport.open_output(out_path) as saved:
                    bad = check_descriptor(saved.root, ref)
            except transport.TransportError as e:
                bad = Mismatch("output", f"unreadable output file: {e}")
        if isinstance(msg, Final) and msg.status == "unverified" and bad:
            rec.status, rec.stage = "incorrect", "structure"
            rec.message = f"the returned structure does not match the reference's: {bad}"
        elif isinstance(msg, Final) and msg.status == "unverified":
            rec.status, rec.stage = "unverified", "compile_only"
            rec.message = (f"compiled for sm_90a on CPU ({msg.launches} launch(es) intercepted); "
                           "correctness and speed need a GPU")
            rec.artifacts = artifacts_from_worker(msg.artifacts or {})
            rec.stages_s.update(import_s=round(msg.import_s, 3), compile_s=round(msg.compile_s, 3))
            if msg.after_launch_error:
                rec.artifacts.after_launch_error = msg.after_launch_error[-1000:]
        else:
            fail_from_worker(rec, w, how, limits.cpu_s)
    finally:
        w.kill()
        rec.stdout_tail, rec.stderr_tail = tail(w.stdout), tail(w.stderr)
        rec.stages_s.update(stage_times(w))
        rec.sandbox = SandboxFacts(**w.facts())


def _judge_parts(rec: VerificationRecord, correctness: dict[str, float], spent: dict[str, float]) -> None:
    """The judge's seconds by part (inputs, reference, read_output, compare, digest), for the correctness
    draws and for the re-checks: where the parent's judging goes."""
    rec.stages_s.update({f"judge_correctness_{k}": v for k, v in correctness.items()})
    rec.stages_s.update({f"judge_rechecks_{k}": round(v - correctness.get(k, 0.0), 4) for k, v in spent.items()})


def _run_gpu(rec: VerificationRecord, prob: P.Problem, dsl: str, w: Worker, size: str, gpu: int, lane: GpuLane,
             limits: Limits, compile_baseline: bool | str, cache_dir: Path, reuse_eager: bool = False) -> None:
    """Worker start → (lane shared) phase 1 + judging → (lane exclusive) timing + baselines → rechecks."""
    from mkb_eval.harness.judge import Judge

    job = make_job(prob, dsl, w.root, "gpu", size, "cuda:0", gpu, user=w.limits.sandbox.run_as)    # the worker sees one GPU
    judge = Judge(prob, size, f"cuda:{gpu}")
    out = w.root / "out"
    w.start(job)
    try:
        t0 = time.perf_counter()
        msg, how = w.wait_for(("ready", "final"), limits.correctness_s)
        rec.stages_s["worker_start"] = round(time.perf_counter() - t0, 3)
        if not msg or isinstance(msg, Final):
            fail_from_worker(rec, w, how, limits.correctness_s)
            return
        held = Held(lane)
        try:
            msg, how = run_phase1(w, held, limits.correctness_s, rec)
            if not isinstance(msg, Phase1Report):              # a final message, or none
                fail_from_worker(rec, w, how, limits.correctness_s)
                return
            if not judge_phase1(rec, judge, job, msg, out, between=held.step_aside):
                return
        finally:
            held.release()
            rec.stages_s["lane_step_aside"] = round(held.stepped_aside, 3)
        t0 = time.perf_counter()
        with lane.exclusive():
            rec.stages_s["timing_lane_wait"] = round(time.perf_counter() - t0, 3)
            outcome = _timed_phase(rec, prob, judge, job, w, size, gpu, lane, limits, cache_dir, reuse_eager)
            if outcome is None:
                return
            timed.finish(w)
            w.kill()
            time_compile_baseline(rec, prob, size, outcome.timing, compile_baseline, cache_dir,
                                  timed.Reference(prob, size, judge, lane.timer, job.timing_cpu), outcome.warmup,
                                  outcome.timing_seeds)
    finally:
        w.kill()
        rec.stdout_tail, rec.stderr_tail = tail(w.stdout), tail(w.stderr)
        rec.stages_s.update(stage_times(w))
        rec.sandbox = SandboxFacts(**w.facts())
    held.waited = 0.0
    held.acquire()
    try:
        rec.stages_s["recheck_lane_wait"] = round(held.waited, 3)
        before = dict(judge.spent)                  # the correctness draws' parts so far
        t0, aside = time.perf_counter(), held.stepped_aside
        bad = timed.judge_windows(judge, outcome.windows, out, between=held.step_aside)
        rec.stages_s["judge_rechecks"] = round(time.perf_counter() - t0 - (held.stepped_aside - aside), 3)   # judging only
        _judge_parts(rec, before, judge.spent)
    finally:
        held.release()
        rec.stages_s["lane_step_aside"] = round(held.stepped_aside, 3)     # phase 1 and rechecks
    rec.timing = outcome.timing
    if bad:
        rec.status, rec.stage, rec.message = "incorrect", "timing_recheck", bad
        return
    v = outcome.verdict
    rec.flags = sorted(set(rec.flags) | set(v.flags))
    if v.status != "ok":
        rec.status, rec.stage, rec.message = v.status, "timing_verdict", v.message
        return
    timing = outcome.timing
    rec.status, rec.stage = "ok", "done"
    n_checked = sum(len(win.saved) for win in outcome.windows)
    rec.message = (f"passed {CORRECTNESS_DRAWS} draws + {n_checked} re-checked window outputs; {timing.kernel_ms:.4f} ms "
                   f"(attested {timing.attested_ms:.4f}, worker {timing.worker_event_ms:.4f}) vs eager "
                   f"{timing.eager_ms:.4f} ms ({timing.speedup:.2f}x)")


@dataclass


class _Outcome(timed.TimedOutcome):
    warmup: list[int] = field(default_factory=list)
    timing_seeds: list[int] = field(default_factory=list)


def _timed_phase(rec: VerificationRecord, prob: P.Problem, judge: Any, job: Job, w: Worker, size: str,
                 gpu: int, lane: GpuLane, limits: Limits, cache_dir: Path, reuse_eager: bool) -> _Outcome | None:
    """Inside the exclusive lane: the timing gate with the event draws' seeds, the worker's event report,
    then :func:`timed.attested_phase`. None (status set) when the worker failed."""
    import torch

    warmup, timing_seeds = timed.seeds(WARMUP_DRAWS), timed.seeds(TIMING_DRAWS)
    t0 = time.perf_counter()
    try:                                  # the timing gate: the event draws' seeds reach the worker only now
        w.gate.send_op(EventsOp(warmup, timing_seeds, device=True))
    except OSError:
        pass                              # the worker is gone: waiting below says how
    ev, how = w.wait_for(("events", "final"), limits.timing_s)
    rec.stages_s["worker_timing"] = round(time.perf_counter() - t0, 3)
    if not isinstance(ev, EventsReport):                # a final message, or none
        fail_from_worker(rec, w, how, limits.timing_s)
        return None
    l2 = int(getattr(torch.cuda.get_device_properties(gpu), "L2_cache_size", 0) or 0)
    io = judge.io_bytes                   # (input, reference output) bytes of a draw, once a draw was judged
    calls = attest.window_calls(io[0], io[1], l2) if io is not None else attest.WINDOW_CALLS
    ref = timed.Reference(prob, size, judge, lane.timer, job.timing_cpu, share=reuse_eager)

    def eager(measure: Callable[[], float]) -> float:
        return eager_baseline(rec, prob, size, cache_dir, reuse_eager, measure)

    try:
        res = timed.attested_phase(w, ref, ev, calls, limits.timing_s, eager, rec.stages_s,
                                   prob.sol.sol_ms if size == "full" else None, WARMUP_DRAWS, TIMING_DRAWS,
                                   warmup, timing_seeds)
    except timed.WindowFailed as f:
        if f.status is None:
            fail_from_worker(rec, w, f.how, limits.timing_s)
        else:
            rec.status, rec.stage, rec.message = f.status, "attested_window", f.message
            rec.flags = sorted(set(rec.flags) | set(f.flags))
        return None
    return _Outcome(res.timing, res.verdict, res.windows, res.calibrations, warmup, timing_seeds)

