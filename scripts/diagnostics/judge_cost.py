#!/usr/bin/env python3
"""Where a sweep's evaluations spend their time, from the records' ``stages_s`` (issue 27).

    python scripts/diagnostics/judge_cost.py before.jsonl after.jsonl [--top 8]

Prints markdown: per stage the median, mean and total seconds of each sweep; the timing lane's
exclusive seconds (the stages that hold it); the judge's parts where the records carry them
(``judge_correctness_*``, ``judge_rechecks_*``); and the problems with the most judging seconds.
bench8's records are in git history: ``git show 44409e4:results/h200/2026-12-01_bench8/sweep_1gpu.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

STAGES = ("worker_start", "worker_phase1", "compile_lane_wait", "judge_correctness", "lane_step_aside",
          "timing_lane_wait", "worker_timing", "attested_window", "eager_baseline", "retime", "compile_baseline",
          "recheck_lane_wait", "judge_rechecks", "total")
EXCLUSIVE = ("worker_timing", "attested_window", "eager_baseline", "retime", "compile_baseline")


def load(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def column(recs: list[dict], key: str) -> list[float]:
    return [float(r["stages_s"].get(key, 0.0)) for r in recs]


def stage_table(sweeps: dict[str, list[dict]]) -> list[str]:
    names = list(sweeps)
    out = ["| stage | " + " | ".join(f"{n} median | {n} mean | {n} total" for n in names) + " |",
           "|---|" + "---:|" * (3 * len(names))]
    parts = sorted({k for rs in sweeps.values() for r in rs for k in r["stages_s"] if k.startswith("judge_") and
                    k not in STAGES})
    for key in (*STAGES, "exclusive (sum of the lane's stages)", *parts):
        cells = []
        for rs in sweeps.values():
            v = ([sum(column([r], k)[0] for k in EXCLUSIVE) for r in rs] if key.startswith("exclusive") else
                 column(rs, key))
            cells.append(f"{statistics.median(v):.3f} | {statistics.mean(v):.3f} | {sum(v):.1f}")
        out.append(f"| {key} | " + " | ".join(cells) + " |")
    return out


def per_check(sweeps: dict[str, list[dict]]) -> list[str]:
    """Seconds per judged output: correctness over its 6 checks (5 draws, the DSL-dependence draw), re-checks
    over 3 per attested window (bench8: 3 timed draws). A re-check costs what a correctness check does,
    the commitment's row sums aside, so a ratio far above 1 is time that is not judging."""
    out = ["| sweep | correctness s per check (median) | re-check s per check (median) | ratio |", "|---|---:|---:|---:|"]
    for name, rs in sweeps.items():
        c = statistics.median(r["stages_s"]["judge_correctness"] / 6 for r in rs)
        k = statistics.median(r["stages_s"]["judge_rechecks"] / (3 * max(1, len(r["timing"].get("attested_windows_ms")
                                                                                 or [0]))) for r in rs)
        out.append(f"| {name} | {c:.3f} | {k:.3f} | {k / c:.2f} |")
    return out


def top_table(sweeps: dict[str, list[dict]], n: int) -> list[str]:
    """The problems (both DSLs) with the most judging seconds in the last sweep, beside the first's."""
    per: dict[str, dict[int, list[float]]] = {}
    for name, rs in sweeps.items():
        acc = per.setdefault(name, {})
        for r in rs:
            s = r["stages_s"]
            a = acc.setdefault(r["problem_id"], [0.0, 0.0, 0.0])
            a[0] += s.get("judge_correctness", 0.0)
            a[1] += s.get("judge_rechecks", 0.0)
            a[2] += r.get("timing", {}).get("window_calls") or 0
    names = list(sweeps)
    last = per[names[-1]]
    label = {r["problem_id"]: r["problem"] for rs in sweeps.values() for r in rs}
    total = sum(a[0] + a[1] for a in last.values())
    out = ["| problem | K | " + " | ".join(f"{x} correctness s | {x} rechecks s" for x in names) +
           f" | share of {names[-1]}'s judging |", "|---|---:|" + "---:|" * (2 * len(names) + 1)]
    for pid in sorted(last, key=lambda p: -(last[p][0] + last[p][1]))[:n]:
        cells = [f"{per[x].get(pid, [0, 0])[0]:.1f} | {per[x].get(pid, [0, 0])[1]:.1f}" for x in names]
        k = int(last[pid][2] / 2) if last[pid][2] else "-"
        out.append(f"| {label[pid][:44]} | {k} | " + " | ".join(cells) +
                   f" | {100 * (last[pid][0] + last[pid][1]) / total:.0f}% |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--names", nargs="*")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    names = a.names or [Path(p).parent.name for p in a.jsonl]
    sweeps = {n: load(p) for n, p in zip(names, a.jsonl, strict=True)}
    print("\n\n".join("\n".join(t) for t in (stage_table(sweeps), per_check(sweeps), top_table(sweeps, a.top))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
