"""Interleaved re-timing of several kernels of one problem (the A/A contract: the two sides of a
comparison are re-timed side by side, not taken from evaluations made minutes apart).

One fresh worker per kernel (the same worker, sandbox and fork-server path as ``verify``, in job mode
``retime``): compiled and sanity-checked once (one correctness draw, judged), then ``rounds`` rounds
under ONE exclusive hold of the GPU's lane (and, when the caller shares a :mod:`~mkb_eval.harness.quiet` hold
between its re-timings, with the host quiet), each round one timed window per kernel (event draws and a
parent-attested window, :mod:`mkb_eval.harness.attest`), the order alternated round by round. Each
window gets its own verdict (re-timed once when in doubt, as in ``verify``) and one output of its
attested window re-checked. On the CPU tier every window is ``unverified``: nothing is timed.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.env import describe
from mkb_eval.harness import attest, timed
from mkb_eval.harness.job import Job
from mkb_eval.harness.protocol import EventsOp, EventsReport, Final, Phase1Report
from mkb_eval.harness.quiet import LOUD


@dataclass
class RetimeWindow:
    """One timed window of one kernel in one round."""

    label: str                 # the caller's label, e.g. "base", "skill", "source"
    round: int                 # 0-based
    position: int              # order of this window within its round
    kernel_ms: float | None    # recorded time of this window (max(event median, attested)), None if failed
    attested_ms: float | None
    worker_event_ms: float | None
    device_ms: float | None    # GPU time on the call's stream if measured, else None
    status: str                # "ok" or a failure status
    message: str = ""
    span_per_call_ms: float | None = None   # the window's ready-to-done span per call, the parent's clock
    commit_ms: float | None = None          # the trusted commitment cost per call taken out of it


@dataclass
class RetimeResult:
    problem_id: int
    labels: list[str]
    windows: list[RetimeWindow]
    env: dict                  # GPU, versions (mkb_eval.env.describe)
    stages_s: dict[str, float]
    tier: str                  # "gpu" | "cpu"


def round_orders(labels: list[str], rounds: int, seed: int | None = None) -> list[list[str]]:
    """The order of each round: A B, B A, ... for two labels; for more, a seeded shuffle on even rounds
    and its reverse on the odd round after it (every label sits early and late equally often)."""
    rng = random.Random(seed)
    orders: list[list[str]] = []
    for r in range(rounds):
        if r % 2:
            orders.append(list(reversed(orders[-1])))
        elif len(labels) <= 2:
            orders.append(list(labels))
        else:
            orders.append(rng.sample(labels, len(labels)))
    return orders


@dataclass
class _Side:
    """One kernel's worker and what became of it."""

    label: str
    dsl: str
    path: Path
    worker: Any = None
    failed: str | None = None          # a status: every later window of this kernel carries it
    message: str = ""
    events_seen: int = 0
    windows: list[attest.WindowStamps] = field(default_factory=list)


def retime(problem: P.Problem | str | int, kernels: dict[str, tuple[str, Path]], *, rounds: int = 5,
           warmup: int = 5, draws: int = 20, gpu: int = 0, lane: Any = None, limits: Any = None, pool: Any = None,
           seed: int | None = None, quiet: Any = None) -> RetimeResult:
    """Re-time kernels {label: (dsl, kernel.py)} interleaved: one fresh worker per kernel, compiled once and
    sanity-checked once (1 correctness draw judged), then `rounds` rounds under ONE exclusive hold of the GPU
    lane, each round one timed window per kernel, the order alternated round by round (A B, B A, ... with a
    seeded shuffle for >2 labels). With ``quiet`` (a :class:`~mkb_eval.harness.quiet.QuietHost` shared by the
    process's re-timings), starting, checking and judging are its busy sections and the timed rounds its quiet
    one. Never raises for candidate faults (a failed kernel gets status windows)."""
    import torch

    prob = problem if isinstance(problem, P.Problem) else P.find(problem)
    if not kernels:
        raise ValueError("retime needs at least one kernel")
    for label, (dsl, path) in kernels.items():
        if dsl not in P.DSLS:
            raise ValueError(f"{label}: unknown DSL '{dsl}' (choose from {', '.join(P.DSLS)})")
        if not Path(path).is_file():
            raise ValueError(f"{label}: no kernel file at {path}")
    if rounds < 1 or draws < 1 or warmup < 0:
        raise ValueError("retime needs rounds >= 1, draws >= 1 and warmup >= 0")
    t_start = time.perf_counter()
    labels = list(kernels)
    orders = round_orders(labels, rounds, seed)
    tier = "gpu" if torch.cuda.is_available() else "cpu"
    env = describe(gpu=tier == "gpu")
    stages: dict[str, float] = {}
    if tier == "cpu":
        windows = [RetimeWindow(label, r, pos, None, None, None, None, "unverified",
                                "timing needs a GPU; the CPU tier times nothing")
                   for r, order in enumerate(orders) for pos, label in enumerate(order)]
        stages["total"] = round(time.perf_counter() - t_start, 3)
        return RetimeResult(prob.id, labels, windows, env, stages, tier)
    return _retime_gpu(prob, kernels, orders, warmup, draws, gpu, lane, limits, pool, env, stages, t_start,
                       quiet or LOUD)


def _retime_gpu(prob: P.Problem, kernels: dict[str, tuple[str, Path]], orders: list[list[str]], warmup: int,
                draws: int, gpu: int, lane: Any, limits: Any, pool: Any, env: dict, stages: dict[str, float],
                t_start: float, quiet: Any) -> RetimeResult:
    import torch

    from mkb_eval.harness.judge import Judge
    from mkb_eval.harness.lanes import GpuLane
    from mkb_eval.harness.spawn import Limits, host_gpu

    limits = limits or Limits()
    lane = lane or GpuLane(gpu)
    sides = {label: _Side(label, dsl, Path(path)) for label, (dsl, path) in kernels.items()}
    results: list[RetimeWindow] = []
    try:
        with quiet.busy() as waited:                     # start, compile, check: beside other busy work
            stages["busy_wait"] = round(waited, 3)
            t0 = time.perf_counter()
            judge = Judge(prob, "full", f"cuda:{gpu}")
            jobs = _start_sides(prob, sides, gpu, limits, pool)
            for side in sides.values():
                if side.worker is not None:
                    _sanity(side, jobs[side.label], judge, lane, limits)
            stages["start_and_check"] = round(time.perf_counter() - t0, 3)
        l2 = int(getattr(torch.cuda.get_device_properties(gpu), "L2_cache_size", 0) or 0)
        calls = attest.window_calls(*judge.io_bytes, l2) if judge.io_bytes else attest.WINDOW_CALLS
        cpu = next((j.timing_cpu for j in jobs.values()), None)
        ref = timed.Reference(prob, "full", judge, lane.timer, cpu, reuse=True)
        with quiet.quiet() as waited:                    # the timed rounds: nothing else of the process runs
            stages["quiet_wait"] = round(waited, 3)
            t0 = time.perf_counter()
            with lane.exclusive():
                stages["timing_lane_wait"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                for r, order in enumerate(orders):
                    for pos, label in enumerate(order):
                        results.append(_one_window(sides[label], r, pos, warmup, draws, calls, ref, limits,
                                                   prob.sol.sol_ms))
                stages["timed_rounds"] = round(time.perf_counter() - t0, 3)
                for side in sides.values():
                    if side.worker is not None:
                        side.worker.kill()
        t0 = time.perf_counter()
        with quiet.busy(), lane.shared():
            _judge_rounds(judge, sides, results)
        stages["judge"] = round(time.perf_counter() - t0, 3)
    finally:
        for side in sides.values():
            if side.worker is not None:
                side.worker.kill()
                shutil.rmtree(side.worker.root, ignore_errors=True)
    stages["total"] = round(time.perf_counter() - t_start, 3)
    return RetimeResult(prob.id, list(kernels), results, {**env, "gpu_index": host_gpu(gpu)}, stages, "gpu")


def _start_sides(prob: P.Problem, sides: dict[str, _Side], gpu: int, limits: Any,
                 pool: Any) -> dict[str, Job]:
    """A worker per kernel that passes the static policy, all started before any is waited for (their
    imports overlap); the jobs by label. A kernel the policy refuses is marked failed instead."""
    from mkb_eval.harness.jobs import make_job
    from mkb_eval.harness.policy import check_source
    from mkb_eval.harness.spawn import spawn_worker

    jobs: dict[str, Job] = {}
    for side in sides.values():
        pol = check_source(Path(side.path).read_text(errors="replace"), side.path.name)
        if pol.violations or {"syntax_error", "missing_solve"} & set(pol.flags):
            side.failed = "policy_violation" if pol.violations else "compile_error"
            side.message = "; ".join(pol.details)
            continue
        w = (pool.take("gpu", gpu, limits) if pool is not None else None) or spawn_worker("gpu", gpu, limits)
        side.worker = w
        shutil.copyfile(side.path, w.root / "work" / "kernel.py")
        jobs[side.label] = make_job(prob, side.dsl, w.root, "gpu", "full", "cuda:0", gpu,
                                    user=w.limits.sandbox.run_as, mode="retime")
        w.start(jobs[side.label])
    return jobs


def _judge_rounds(judge: Any, sides: dict[str, _Side], results: list[RetimeWindow]) -> None:
    """Each ok window's re-checked output against the reference and its commitment; a mismatch makes
    the window ``incorrect`` (its time is dropped)."""
    for win in results:
        side = sides[win.label]
        stamps = next((s for s in side.windows if s.tag == f"r{win.round}"), None)
        if win.status == "ok" and stamps is not None:
            bad = timed.judge_windows(judge, [stamps], side.worker.root / "out")
            if bad:
                win.status, win.kernel_ms, win.message = "incorrect", None, bad


def _sanity(side: _Side, job: Job, judge: Any, lane: Any, limits: Any) -> None:
    """Phase 1 of a re-timing worker (one correctness draw), judged; a failure marks the side."""
    from mkb_eval.harness.lane_hold import Held
    from mkb_eval.harness.phase1 import judge_phase1, run_phase1
    from mkb_eval.harness.redact import redact_paths
    from mkb_eval.harness.spawn import fail_from_worker
    from mkb_eval.records import VerificationRecord

    w = side.worker
    rec = VerificationRecord(status="crashed", problem_id=judge.problem.id, problem=judge.problem.name,
                             problem_hash=judge.problem.hash, dsl=side.dsl, kernel_sha256="", tier="gpu", size="full")
    msg, how = w.wait_for(("ready", "final"), limits.correctness_s)
    if msg and not isinstance(msg, Final):
        held = Held(lane)
        try:
            msg, how = run_phase1(w, held, limits.correctness_s, rec)
            if isinstance(msg, Phase1Report):
                if judge_phase1(rec, judge, job, msg, w.root / "out", between=held.step_aside):
                    return
                side.failed, side.message = rec.status, rec.message
                return
        finally:
            held.release()
    fail_from_worker(rec, w, how, limits.correctness_s)
    side.failed, side.message = rec.status, redact_paths(rec.message, w.root)


def _one_window(side: _Side, r: int, pos: int, warmup: int, draws: int, calls: int, ref: timed.Reference,
                limits: Any, sol_ms: float | None) -> RetimeWindow:
    """Round ``r``'s window of one kernel: event draws, an attested window, its verdict (one re-time at most)."""
    from mkb_eval.harness.redact import redact_paths
    from mkb_eval.harness.spawn import fail_from_worker

    def failed(status: str, message: str, **nums: Any) -> RetimeWindow:
        return RetimeWindow(side.label, r, pos, None, nums.get("att"), nums.get("event"), nums.get("dev"), status,
                            message)

    if side.failed:
        return failed(side.failed, side.message)
    w = side.worker
    try:
        w.gate.send_op(EventsOp(timed.seeds(warmup), timed.seeds(draws), device=True))
    except OSError:
        pass                              # the worker is gone: waiting below says how
    seen = side.events_seen
    ev, how = w.wait_for(("events", "final"), limits.timing_s,
                         unless=lambda m: isinstance(m, EventsReport) and m.n <= seen)
    if not isinstance(ev, EventsReport):                # a final message, or none
        rec = _scratch(side)
        fail_from_worker(rec, w, how, limits.timing_s)
        side.failed, side.message = rec.status, redact_paths(rec.message, w.root)
        return failed(side.failed, side.message)
    side.events_seen = ev.n
    event_ms = _median(ev.times_ms)
    dev = ev.device_ms
    try:
        wins, verdict = timed.attest_kernel(w, ref, calls, (f"r{r}", f"r{r}"), limits.timing_s, event_ms, sol_ms, dev,
                                            rechecks=1)
    except timed.WindowFailed as f:
        rec = _scratch(side)
        if f.status is None:
            fail_from_worker(rec, w, f.how, limits.timing_s)
        else:
            rec.status, rec.message = f.status, f.message
        side.failed, side.message = rec.status, redact_paths(rec.message, w.root)
        return failed(side.failed, side.message, event=event_ms, dev=dev)
    side.windows.append(wins.windows[-1])
    if verdict.status != "ok":
        return failed(verdict.status, verdict.message, att=verdict.attested_ms, event=event_ms, dev=dev)
    last, cal = wins.windows[-1], wins.calibrations[-1]
    return RetimeWindow(side.label, r, pos, verdict.kernel_ms, verdict.attested_ms, event_ms, dev, "ok",
                        span_per_call_ms=round(last.window_ms / max(1, last.calls), 5), commit_ms=round(cal.commit_ms, 5))


def _scratch(side: _Side) -> Any:
    from mkb_eval.records import VerificationRecord

    return VerificationRecord(status="crashed", problem_id=0, problem="", problem_hash="", dsl=side.dsl,
                              kernel_sha256="", tier="gpu", size="full")


def _median(xs: list[float]) -> float:
    import statistics

    return float(statistics.median(float(x) for x in xs))
