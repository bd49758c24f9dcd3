"""Where does the run-to-run spread of event-timed medians come from? (diagnostic, H200)

One process times the given shipped solutions under several procedures, in rotating order, and
prints one JSON line per (solution, procedure): the median of 50 event-timed draws and the median
host call time. Run it several times in fresh processes (pinned to different cores) and compare.
``--rounds N --variants base`` times the same solutions N times in one process, ``--pause-s`` apart,
so the spread within a process over time can be set against the spread between processes.

Procedures: ``base`` is the verifier's (timing.time_draws, which since this diagnostic pauses the
collector itself; at commit 2736f6e it did not); ``gc_off`` the same with the garbage
collector off; ``gated`` queues a fixed GPU sleep before the start event, so the host call path
overlaps the sleep instead of being timed; ``after_profiler`` is ``base`` once CUPTI has been
started in the process (the worker used to, for its device time).

    python3 scripts/diagnostics/timing_noise.py 3/cutedsl 22/tirx ... > noise.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from mkb_eval.harness.timing import Clock, cpu_probe_ms, l2_flusher, time_draws
from mkb_eval.harness.worker import _import_file
from mkb_eval.problems import find


def gated_draws(fn: Any, make: Any, seeds: list[int], device: torch.device, gate_cycles: int) -> list[float]:
    flush = l2_flusher(device)
    times = []
    for s in seeds:
        inputs = make(s)
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(gate_cycles)          # the GPU waits here while the host prepares the call
        start.record()
        fn(*inputs)
        torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("solutions", nargs="+", help="problem/dsl, e.g. 3/cutedsl")
    ap.add_argument("--rep", default="0")
    ap.add_argument("--gate-cycles", type=int, default=1_000_000)
    ap.add_argument("--variants", default="base,gc_off,gated,after_profiler", help="procedures, in this order")
    ap.add_argument("--rounds", type=int, default=1, help="times each procedure is taken in this process")
    ap.add_argument("--pause-s", type=float, default=0.0, help="seconds between rounds")
    a = ap.parse_args()
    device = torch.device("cuda:0")
    clock = Clock()
    loaded = []
    for key in a.solutions:
        pid, dsl = key.split("/")
        prob = find(int(pid))
        ref = _import_file(prob.reference_path, f"ref_{pid}")
        sol = _import_file(prob.path / "solutions" / f"{dsl}.py", f"sol_{pid}_{dsl}")

        def make(seed: int, ref: Any = ref) -> list[Any]:
            torch.manual_seed(seed)
            return ref.make_inputs("full", "cuda:0")

        sol.solve(*make(1))                     # compile
        torch.cuda.synchronize()
        loaded.append((key, sol.solve, make))
    seeds = list(range(100, 150))
    warm = list(range(10, 20))
    cpu = sorted(os.sched_getaffinity(0))

    def host_timed(fn: Any, host: list[float]) -> Any:
        def call(*x: Any) -> Any:
            t = time.perf_counter()
            out = fn(*x)
            host.append(time.perf_counter() - t)
            return out
        return call

    def run(variant: str, key: str, solve: Any, make: Any, rnd: int) -> None:
        probe = cpu_probe_ms()
        host: list[float] = []
        fn = host_timed(solve, host)
        if variant == "gated":
            for s in warm:
                fn(*make(s))
            host.clear()
            times = gated_draws(fn, make, seeds, device, a.gate_cycles)
        else:
            if variant == "gc_off":
                gc.collect()
                gc.disable()
            times = time_draws(fn, make, warm, seeds, clock, device).times_ms
            gc.enable()
            host = host[len(warm):]
        print(json.dumps({"rep": a.rep, "round": rnd, "at": time.time(), "cpus": cpu,
                          "hashseed": os.environ.get("PYTHONHASHSEED"), "solution": key, "variant": variant,
                          "median_ms": statistics.median(times), "min_ms": min(times),
                          "host_ms": 1e3 * statistics.median(host),
                          "cpu_probe_ms": [probe, cpu_probe_ms()], "times_ms": [round(t, 5) for t in times]}),
              flush=True)

    variants = [v for v in a.variants.split(",") if v != "after_profiler"]
    for rnd in range(a.rounds):
        if rnd:
            time.sleep(a.pause_s)
        for r in range(len(variants)):              # each procedure once per round, rotating
            for key, solve, make in loaded:
                run(variants[(r + int(a.rep)) % len(variants)], key, solve, make, rnd)
    if "after_profiler" in a.variants.split(","):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):   # CUPTI starts
            torch.ones(1, device=device).add_(1)
            torch.cuda.synchronize()
        for key, solve, make in loaded:
            run("after_profiler", key, solve, make, 0)

if __name__ == "__main__":
    main()
