"""A/A and A/B tests of the paired measurement on a GPU host, through ``mkb run --model replay:...``.

    python scripts/aa_ab.py --out "$OUT" [--stage build,aa,ab,summary] [--work DIR] [--date YYYY-MM-DD]

- ``aa``: ``mkb run --model replay:solutions --arms all --device cuda`` on 24 problems from all six families
  (the ones with the fastest torch.compile in the 2026-11-30 H200 problem report and kernels under ~4 ms, so the
  whole test fits one GPU budget): every arm of a unit submits the same shipped kernel, so every unit must come
  out neutral.
- ``ab``: one replay folder, two replicates of 12 problems (2 per family): in replicate 1 the skill arms' kernels
  are the shipped ones made about 10% slower (must be harmed), in replicate 2 the solo arms' (the bases: the
  skill must come out helped). Built by ``build``.
- ``sweep`` (opt-in): the A/A problems' 48 shipped kernels as a sweep on the same host, with the same shared
  baselines, for ``sweep_evals_per_min``; without it the summary quotes the last recorded 1-GPU sweep rate.
- ``summary``: ``summary.json`` + ``summary.md`` under ``$OUT/results/h200/<date>_aa/`` (commit them there).

The slowdown: the slowed kernel is the shipped file, unchanged, with ``solve`` wrapped so that after the shipped
kernel it copies (a prefix of) its largest output into a cached scratch buffer with torch, sized to about 10% of
the kernel's H200 end-to-end time as recorded by the 1-GPU sweep (``results/h200/2026-12-01_bench8``) at a copy
rate of 1 TB/s of bytes read (2 TB/s of traffic: a freshly written output partly in L2 copies faster, so the
estimate errs towards more than 10%) and no less than one copy (~4 us) per call. It is still a valid
DSL solution (the DSL kernel computes the output; the copy only costs time). The real slowdown is what the run
measures: the summary reports the measured ratios (``ab_slow_ratio_median``, ``ab_fast_ratio_median``).

Verification cache: within a run a kernel is verified once per (problem, DSL, tier) (``mkb run``'s default):
identical kernels of two arms share one verification; the verdict rests on the paired re-timing, which times
every arm's kernel in its own windows. The A/B run takes the A/A run's shared baselines (same problems, GPU model
and torch: the same cache keys), so no reference is timed twice on the host. To fit the GPU budget the A/A run's
torch.compile baselines start from ``--seed-compile`` (the 2026-11-30 H200 report's, same GPU model and torch);
they decide no verdict (only ``speedup_vs_compile``); the eager baselines are timed in the run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

AA_PROBLEMS = (23, 24, 25, 26, 11, 12, 17, 65, 70, 72, 73, 31, 36, 38, 39, 41, 45, 46, 47, 49, 54, 55, 58, 61)
AB_PROBLEMS = (23, 24, 12, 17, 65, 70, 38, 39, 45, 49, 58, 61)
TARGET = 0.10
SEED_COMPILE = ROOT / "results" / "h200" / "2026-11-30_compile_baselines.jsonl"
SWEEP_RECORDS = ROOT / "results" / "h200" / "verification.jsonl"   # the curated set (bench8's 1-GPU sweep)
RECORDED_SWEEP = {"evals_per_min": 148 / 365.7 * 60,
                  "source": "results/h200/2026-12-01_bench8: 148 shipped kernels in 365.7 s on one H200, 12 in flight"}

WRAPPER = '''

# --- A/A-A/B test (scripts/aa_ab.py): the shipped solve above, then an extra torch copy of (a prefix of) its
# largest output into a cached scratch buffer, sized to about {pct:.0f}% of its H200 time ({kernel_ms:.4f} ms
# end-to-end in {source}). The output is unchanged; the copy only costs time.
import torch as _mkb_torch

_mkb_shipped_solve = solve
_MKB_EXTRA_S = {extra_s!r}
_mkb_plan = {{}}


def _mkb_extra_pass(out):
    ts = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
          if isinstance(t, _mkb_torch.Tensor) and t.is_cuda and t.numel() and t.is_contiguous()]
    if not ts:
        return
    flat = max(ts, key=lambda t: t.numel() * t.element_size()).view(-1)
    key = (flat.numel(), flat.dtype, flat.device)
    if key not in _mkb_plan:
        want = max(1, int(_MKB_EXTRA_S * 1.0e12 / flat.element_size()))      # elements read at 1 TB/s
        n = min(flat.numel(), want)
        reps = 1 if n < flat.numel() else max(1, min(64, round(want / n), round(_MKB_EXTRA_S / 4e-6)))
        _mkb_plan[key] = (n, reps, _mkb_torch.empty(n, dtype=flat.dtype, device=flat.device))
    n, reps, buf = _mkb_plan[key]
    for _ in range(reps):
        buf.copy_(flat[:n])


def solve(*inputs):
    out = _mkb_shipped_solve(*inputs)
    _mkb_extra_pass(out)
    return out
'''


def recorded_kernel_ms() -> dict[tuple[int, str], float]:
    out: dict[tuple[int, str], float] = {}
    if SWEEP_RECORDS.is_file():
        for line in SWEEP_RECORDS.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "verification" and r.get("status") == "ok":
                out[(r["problem_id"], r["dsl"])] = r["timing"]["kernel_ms"]
    return out


def slowed(problem: Any, dsl: str, kernel_ms: float | None) -> str:
    src = problem.solution_path(dsl).read_text()
    ms = kernel_ms if kernel_ms else 3 * problem.sol.sol_ms
    return src.rstrip("\n") + "\n" + WRAPPER.format(pct=100 * TARGET, kernel_ms=ms, extra_s=TARGET * ms * 1e-3,
                                                     source="the curated H200 set" if kernel_ms else "3x SOL")


def build(work: Path, problems: tuple[int, ...] = AB_PROBLEMS) -> Path:
    """The A/B replay folder: shipped kernels, slowed skill arms in replicate 1, slowed solos in replicate 2."""
    from mkb_eval import problems as P
    from mkb_eval.agent.replay import _maintainers_skill

    folder = work / "ab_replay"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    times = recorded_kernel_ms()
    skill_arm = {"tirx": "cutedsl2tirx_skill", "cutedsl": "tirx2cutedsl_skill"}
    for pid in problems:
        p = P.find(pid)
        for dsl in ("cutedsl", "tirx"):
            stem = f"{pid:02d}_{dsl}"
            (folder / f"{stem}.py").write_text(p.solution_path(dsl).read_text())
            (folder / f"{stem}.SKILL.md").write_text((_maintainers_skill(p, dsl, ROOT) or "- replayed") + "\n")
            slow = slowed(p, dsl, times.get((pid, dsl)))
            (folder / f"{stem}.{skill_arm[dsl]}.r1.py").write_text(slow)       # A/B slow: the skill slowed
            (folder / f"{stem}.solo_{dsl}.r2.py").write_text(slow)             # A/B fast: the base slowed
    print(f"built {folder} ({len(list(folder.iterdir()))} files)", flush=True)
    return folder


def verifications(run: Path) -> int:
    n = 0
    for f in run.glob("trials/*/submissions/*_verification.json"):
        if "verification_reused" not in json.loads(f.read_text()).get("flags", []):
            n += 1
    return n


def run_stage(name: str, work: Path, model: str, problems: tuple[int, ...], replicates: int,
              **inject: Any) -> dict[str, Any]:
    """One resumable ``mkb run`` (``inject``: verify_fn / retime_fn / baseline_measure / gpus, for tests)."""
    from mkb_eval.agent.backends import Sampling
    from mkb_eval.agent.launch import RunOptions, run_trials

    run = work / name
    seed = inject.pop("seed_compile", None)
    if name == "ab" and not (run / "baselines").exists() and (work / "aa" / "baselines").is_dir():
        shutil.copytree(work / "aa" / "baselines", run / "baselines")     # same problems, GPU and torch
    elif seed and not (run / "baselines" / "compile_baselines.jsonl").exists():
        (run / "baselines").mkdir(parents=True, exist_ok=True)            # keys: problem hash, size, GPU, torch
        shutil.copy(seed, run / "baselines" / "compile_baselines.jsonl")
    before = verifications(run) if run.exists() else 0
    t0 = time.perf_counter()
    opts = RunOptions(model=model, problems=",".join(map(str, problems)), arms="all", replicates=replicates,
                      device="cuda", run_dir=str(run), sampling=Sampling(seed=0), submissions_given=False,
                      progress=False, gpus=inject.pop("gpus", None))
    summary, _ = run_trials(opts, **inject)
    wall = time.perf_counter() - t0
    n = verifications(run) - before
    stats = {"wall_s": round(wall, 1), "verifications": n, "evals_per_min": round(60 * n / wall, 2) if n else None,
             "finished": 0 if summary is None else len(summary.finished)}
    prev = json.loads((work / f"{name}_stats.json").read_text()) if (work / f"{name}_stats.json").is_file() else []
    (work / f"{name}_stats.json").write_text(json.dumps(prev + [stats], indent=1))
    print(f"{name}: {stats}", flush=True)
    return stats


def sweep_stage(work: Path) -> None:
    from mkb_eval import problems as P
    from mkb_eval import sweep as S

    jobs = S.shipped_jobs([P.find(p) for p in AA_PROBLEMS], ("cutedsl", "tirx"))
    out = work / "sweep.jsonl"
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    S.run_sweep(jobs, out, tier="gpu", parallel=8, warm=True, verify_kwargs={
        "compile_baseline": "cached", "reuse_eager": True, "cache_dir": work / "aa" / "baselines"})
    wall = time.perf_counter() - t0
    n = sum(1 for _ in out.open()) if out.is_file() else 0
    (work / "sweep_stats.json").write_text(json.dumps({"wall_s": round(wall, 1), "verifications": n,
                                                       "evals_per_min": round(60 * n / wall, 2)}))


def _p95(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]


def _ci_miss_rate(units: list[dict[str, Any]]) -> float | None:
    """Share of A/A units whose 95% interval excludes 1 (identical kernels: about 5% if the interval over rounds
    holds all the noise; far more means an offset the rounds do not see, such as one per worker)."""
    ivs = [r["paired_interval"] for r in units if r["resolved"] and r.get("paired_interval")]
    return sum(lo > 1 or hi < 1 for lo, hi in ivs) / len(ivs) if ivs else None


def _retime_s(run: Path) -> float:
    from mkb_eval.run_record import read_retimes

    return sum(r.wall_s for r in read_retimes(run / "retime.jsonl"))


def summarize(work: Path, out: Path, date: str, seeded: str | None = None) -> dict[str, Any]:
    from mkb_eval.env import describe, git_commit
    from mkb_eval.metrics import read_attempts, score
    from mkb_eval.metrics.paired import NEUTRAL_BAND
    from mkb_eval.metrics.retimed import TIMER_SUFFIX, aa_check, run_timings

    def scored(run: Path, timer: str) -> dict[str, Any]:
        return score(read_attempts(run), timings=run_timings(run, timer) or {}, timer=timer)

    s: dict[str, Any] = {"date": date, "gpu": describe().get("gpu"), "band": NEUTRAL_BAND, "timer": "kernel_ms",
                         "rounds": 5, **git_commit(), "compile_baselines_seeded_from": seeded}
    tables = []
    for timer, suffix in TIMER_SUFFIX.items():
        aa = scored(work / "aa", timer)
        o = aa["overall"]
        n = o["n_resolved"]
        ratios = [r["paired_ratio"] for r in aa["units"] if r["resolved"] and r.get("paired_ratio")]
        s.update({f"units{suffix}": n, f"units_total{suffix}": o["n_units"],
                  f"false_help{suffix}": o["paired"]["help_rate"], f"false_harm{suffix}": o["paired"]["harm_rate"],
                  f"gm_ratio_bias{suffix}": None if o["paired"]["delta_gm"] is None else o["paired"]["delta_gm"] / 100,
                  f"ratio_p95_abs_dev{suffix}": _p95([abs(r - 1) for r in ratios]),
                  f"ci_miss_rate{suffix}": _ci_miss_rate(aa["units"])})
        if (work / "ab" / "attempts.jsonl").is_file():
            ab = scored(work / "ab", timer)
            r1 = [r for r in ab["units"] if r["replicate"] == 1 and r["resolved"]]
            r2 = [r for r in ab["units"] if r["replicate"] == 2 and r["resolved"]]
            s.update({f"ab_units{suffix}": [len(r1), len(r2)],
                      f"ab_slow_detected{suffix}": sum(r["outcome"] == "harmed" for r in r1) / len(r1) if r1 else None,
                      f"ab_fast_detected{suffix}": sum(r["outcome"] == "helped" for r in r2) / len(r2) if r2 else None,
                      f"ab_slow_ratio_median{suffix}": statistics.median(r["paired_ratio"] for r in r1) if r1 else None,
                      f"ab_fast_ratio_median{suffix}": statistics.median(r["paired_ratio"] for r in r2) if r2 else None})
        check = aa_check(s, timer)
        s[f"passed{suffix}"], s[f"failures{suffix}"] = check["passed"], check["failures"]
        tables.append((timer, aa))
    aa_stats = json.loads((work / "aa_stats.json").read_text()) if (work / "aa_stats.json").is_file() else []
    if aa_stats:
        wall, n = sum(x["wall_s"] for x in aa_stats), sum(x["verifications"] for x in aa_stats)
        s["evals_per_min"] = round(60 * n / wall, 2) if wall else None
        s["aa_wall_s"], s["aa_verifications"] = round(wall, 1), n
        s["retime_s"] = round(_retime_s(work / "aa"), 1)
        s["retime_share_of_wall"] = round(s["retime_s"] / wall, 3) if wall else None
    if (work / "sweep_stats.json").is_file():
        sw = json.loads((work / "sweep_stats.json").read_text())
        s["sweep_evals_per_min"], s["sweep_source"] = sw["evals_per_min"], "measured on this host (stage sweep)"
    else:
        s["sweep_evals_per_min"] = round(RECORDED_SWEEP["evals_per_min"], 2)
        s["sweep_source"] = RECORDED_SWEEP["source"] + " (not this host: run --stage sweep to measure here)"
    dest = out / "results" / "h200" / f"{date}_aa"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
    (out / "summary.json").write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
    lines = [f"# A/A and A/B of the paired measurement ({s['gpu']}, {date})", "",
             f"Paired verdict: 95% t interval of the re-timed speedup ratio outside ±{100 * NEUTRAL_BAND:g}%, "
             "5 interleaved rounds; A/A = `replay:solutions` on 24 problems (all six families), A/B = shipped kernels "
             "~10% slower on the skill side (replicate 1) or the base side (replicate 2), 12 problems.", "",
             "| key | end-to-end (verdict) | parent-attested | device time |", "|---|---:|---:|---:|"]
    for k in ("units", "false_help", "false_harm", "gm_ratio_bias", "ratio_p95_abs_dev", "ci_miss_rate", "ab_slow_detected",
              "ab_fast_detected", "ab_slow_ratio_median", "ab_fast_ratio_median"):
        lines.append(f"| {k} | {_fmt(s.get(k))} | {_fmt(s.get(k + '_attested'))} | {_fmt(s.get(k + '_device'))} |")
    lines += [""] + [f"Criteria of issue 26 by {name}: " + ("met." if s[f"passed{sfx}"] else
                     "not met: " + "; ".join(s[f"failures{sfx}"]) + ".")
                     for name, sfx in (("end-to-end time", ""), ("parent-attested time", "_attested"),
                                       ("device time", "_device"))]
    lines += ["", f"Throughput: {_fmt(s.get('evals_per_min'))} evaluations per minute in the A/A run "
              f"({s.get('aa_verifications')} in {s.get('aa_wall_s')} s, baselines and re-timing included; re-timing "
              f"{s.get('retime_s')} s of it) against {_fmt(s['sweep_evals_per_min'])} for a sweep ({s['sweep_source']}).",
              "", "| unit | ratio (end-to-end) | interval | rounds | device ratio | outcome |",
              "|---|---:|---|---:|---:|---|"]
    for r in tables[0][1]["units"]:
        iv = r.get("paired_interval")
        lines.append(f"| p{r['problem_id']:02d} {r['direction']} | {_fmt(r.get('paired_ratio'))} | "
                     f"{'-' if not iv else f'{iv[0]:.4f}-{iv[1]:.4f}'} | {r.get('paired_rounds')} | "
                     f"{_fmt(r.get('paired_other_ratio'))} | {r['outcome'] or r['unresolved_reason']} |")
    (dest / "summary.md").write_text("\n".join(lines) + "\n")
    shutil.copy(dest / "summary.md", out / "summary.md")
    for name in ("aa", "ab"):
        for f in ("attempts.jsonl", "retime.jsonl", "invocations.jsonl"):
            if (work / name / f).is_file():
                (out / name).mkdir(exist_ok=True)
                shutil.copy(work / name / f, out / name / f)
    print(json.dumps(s, indent=1, sort_keys=True), flush=True)
    return s


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/aa_ab_out"))
    ap.add_argument("--work", default=str(Path(os.environ.get("MKB_STATE", "runs")) / "aa_ab"),
                    help="run folders (resumable: a stage cut short continues where it stopped)")
    ap.add_argument("--stage", default="build,aa,ab,summary", help="comma-separated: build, aa, ab, sweep, summary")
    ap.add_argument("--date", default=dt.date.today().isoformat())
    ap.add_argument("--seed-compile", default=str(SEED_COMPILE),
                    help="torch.compile baselines to start the A/A run's shared baselines from (same GPU model and "
                         "torch, or their keys do not match and they are timed); '' times them in the run (minutes: "
                         "each reference compiled and traced again). They decide no verdict: only speedup_vs_compile")
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    stages = [s.strip() for s in args.stage.split(",") if s.strip()]
    bad = set(stages) - {"build", "aa", "ab", "sweep", "summary"}
    if bad:
        ap.error(f"unknown stage(s): {', '.join(sorted(bad))}")
    if "build" in stages or ("ab" in stages and not (work / "ab_replay").is_dir()):
        build(work)
    if "aa" in stages:
        run_stage("aa", work, "replay:solutions", AA_PROBLEMS, 1, seed_compile=args.seed_compile or None)
    if "ab" in stages:
        run_stage("ab", work, f"replay:{work / 'ab_replay'}", AB_PROBLEMS, 2)
    if "sweep" in stages:
        sweep_stage(work)
    if "summary" in stages:
        summarize(work, out, args.date, Path(args.seed_compile).name if args.seed_compile else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
