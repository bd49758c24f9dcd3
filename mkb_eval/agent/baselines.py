"""Shared baselines of a run: each problem's eager and torch.compile times, timed once per run and GPU model.

Before any evaluation of ``mkb run`` on the GPU tier, every selected problem's reference is timed
with its GPU to itself (the sweep's report-stage protocol, ``scripts/problem_report.py``): first
torch.compile of every reference is warmed in parallel processes (CPU-bound; the graphs land in
inductor's cache on disk), then, one problem at a time per GPU, under that GPU's exclusive lane,
a reference-timer process (``harness/reference_timer.py``: one thread, the GPU's timing core)
times eager and the cached compiled graph with the verifier's draw counts. The times go to
``<run>/baselines/{eager,compile}_baselines.jsonl`` in the verifier's cache format
(:class:`mkb_eval.baseline_record.BaselineEntry`, validated when read), and every
evaluation of the run is verified with ``compile_baseline="cached", reuse_eager=True,
cache_dir=<run>/baselines``: both arms of a unit share one denominator and no evaluation compiles
a reference inside its timing lane. A rerun finds the times there (keys: problem hash, size, GPU
model, torch) and times only what is missing. The CPU tier times nothing (records say unverified).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval import problems as P

KINDS = ("eager", "compile")
FOLDER = "baselines"


@dataclass(frozen=True)
class Baseline:
    """One problem's shared baseline time in a run (ms None with ``error`` when it could not be timed)."""

    problem_id: int
    kind: str
    ms: float | None
    error: str | None
    reused: bool            # found in the run folder (an earlier invocation timed it)


def baseline_dir(run_dir: Path) -> Path:
    return Path(run_dir) / FOLDER


def verify_kwargs(run_dir: Path) -> dict[str, Any]:
    """What every GPU evaluation of the run passes to ``verify``: the shared baselines, never a compile."""
    return {"compile_baseline": "cached", "reuse_eager": True, "cache_dir": baseline_dir(run_dir)}


def _warm_compile(folder: str) -> tuple[str, str | None]:
    """In a process of its own: torch.compile of the reference, run once (fills inductor's disk cache)."""
    try:
        import torch
        import torch._dynamo as dynamo

        from mkb_eval.harness.judge import Judge
        from mkb_eval.harness.tolerance import reference_numerics

        judge = Judge(P.load_problem(folder), "full", "cuda:0")
        dynamo.reset()
        with reference_numerics(), torch.no_grad():
            torch.compile(judge.module.reference)(*judge.inputs(100))
        torch.cuda.synchronize()
        return folder, None
    except Exception as e:  # noqa: BLE001 - timing it again reports (and records) the failure
        return folder, f"{type(e).__name__}: {str(e)[:200]}"


def _compile_threads(n: int) -> None:
    """In each compiling child (24 children each with inductor workers for every core compiled 10-30x slower)."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(n))


def warm_compiles(folders: Sequence[str], jobs: int, deadline_s: float, log: Callable[[str], None]) -> set[str]:
    """Compile the references in ``jobs`` parallel processes; those done before the deadline."""
    if not folders:
        return set()
    done: set[str] = set()
    ctx = mp.get_context("spawn")
    n = max(1, min(jobs, len(folders)))
    threads = max(1, (os.cpu_count() or 1) // n)     # inductor's compile workers: a share of the cores each
    with ctx.Pool(n, initializer=_compile_threads, initargs=(threads,), maxtasksperchild=1) as pool:
        it, end = pool.imap_unordered(_warm_compile, folders), time.monotonic() + deadline_s
        for _ in folders:
            try:
                folder, err = it.next(timeout=max(0.0, end - time.monotonic()))
            except mp.TimeoutError:
                break
            done.add(folder)
            if err:
                log(f"baselines: warming torch.compile of {Path(folder).name} failed ({err}); it is timed again")
    return done


Measure = Callable[[P.Problem, bool, Any], float]
"""(problem, compiled, lane) -> median ms of the reference, timed with the lane held exclusively."""


def timer_measure(size: str, warmup: int, timed: int) -> Measure:
    """The real measure: the lane's reference timer (one thread, the GPU's timing core), fixed seeds."""
    from mkb_eval.harness.jobs import gpu_cores

    seeds = list(range(100, 100 + warmup + timed))
    own: dict[int, Any] = {}

    def measure(problem: P.Problem, compiled: bool, lane: Any) -> float:
        timer = lane.timer
        if timer is None:                    # a run with one worker has no timer process: one for this stage
            from mkb_eval.harness.reference_timer import ReferenceTimer

            timer = own.get(lane.index) or own.setdefault(lane.index, ReferenceTimer(lane.index))
        cpu = gpu_cores(lane.index)[0]
        with lane.exclusive():
            return timer.time(problem.path, size, seeds[:warmup], seeds[warmup:], compiled, cpu)[0]

    measure.close = lambda: [t.close() for t in own.values()]  # type: ignore[attr-defined]
    return measure


def prepare(problems: Sequence[P.Problem], run_dir: Path, lanes: Any, env: dict[str, Any], *,
            measure: Measure | None = None, size: str = "full", warm_jobs: int = 8, warm_s: float = 240.0,
            log: Callable[[str], None] = print) -> list[Baseline]:
    """Time every problem's missing baselines into ``<run>/baselines`` (see the module docstring).

    ``lanes`` are the run's GPU lanes (each needs a ``timer`` unless ``measure`` is given); ``env`` is
    the verifier's environment description (its GPU model and torch make the cache key). A problem
    whose torch.compile was not warmed within ``warm_s`` gets no compile time (an error entry), as in
    the report stage. ``measure`` may be injected (tests).
    """
    from mkb_eval.harness.jobs import TIMING_DRAWS, WARMUP_DRAWS
    from mkb_eval.harness.judge import baseline_cached, baseline_key, read_baseline_cache, store_baseline

    cache = baseline_dir(run_dir)
    have = {k: read_baseline_cache(cache / f"{k}_baselines.jsonl") for k in KINDS}
    missing = {k: [p for p in problems if baseline_key(p.hash, size, env) not in have[k]] for k in KINDS}
    out = [Baseline(p.id, k, have[k][baseline_key(p.hash, size, env)].ms,
                    have[k][baseline_key(p.hash, size, env)].error, True)
           for k in KINDS for p in problems if p not in missing[k]]
    if not missing["eager"] and not missing["compile"]:
        return out
    real = measure is None
    measure = measure or timer_measure(size, WARMUP_DRAWS, TIMING_DRAWS)
    warmed = {str(p.path) for p in missing["compile"]}
    if real and missing["compile"]:
        t0 = time.perf_counter()
        warmed = warm_compiles([str(p.path) for p in missing["compile"]], warm_jobs, warm_s, log)
        log(f"baselines: torch.compile warmed for {len(warmed)} of {len(missing['compile'])} problems in "
            f"{time.perf_counter() - t0:.0f} s (parallel, nothing timed meanwhile)")
    todo = sorted({p.id: p for k in KINDS for p in missing[k]}.values(), key=lambda p: p.id)
    t0 = time.perf_counter()
    ms: float | None
    err: str | None
    for i, p in enumerate(todo):
        lane = lanes[i % len(lanes)]
        for kind in KINDS:
            if p not in missing[kind]:
                continue
            compiled = kind == "compile"
            if compiled and str(p.path) not in warmed:
                ms, err = None, f"torch.compile not warmed within {warm_s:.0f} s: not timed"
                store_baseline(cache, kind, baseline_key(p.hash, size, env), None, err)
            else:
                try:
                    ms, _, err = baseline_cached(p, size, env, cache, functools.partial(measure, p, compiled, lane),
                                                 kind=kind)
                except Exception as e:  # noqa: BLE001 - an eager failure: its evaluations time eager themselves
                    ms, err = None, f"{type(e).__name__}: {str(e)[:300]}"
                    log(f"baselines: {p.name} {kind}: {err}; its evaluations time it in their lane instead")
                    if kind == "eager":
                        continue          # nothing stored: verify(reuse_eager=True) measures and stores it
                    store_baseline(cache, kind, baseline_key(p.hash, size, env), None, err)
            out.append(Baseline(p.id, kind, ms, err, False))
    if hasattr(measure, "close"):
        measure.close()
    log(f"baselines: {len(todo)} problem(s) timed in {time.perf_counter() - t0:.1f} s with each GPU to itself")
    return out
