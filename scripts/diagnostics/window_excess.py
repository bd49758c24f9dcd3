"""Why is an attested window's per-call time above the worker's event median? (diagnostic, H200)

One process, no worker: for each solution (``28/cutedsl``, ``28/reference`` for the eager reference)
it times, in rotating order and several rounds, the procedures the timed phase is made of and prints
one JSON line per (solution, procedure, round) with the per-call ms and the CPU probe beside it:

- ``events``: ``timing.time_draws`` (the worker's event-timed draws), median
- ``serial``: the attested window as the worker runs it (K calls, row sums behind each, a sync per call)
- ``serial_bare``: the same without row sums
- ``piped``: K calls back to back with their row sums, one sync at the end
- ``host``: the host call path alone (median time for ``solve`` to return)

    python3 scripts/diagnostics/window_excess.py 28/cutedsl 28/tirx 28/reference --rounds 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from mkb_eval.harness import attest, tensors
from mkb_eval.harness.timing import Clock, collector_paused, cpu_probe_ms, time_draws
from mkb_eval.harness.worker import _import_file
from mkb_eval.problems import find


def window(solve: Any, make: Any, seeds: list[int], sums: bool, sync_each: bool) -> float:
    with collector_paused():
        sets = [make(s) for s in seeds]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = []
        for x in sets:
            out = solve(*x)
            if sums:
                [attest.row_sums(t) for t in tensors.walk(out)]
            if sync_each:
                torch.cuda.synchronize()
            outs.append(out)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del sets, outs
    return 1e3 * dt / len(seeds)


def host_path(solve: Any, make: Any, seeds: list[int]) -> float:
    times = []
    with collector_paused():
        for s in seeds:
            x = make(s)
            torch.cuda.synchronize()
            t = time.perf_counter()
            solve(*x)
            times.append(time.perf_counter() - t)
            torch.cuda.synchronize()
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("solutions", nargs="+", help="problem/dsl or problem/reference")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    device = torch.device("cuda:0")
    clock = Clock()
    l2 = int(torch.cuda.get_device_properties(0).L2_cache_size)
    loaded = []
    for key in a.solutions:
        pid, dsl = key.split("/")
        prob = find(int(pid))
        ref = _import_file(prob.reference_path, f"ref_{pid}")
        if dsl == "reference":
            solve = ref.reference
        else:
            solve = _import_file(prob.path / "solutions" / f"{dsl}.py", f"sol_{pid}_{dsl}").solve

        def make(seed: int, ref: Any = ref) -> list[Any]:
            torch.manual_seed(seed)
            return ref.make_inputs("full", "cuda:0")

        x = make(1)
        y = solve(*x)
        torch.cuda.synchronize()
        nbytes = [sum(t.numel() * t.element_size() for t in tensors.walk(v)) for v in (x, y)]
        calls = attest.window_calls(nbytes[0], nbytes[1], l2)
        loaded.append((key, solve, make, calls))
        del x, y
    procs = ["events", "serial", "serial_bare", "piped", "host"]
    seed = 1000
    for rnd in range(a.rounds):
        for i in range(len(procs)):
            for key, solve, make, calls in loaded:
                p = procs[(i + rnd) % len(procs)]
                seeds = list(range(seed, seed + max(calls, 20)))
                seed += len(seeds)
                probe = cpu_probe_ms()
                if p == "events":
                    ms = time_draws(solve, make, seeds[:5], seeds[5:25], clock, device).median_ms
                elif p == "host":
                    ms = host_path(solve, make, seeds[:20])
                else:
                    ms = window(solve, make, seeds[:calls], p != "serial_bare", p != "piped")
                print(json.dumps({"solution": key, "proc": p, "round": rnd, "calls": calls, "ms": round(ms, 5),
                                  "cpu_probe_ms": [round(probe, 4), round(cpu_probe_ms(), 4)]}), flush=True)


if __name__ == "__main__":
    main()
