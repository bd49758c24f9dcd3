"""The baselines a kernel's time is compared with: the eager reference (timed in the lane, or reused
from the cache) and torch.compile's (timed, or from the cache only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from mkb_eval import problems as P
from mkb_eval.harness import timed
from mkb_eval.records import Timing, VerificationRecord


def eager_baseline(rec: VerificationRecord, prob: P.Problem, size: str, cache_dir: Path, reuse: bool,
                   measure: Callable[[], float]) -> float:
    """The eager reference's time: ``measure`` it, or with ``reuse`` take it from the cache (where
    a cached entry has a time; flag ``eager_baseline_from_cache``)."""
    from mkb_eval.harness.judge import baseline_cached

    if not reuse:
        return measure()
    ms, cached, _ = baseline_cached(prob, size, rec.env.to_dict(), cache_dir, measure, kind="eager")
    if ms is None:                    # a cached entry without a time (eager failures are not cached): time it here
        return measure()
    if cached:
        rec.flags.append("eager_baseline_from_cache")
    return ms


def time_compile_baseline(rec: VerificationRecord, prob: P.Problem, size: str, t: Timing, compile_baseline: bool | str,
                          cache_dir: Path, ref: timed.Reference, warmup: list[int], timing_seeds: list[int]) -> None:
    """The torch.compile baseline (event draws, from the cache when asked), beside the eager one."""
    from mkb_eval.harness.judge import baseline_cached

    if not compile_baseline:
        return
    t0 = time.perf_counter()
    t.compile_ms, t.compile_cached, err = baseline_cached(
        prob, size, rec.env.to_dict(), cache_dir,
        None if compile_baseline == "cached" else lambda: ref.event_ms(warmup, timing_seeds, compiled=True))
    if err:
        rec.flags.append("compile_baseline_failed")
    rec.stages_s["compile_baseline"] = round(time.perf_counter() - t0, 3)
    t.speedup_vs_compile = t.compile_ms / t.kernel_ms if t.compile_ms and t.kernel_ms else None

