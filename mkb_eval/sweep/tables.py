"""Tables over a sweep's records: the newest record per kernel, the results table and its summary,
seconds per stage, and torch.compile times filled from the verifier's cache."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mkb_eval import problems as P


# (stage key in a record's stages_s, what it is); GPU-tier and CPU-tier keys, in the order they happen
STAGES = (("worker_start", "worker start and imports (warm: taking a started worker)"),
          ("w_setup", "worker setup"), ("w_dsl_import", "DSL toolchain import"), ("w_kernel_import", "kernel import"),
          ("reference_smoke", "reference at smoke size"), ("compile_s", "compile only"),
          ("first_call_s", "first call (compile and launch)"), ("correctness_draws_s", "correctness draws"),
          ("compile_lane_wait", "waiting for the GPU after compiling"), ("judge_correctness", "judging correctness"),
          ("lane_step_aside", "stepping aside for other timed phases"), ("timing_lane_wait", "waiting to time"),
          ("worker_timing", "timing"), ("attested_window", "attested window"),
          ("eager_baseline", "eager baseline and its window"), ("retime", "re-timed window"),
          ("compile_baseline", "torch.compile baseline"),
          ("recheck_lane_wait", "waiting to recheck"), ("judge_rechecks", "rechecking timed outputs"), ("total", "total, one evaluation"),
          ("worker_cpu_before_job_s", "worker CPU s before its job (start and imports)"),
          ("worker_cpu_s", "worker CPU s in all (all its threads)"))


def stage_table(records: list[dict], wall_s: float | None = None) -> str:
    """Seconds per stage over these evaluations (mean and sum; evaluations overlap, so sums exceed
    the wall time), and the sweep's throughput when its wall time is given."""
    rows = ["| stage | evaluations | mean s | sum s |", "|---|---:|---:|---:|"]
    for k, label in STAGES:
        xs = [r["stages_s"][k] for r in records if isinstance((r.get("stages_s") or {}).get(k), (int, float))]
        if xs:
            rows.append(f"| {label} | {len(xs)} | {statistics.mean(xs):.2f} | {sum(xs):.1f} |")
    if wall_s and records:
        rows += ["", f"{len(records)} evaluations in {wall_s:.1f} s ({60 * len(records) / wall_s:.1f} per minute)"]
    return "\n".join(rows) + "\n"


def fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def latest(records: Iterable[dict]) -> list[dict]:
    """The newest verification record per (problem, DSL, tier)."""
    last: dict[tuple, dict] = {}
    for r in records:
        if r.get("kind") == "verification":
            last[(r["problem_id"], r["dsl"], r["tier"])] = r
    return [last[k] for k in sorted(last)]


def fill_compile_baselines(records: list[dict], cache: Path) -> int:
    """Fill a missing torch.compile time from the verifier's cache (measured for the same problem hash,
    size, GPU and torch, e.g. by scripts/problem_report.py after the sweep); flags what was filled."""
    from mkb_eval.harness.judge import baseline_key, read_baseline_cache

    known = read_baseline_cache(cache)
    n = 0
    for r in records:
        t, env = r.get("timing") or {}, r.get("env") or {}
        entry = known.get(baseline_key(r["problem_hash"], str(r.get("size")), env))
        ms = entry.ms if entry is not None else None
        if r["status"] == "ok" and t.get("compile_ms") is None and ms and t.get("kernel_ms"):
            t["compile_ms"], t["speedup_vs_compile"] = ms, ms / t["kernel_ms"]
            r["flags"] = [*r.get("flags", []), "compile_baseline_from_cache"]
            n += 1
    return n


def _gm(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary(records: list[dict]) -> dict[str, Any]:
    """Pass counts per DSL; geomean speedup vs eager / torch.compile per DSL and family; median SOL fraction."""
    fam = {p.id: p.family for p in P.load_all()} if records else {}
    out: dict[str, Any] = {"by_dsl": {}, "by_dsl_family": {}}
    for dsl in P.DSLS:
        rs = [r for r in records if r["dsl"] == dsl]
        ok = [r for r in rs if r["status"] == "ok"]
        sol = [r["timing"]["sol_fraction"] for r in ok if r["timing"].get("sol_fraction")]
        out["by_dsl"][dsl] = {
            "evaluated": len(rs), "passed": len(ok),
            "geomean_vs_eager": _gm([r["timing"]["speedup"] for r in ok]),
            "geomean_vs_compile": _gm([r["timing"]["speedup_vs_compile"] for r in ok]),
            "median_sol_fraction": statistics.median(sol) if sol else None,
            "below_compile": [r["problem"] for r in ok if (r["timing"].get("speedup_vs_compile") or 9) < 1.0],
        }
        for f in sorted({fam.get(r["problem_id"], "?") for r in ok}):
            fr = [r for r in ok if fam.get(r["problem_id"]) == f]
            out["by_dsl_family"][f"{dsl}/{f}"] = {
                "passed": len(fr), "geomean_vs_eager": _gm([r["timing"]["speedup"] for r in fr]),
                "geomean_vs_compile": _gm([r["timing"]["speedup_vs_compile"] for r in fr])}
    return out


def markdown_table(records: list[dict]) -> str:
    """The results table committed beside the solutions."""
    rows = ["| problem | DSL | status | kernel ms | device ms | eager ms | compile ms | x eager | x compile | SOL frac | GPU | versions |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in records:
        t, e = r["timing"], r.get("env", {})
        ver = f"torch {e.get('torch')}, cutlass-dsl {e.get('cutlass_dsl')}, tvm {e.get('tvm')}"
        rows.append(f"| {r['problem']} | {r['dsl']} | {r['status']} | {fmt(t.get('kernel_ms'))} | "
                    f"{fmt(t.get('kernel_device_ms'))} | {fmt(t.get('eager_ms'))} | {fmt(t.get('compile_ms'))} | "
                    f"{fmt(t.get('speedup'), '.2f')} | {fmt(t.get('speedup_vs_compile'), '.2f')} | "
                    f"{fmt(t.get('sol_fraction'), '.2f')} | {e.get('gpu', '-')} (driver {e.get('driver', '-')}) | {ver} |")
    s = summary(records)
    rows += ["", "| DSL | passed | geomean x eager | geomean x torch.compile | median SOL fraction |",
             "|---|---:|---:|---:|---:|"]
    for dsl, d in s["by_dsl"].items():
        rows.append(f"| {dsl} | {d['passed']}/{d['evaluated']} | {fmt(d['geomean_vs_eager'], '.2f')} | "
                    f"{fmt(d['geomean_vs_compile'], '.2f')} | {fmt(d['median_sol_fraction'], '.2f')} |")
    rows += ["", "| DSL / family | passed | geomean x eager | geomean x torch.compile |", "|---|---:|---:|---:|"]
    for k, d in s["by_dsl_family"].items():
        rows.append(f"| {k} | {d['passed']} | {fmt(d['geomean_vs_eager'], '.2f')} | {fmt(d['geomean_vs_compile'], '.2f')} |")
    return "\n".join(rows) + "\n"
