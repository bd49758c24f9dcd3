#!/usr/bin/env python3
"""Seconds of the parent's judging per check, by part, on this machine (issue 27).

An honest worker is stood in for: the reference's own output for a seed is written through the
output transport, as the worker would write it, then ``Judge.check`` judges it like a correctness
draw (with the input digests) and like a re-checked window output (with the commitment), and
``Judge.spent`` says where the seconds went. Run it against two checkouts in turn (``PYTHONPATH``)
for a before/after ratio on the same machine:

    PYTHONPATH=. python scripts/diagnostics/judge_parts.py --problems 1 28 44 --size smoke --reps 5

Prints one JSON line per problem: median seconds of a correctness check and a re-check, and the
parts summed over all checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def bench(pid: int, size: str, device: str, reps: int) -> dict:
    import torch

    from mkb_eval import problems as P
    from mkb_eval.harness import attest, tensors, transport
    from mkb_eval.harness.judge import Judge
    from mkb_eval.harness.tolerance import run_reference

    prob = P.find(pid)
    judge = Judge(prob, size, device)
    corr, rech = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(-1, reps):                    # -1: a warm-up pair, not counted (first calls load code)
            if i == 0:
                corr.clear(), rech.clear(), judge.spent.clear()
            seed, key = 1000 + i, 77 + i
            inputs = judge.inputs(seed)
            dig = [list(x) if x is not None else None for x in tensors.digests(inputs)]
            out = run_reference(judge.module.reference, inputs)
            path = Path(d) / f"o{i}.pt"
            transport.write(transport.capture(out), path)
            commit = attest.digest(out, key)
            del inputs, out
            for kind, times in (("corr", corr), ("rech", rech)):
                t = time.perf_counter()
                bad = (judge.check(seed, path, dig) if kind == "corr" else
                       judge.check(seed, path, commitment=commit, key=key))
                times.append(time.perf_counter() - t)
                if bad is not None:
                    raise SystemExit(f"problem {pid}: the honest output was judged wrong ({kind}): {bad}")
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return {"problem": pid, "size": size, "correctness_s": round(statistics.median(corr), 4),
            "recheck_s": round(statistics.median(rech), 4), "parts_s": judge.spent, "checks": 2 * reps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, nargs="+", required=True)
    ap.add_argument("--size", default="smoke")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    for pid in a.problems:
        print(json.dumps(bench(pid, a.size, a.device, a.reps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
