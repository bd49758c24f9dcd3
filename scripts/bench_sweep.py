"""Sweep benchmark (issue "Evaluation at scale"): wall time of a full sweep per GPU count,
evaluations per minute, per-stage breakdown, the ratio against cold evaluations one at a time,
and timing stability (the same solutions swept 3 times, then once more under a compile load).

    python scripts/bench_sweep.py --out DIR --stage sweep --gpus 1 [--parallel 8] [--deadline-s 560]
    python scripts/bench_sweep.py --out DIR --stage cold,stable,summary

Stages keep their state in DIR and resume, so a benchmark longer than one device call runs as
several calls: a sweep cut by the deadline continues where it stopped (its wall time is the sum
of its parts, evaluations in flight at the cut are run again), and `summary` writes DIR/README.md
and DIR/report.json from everything measured so far. Every sweep is its own `mkb verify --all`
process, so what is measured is what users run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mkb_eval.harness.verify import default_cache_dir  # noqa: E402
from mkb_eval.records import append_jsonl, read_jsonl  # noqa: E402

STAGES = ("worker_start", "worker_phase1", "judge_correctness", "worker_timing", "eager_baseline",
          "compile_baseline", "judge_rechecks", "total")
STABLE_PROBLEMS = "3,22,33,46,55,70"       # one problem of each family, kernels of 0.1-5 ms


def records(path: Path) -> list[dict]:
    """The verification records in ``path`` (a line torn by a cut is skipped, with a warning)."""
    return [r for r in read_jsonl(path) if r.get("kind") == "verification"] if path.exists() else []


def sweep(out: Path, log: Path, *, stage: str, tier: str, parallel: int, warm: bool, gpus: int | None,
          problems: str, deadline: float, cpus: int | None = None, extra_args: tuple[str, ...] = ()) -> dict:
    """One `mkb verify --all` into ``out`` (resumed if it holds records), cut at ``deadline``, on the
    first ``cpus`` cores when given (a 1-GPU host has fewer cores than a 2-GPU one); the part (wall
    seconds, records added, whether it was cut) is appended to ``log``."""
    cmd = [sys.executable, "-m", "mkb_eval.cli", "verify", "--all", "--tier", tier, "--parallel", str(parallel),
           "--out", str(out), *extra_args] + (["--warm"] if warm else []) + (
        ["--cached-compile-baseline", "--reuse-eager-baseline"] if tier == "gpu" else [])
    if problems:
        cmd += ["--problems", problems]
    # each sweep its own baseline cache, holding only the torch.compile times it was given: every
    # sweep then times the eager reference once per problem, so sweeps compare on the same work
    cache = out.parent / f"cache_{out.stem}"
    if not cache.exists():
        cache.mkdir()
        given = default_cache_dir() / "compile_baselines.jsonl"
        if given.exists():
            shutil.copy(given, cache / given.name)
    env = {**os.environ, "MKB_CACHE_DIR": str(cache)}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    cores = sorted(os.sched_getaffinity(0))[:cpus] if cpus else None
    before = len(records(out))
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False, timeout=max(1.0, deadline - time.time()),
                       preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        cut = False
    except subprocess.TimeoutExpired:
        cut = True
    part = {"stage": stage, "file": out.name, "gpus": gpus, "cpus": len(cores) if cores else os.cpu_count(),
            "parallel": parallel, "warm": warm,
            "wall_s": round(time.perf_counter() - t0, 1), "added": len(records(out)) - before, "cut": cut,
            "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    append_jsonl(log, part)
    print(json.dumps(part), flush=True)
    return part


def stage_means(recs: list[dict]) -> dict[str, float]:
    return {s: round(statistics.mean(r["stages_s"].get(s, 0.0) for r in recs), 3) for s in STAGES} if recs else {}


def key(r: dict) -> str:
    return f"{r['problem_id']:02d}/{r['dsl']}"


def parts(d: Path) -> list[dict]:
    p = d / "parts.jsonl"
    return list(read_jsonl(p)) if p.exists() else []


def summary(d: Path) -> dict:
    """Everything measured in ``d`` so far, as report.json and README.md."""
    ps = parts(d)
    report: dict = {"sweeps": []}
    for f in sorted({p["file"] for p in ps if p["stage"] == "sweep"}):
        mine = [p for p in ps if p["file"] == f]
        recs = records(d / f)
        wall = sum(p["wall_s"] for p in mine)
        report["sweeps"].append({
            "gpus": mine[0]["gpus"], "cpus": mine[0].get("cpus"), "parallel": mine[0]["parallel"], "evaluations": len(recs), "wall_s": round(wall, 1),
            "calls": len(mine), "complete": not mine[-1]["cut"],
            "per_minute": round(60 * len(recs) / wall, 1) if wall else None,
            "passed": sum(r["status"] in ("ok", "unverified") for r in recs), "stage_means_s": stage_means(recs)})
    base = min(report["sweeps"], key=lambda s: s["gpus"] or 0) if report["sweeps"] else None
    for s in report["sweeps"]:
        s["scaling"] = round(s["per_minute"] / base["per_minute"], 2) if base and base["per_minute"] else None
    cold = [p for p in ps if p["stage"] == "cold"]
    if cold and base:
        recs = records(d / "cold.jsonl")
        wall = sum(p["wall_s"] for p in cold)
        per_cold, per_warm = wall / max(1, len(recs)), 60 / base["per_minute"]
        report["cold"] = {"evaluations": len(recs), "wall_s": round(wall, 1), "s_per_evaluation": round(per_cold, 2),
                          "sweep_s_per_evaluation": round(per_warm, 2), "ratio": round(per_cold / per_warm, 2),
                          "stage_means_s": stage_means(recs)}
    runs = [{key(r): r["timing"] for r in records(d / f"stable_{k}.jsonl") if r["status"] == "ok"} for k in range(4)]
    if any(runs[:3]):
        stab = {}
        for kk in sorted(set().union(*runs[:3])):
            xs = [run[kk]["kernel_ms"] for run in runs[:3] if kk in run]
            if len(xs) < 3:
                continue
            m = statistics.mean(xs)
            load = runs[3].get(kk, {}).get("kernel_ms")
            stab[kk] = {"medians_ms": xs, "cv": round(statistics.pstdev(xs) / m, 4),
                        "device_ms": [run[kk].get("kernel_device_ms") for run in runs[:3]],
                        "under_load_ms": load, "load_shift": None if load is None else round(load / m - 1, 4)}
        report["stability"] = stab
    (d / "report.json").write_text(json.dumps(report, indent=1))
    (d / "README.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = ["# Sweep benchmark (GPU tier, warm workers; torch.compile times from the cache, the eager reference "
             "timed once per problem in each sweep)", "",
             "| GPUs | CPU cores | in flight | evaluations | passed | wall s | device calls | per minute | scaling |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["sweeps"]:
        lines.append(f"| {s['gpus']} | {s.get('cpus') or '-'} | {s['parallel']} | {s['evaluations']} | {s['passed']} | {s['wall_s']} | "
                     f"{s['calls']}{'' if s['complete'] else ' (cut)'} | {s['per_minute']} | {s['scaling']}x |")
    if report["sweeps"]:
        lines += ["", "Mean seconds per evaluation by stage (stages overlap across evaluations in flight):", "",
                  "| GPUs | " + " | ".join(STAGES) + " |", "|---:|" + "---:|" * len(STAGES)]
        for s in report["sweeps"]:
            lines.append(f"| {s['gpus']} | " + " | ".join(str(s["stage_means_s"].get(x, "-")) for x in STAGES) + " |")
    if "cold" in report:
        c = report["cold"]
        lines += ["", f"Cold, one at a time (fresh process, no preloaded imports, 1 GPU): {c['evaluations']} evaluations, "
                      f"{c['s_per_evaluation']} s each; the 1-GPU sweep {c['sweep_s_per_evaluation']} s per evaluation "
                      f"→ **{c['ratio']}x**."]
    if report.get("stability"):
        lines += ["", "Timing stability: the same solutions swept 3 times on 1 GPU, then a 4th time beside a "
                      "CPU-tier sweep compiling every shipped solution.", "",
                  "| solution | medians ms (3 sweeps) | CV | device ms | under compile load ms | shift |",
                  "|---|---|---:|---|---:|---:|"]
        for kk, v in report["stability"].items():
            lines.append(f"| {kk} | {', '.join(f'{x:.4f}' for x in v['medians_ms'])} | {v['cv']:.4f} | "
                         f"{', '.join('-' if x is None else f'{x:.4f}' for x in v['device_ms'])} | "
                         f"{'-' if v['under_load_ms'] is None else format(v['under_load_ms'], '.4f')} | "
                         f"{'-' if v['load_shift'] is None else format(v['load_shift'], '+.4f')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/bench_sweep")
    ap.add_argument("--stage", default="sweep,cold,stable,summary", help="comma list of sweep, cold, stable, summary")
    ap.add_argument("--tier", default="gpu", choices=("gpu", "cpu"), help="cpu: try the stages out without a GPU")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs visible to the sweep stage")
    ap.add_argument("--parallel", type=int, default=8, help="evaluations in flight per GPU")
    ap.add_argument("--cpus", type=int, default=0, help="sweep stage on the first N cores only (0: all)")
    ap.add_argument("--problems", default="", help="restrict the sweep stage to these problem ids")
    ap.add_argument("--cold", type=int, default=8, help="evaluations run cold, one at a time, for the ratio")
    ap.add_argument("--stable-problems", default=STABLE_PROBLEMS, help="problems (both DSLs) of the stability runs")
    ap.add_argument("--deadline-s", type=float, default=560, help="seconds this invocation may run")
    args = ap.parse_args()
    d = Path(args.out)
    d.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline_s
    log = d / "parts.jsonl"
    for stage in args.stage.split(","):
        if time.time() >= deadline:
            print(f"deadline reached before stage {stage}", flush=True)
            break
        if stage == "sweep":
            sweep(d / f"sweep_{args.gpus}gpu.jsonl", log, stage="sweep", tier=args.tier, parallel=args.parallel * args.gpus,
                  warm=True, gpus=args.gpus if args.tier == "gpu" else None, problems=args.problems, deadline=deadline,
                  cpus=args.cpus or None)
        elif stage == "cold":
            pick = ",".join(args.stable_problems.split(",")[: max(1, args.cold // 2)])
            sweep(d / "cold.jsonl", log, stage="cold", tier=args.tier, parallel=1, warm=False,
                  gpus=1 if args.tier == "gpu" else None, problems=pick,
                  deadline=deadline)
        elif stage == "stable" and args.tier != "gpu":
            print("stage stable: timing needs the GPU tier; skipped", flush=True)
        elif stage == "stable":
            want = 2 * len(args.stable_problems.split(","))
            for k in range(4):
                out = d / f"stable_{k}.jsonl"
                if len(records(out)) >= want:
                    continue                            # this repeat finished in an earlier call
                out.unlink(missing_ok=True)             # a repeat cut short is taken again whole
                load = None
                if k == 3:   # a concurrent compile load: a CPU-tier sweep compiling every shipped solution
                    (d / "load.jsonl").unlink(missing_ok=True)
                    load = subprocess.Popen([sys.executable, "-m", "mkb_eval.cli", "verify", "--all", "--tier", "cpu",
                                             "--parallel", "8", "--out", str(d / "load.jsonl")],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(20)                      # the load is compiling before the timed sweep starts
                try:
                    sweep(out, log, stage="stable", tier="gpu", parallel=args.parallel, warm=True, gpus=1,
                          problems=args.stable_problems, deadline=deadline)
                finally:
                    if load is not None:
                        load.kill()
                        load.wait()
        elif stage == "summary":
            print(markdown(summary(d)), flush=True)
        else:
            ap.error(f"unknown stage {stage!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
