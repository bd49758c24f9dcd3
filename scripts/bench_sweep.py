"""Sweep benchmark (issue "Evaluation at scale"): wall time of a full sweep per GPU count,
evaluations per minute, per-stage breakdown, the ratio against cold evaluations one at a time,
and timing stability (the same solutions swept 3 times, then once more under a compile load).

    python scripts/bench_sweep.py --out docs/bench_sweep [--gpus 1,2] [--parallel 8]
        [--cold 8] [--stable 10] [--problems 1,28] [--tier gpu|cpu]

Every sweep runs as its own `mkb verify --all` process, so what is measured is what users run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("worker_start", "worker_phase1", "judge_correctness", "worker_timing", "eager_baseline",
          "compile_baseline", "judge_rechecks", "total")


def sweep(out: Path, *, tier: str, parallel: int, warm: bool, gpus: int | None, problems: str = "",
          extra_env: dict | None = None) -> tuple[float, list[dict]]:
    """One `mkb verify --all` into a fresh file; (wall seconds, records)."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mkb_eval.cli", "verify", "--all", "--tier", tier, "--parallel", str(parallel),
           "--out", str(out)] + (["--warm"] if warm else []) + (
        ["--cached-compile-baseline", "--reuse-eager-baseline"] if tier == "gpu" else [])
    if problems:
        cmd += ["--problems", problems]
    env = {**os.environ, **(extra_env or {})}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []
    return wall, recs


def stage_means(recs: list[dict]) -> dict[str, float]:
    return {s: round(statistics.mean(r["stages_s"].get(s, 0.0) for r in recs), 3) for s in STAGES} if recs else {}


def key(r: dict) -> str:
    return f"{r['problem_id']:02d}/{r['dsl']}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/bench_sweep")
    ap.add_argument("--tier", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--gpus", default="1", help="GPU counts to sweep with, e.g. 1,2,4")
    ap.add_argument("--parallel", type=int, default=8, help="evaluations in flight per sweep (per GPU count x)")
    ap.add_argument("--problems", default="", help="restrict the full sweep to these problem ids")
    ap.add_argument("--cold", type=int, default=8, help="evaluations run cold, one at a time, for the ratio")
    ap.add_argument("--stable", type=int, default=10, help="solutions swept 3 times for timing stability (0: skip)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu_counts = [int(x) for x in args.gpus.split(",")] if args.tier == "gpu" else [None]
    rows, report = [], {"tier": args.tier, "parallel": args.parallel, "sweeps": []}

    for n in gpu_counts:
        wall, recs = sweep(out / f"sweep_{n or 0}gpu.jsonl", tier=args.tier, parallel=args.parallel * (n or 1),
                           warm=True, gpus=n, problems=args.problems)
        report["sweeps"].append({"gpus": n, "evaluations": len(recs), "wall_s": round(wall, 1),
                                 "per_minute": round(60 * len(recs) / wall, 1) if wall else None,
                                 "passed": sum(r["status"] in ("ok", "unverified") for r in recs),
                                 "stage_means_s": stage_means(recs)})
        print(json.dumps(report["sweeps"][-1]), flush=True)
        rows = rows or recs
    base = report["sweeps"][0]
    for s in report["sweeps"]:
        s["scaling"] = round(base["wall_s"] / s["wall_s"] * (s["evaluations"] / max(1, base["evaluations"])), 2)

    ids = sorted({r["problem_id"] for r in rows})
    if args.cold and ids:
        pick = ",".join(str(i) for i in ids[: max(1, args.cold // 2)])
        wall, recs = sweep(out / "cold.jsonl", tier=args.tier, parallel=1, warm=False,
                           gpus=1 if args.tier == "gpu" else None, problems=pick)
        per_cold = wall / max(1, len(recs))
        per_warm = base["wall_s"] / max(1, base["evaluations"])
        report["cold"] = {"evaluations": len(recs), "wall_s": round(wall, 1), "s_per_evaluation": round(per_cold, 2),
                          "sweep_s_per_evaluation": round(per_warm, 2), "ratio": round(per_cold / per_warm, 2),
                          "stage_means_s": stage_means(recs)}
        print(json.dumps(report["cold"]), flush=True)

    if args.stable and args.tier == "gpu" and ids:
        pick = ",".join(str(i) for i in ids[: max(1, args.stable // 2)])
        medians: dict[str, list[float]] = {}
        runs = []
        for k in range(4):
            load = None
            if k == 3:       # the 4th repeat under a concurrent compile load (CPU-tier sweep of every solution)
                load = subprocess.Popen([sys.executable, "-m", "mkb_eval.cli", "verify", "--all", "--tier", "cpu",
                                         "--parallel", "8", "--out", str(out / "load.jsonl")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, recs = sweep(out / f"stable_{k}.jsonl", tier="gpu", parallel=args.parallel, warm=True, gpus=1,
                            problems=pick)
            if load is not None:
                load.kill()
            runs.append({key(r): (r["timing"]["kernel_ms"], r["timing"].get("kernel_device_ms"))
                         for r in recs if r["status"] == "ok"})
            for r in recs:
                if r["status"] == "ok" and k < 3:
                    medians.setdefault(key(r), []).append(r["timing"]["kernel_ms"])
        stab = {}
        for kk, xs in medians.items():
            if len(xs) == 3:
                m = statistics.mean(xs)
                stab[kk] = {"medians_ms": xs, "cv": round(statistics.pstdev(xs) / m, 4),
                            "device_ms": [run.get(kk, (None, None))[1] for run in runs[:3]],
                            "under_load_ms": runs[3].get(kk, (None, None))[0]}
        report["stability"] = stab
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Sweep benchmark ({args.tier} tier, {args.parallel} evaluations in flight per GPU, warm workers)", "",
             "| GPUs | evaluations | wall s | per minute | passed | scaling |", "|---:|---:|---:|---:|---:|---:|"]
    for s in report["sweeps"]:
        lines.append(f"| {s['gpus'] or '-'} | {s['evaluations']} | {s['wall_s']} | {s['per_minute']} | {s['passed']} | {s['scaling']}x |")
    lines += ["", "Mean seconds per evaluation by stage (first sweep):", "",
              "| " + " | ".join(STAGES) + " |", "|" + "---:|" * len(STAGES),
              "| " + " | ".join(str(base["stage_means_s"].get(s, "-")) for s in STAGES) + " |"]
    if "cold" in report:
        c = report["cold"]
        lines += ["", f"Cold, one at a time: {c['evaluations']} evaluations, {c['s_per_evaluation']} s each; the sweep "
                      f"{c['sweep_s_per_evaluation']} s per evaluation → **{c['ratio']}x**."]
    if report.get("stability"):
        lines += ["", "| solution | medians ms (3 sweeps) | CV | device ms | median ms under compile load |",
                  "|---|---|---:|---|---:|"]
        for kk, v in sorted(report["stability"].items()):
            lines.append(f"| {kk} | {', '.join(f'{x:.4f}' for x in v['medians_ms'])} | {v['cv']:.4f} | "
                         f"{', '.join('-' if x is None else f'{x:.4f}' for x in v['device_ms'])} | "
                         f"{'-' if v['under_load_ms'] is None else format(v['under_load_ms'], '.4f')} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
