"""Sweep benchmark (issue "Evaluation at scale"): wall time of a full sweep per GPU count,
evaluations per minute, per-stage breakdown, the ratio against cold evaluations one at a time,
and timing stability (the same solutions swept 3 times, then once more under a compile load).

    python scripts/bench_sweep.py --out DIR --stage sweep --gpus 1 [--parallel 8] [--deadline-s 560]
    python scripts/bench_sweep.py --out DIR --stage cold,stable,summary
    python scripts/bench_sweep.py --out DIR --stage spread --records a.jsonl,b.jsonl,c.jsonl

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
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mkb_eval.harness.procs import proc_stat  # noqa: E402
from mkb_eval.harness.verify import default_cache_dir  # noqa: E402
from mkb_eval.records import append_jsonl, read_jsonl  # noqa: E402

STAGES = ("worker_start", "worker_phase1", "compile_lane_wait", "judge_correctness", "lane_step_aside",
          "timing_lane_wait", "worker_timing", "eager_baseline", "compile_baseline", "recheck_lane_wait",
          "judge_rechecks", "total", "worker_cpu_before_job_s", "worker_cpu_s")
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
    said = out.parent / f"{out.stem}.out"                # what the sweep printed: its table, per-GPU process notes
    said_from = len(said.read_text(errors="replace")) if said.exists() else 0
    host0, mine0 = cpu_times(), cpu_times(cores)
    samples = out.parent / f"gpu_busy_{out.stem}.csv"
    sampler = gpu_sampler(samples) if gpus else None
    t0 = time.perf_counter()
    with open(said, "a") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)  # noqa: PLW1509 - no threads here
    stop = time.time() + max(1.0, deadline - time.time())
    while (ended := os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)) is None and time.time() < stop:
        time.sleep(0.2)
    parent_s = own_cpu_s(proc.pid)          # an ended child stays in /proc, with its totals, until it is reaped
    cut = ended is None
    if cut:
        proc.kill()
    proc.wait()
    if sampler is not None:
        sampler.terminate()
        sampler.wait()
    host = [b - a for a, b in zip(host0, cpu_times(), strict=False)]
    mine = [b - a for a, b in zip(mine0, cpu_times(cores), strict=False)][:8]       # guest time is inside user time
    part = {"stage": stage, "file": out.name, "gpus": gpus, "cpus": len(cores) if cores else os.cpu_count(),
            "parallel": parallel, "warm": warm, "workers": workers_mode() if warm else "cold",
            "steal": round(host[7] / sum(host), 4) if len(host) > 7 and sum(host) > 0 else None,
            "cpu_busy": round(1 - (mine[3] + mine[4]) / sum(mine), 3) if len(mine) > 4 and sum(mine) > 0 else None,
            "gpu_busy": gpu_busy(samples, gpus) if gpus else None,
            "parent_cores": round(parent_s / (time.perf_counter() - t0), 3) if parent_s is not None else None,
            "gpu_process_cores": gpu_process_cores(said.read_text(errors="replace")[said_from:]) or None,
            "wall_s": round(time.perf_counter() - t0, 1), "added": len(records(out)) - before, "cut": cut,
            "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    append_jsonl(log, part)
    print(json.dumps(part), flush=True)
    return part


def gpu_process_cores(text: str) -> list[float]:
    """Cores each GPU's sweep process used (a sweep over several GPUs runs one per GPU and says so
    when it ends), in GPU order; [] for a one-process sweep."""
    found = {int(g): float(c) for g, c in re.findall(r"GPU (\d+) sweep process: ([\d.]+) cores", text)}
    return [found[g] for g in sorted(found)]


def cpu_times(cores: list[int] | None = None) -> list[int]:
    """CPU time counters from /proc/stat, summed over ``cores`` (the whole host when None), or []
    where there are none. The 4th and 5th are idle and iowait (what is left is how busy a sweep kept
    the cores it was given), the 8th steal: time a virtual machine's CPUs waited for the hypervisor."""
    out: list[int] = []
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *xs = line.split()
                if not name.startswith("cpu") or name == "cpu" or (cores and int(name[3:]) not in cores):
                    continue
                v = [int(x) for x in xs]
                out = [a + b for a, b in zip(out, v, strict=False)] if out else v
    except (OSError, ValueError):
        return []
    return out


def own_cpu_s(pid: int) -> float | None:
    """CPU seconds of process ``pid``'s own threads, its children's left out (from /proc). For a sweep:
    the parent's judging, lanes and polling, whose Python shares one GIL; near one core, that is the
    bottleneck, however many GPUs and cores the sweep has."""
    try:
        fields = proc_stat(pid)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def gpu_sampler(path: Path) -> subprocess.Popen | None:
    """nvidia-smi sampling every GPU's utilization twice a second into ``path`` (None without it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    with open(path, "w") as f:
        return subprocess.Popen([exe, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                                 "-lms", "500"], stdout=f, stderr=subprocess.DEVNULL)


def gpu_busy(path: Path, gpus: int) -> list[float] | None:
    """Mean utilization (0-1: the share of time a kernel ran) of GPUs 0..gpus-1 over the samples."""
    by: dict[int, list[float]] = {}
    try:
        text = path.read_text()
        path.unlink()
    except OSError:
        return None
    for line in text.split("\n")[:-1]:                  # after the last newline: a line cut by the stop
        try:
            i, u = line.split(",")
            by.setdefault(int(i), []).append(float(u) / 100)
        except ValueError:
            continue                                    # "[N/A]"
    return [round(statistics.mean(by[i]), 3) for i in range(gpus) if by.get(i)] or None


def stage_means(recs: list[dict]) -> dict[str, float]:
    """Mean seconds per stage over the records that have it (older records lack the newer stages)."""
    out = {}
    for s in STAGES:
        xs = [r["stages_s"][s] for r in recs if s in r.get("stages_s", {})]
        if xs:
            out[s] = round(statistics.mean(xs), 3)
    return out


def key(r: dict) -> str:
    return f"{r['problem_id']:02d}/{r['dsl']}"


def workers_mode() -> str:
    """How a warm sweep's workers start: forked by a fork server (the default) or exec'd (MKB_FORK_SERVER=0)."""
    return "exec" if os.environ.get("MKB_FORK_SERVER") == "0" else "forked"


def parts(d: Path) -> list[dict]:
    p = d / "parts.jsonl"
    return list(read_jsonl(p)) if p.exists() else []


def summary(d: Path) -> dict:
    """Everything measured in ``d`` so far, as report.json and README.md."""
    ps = parts(d)
    report: dict = {"sweeps": []}
    swept = {f: records(d / f) for f in sorted({p["file"] for p in ps if p["stage"] == "sweep"})}
    for f, recs in swept.items():
        mine = [p for p in ps if p["file"] == f]
        wall = sum(p["wall_s"] for p in mine)
        report["sweeps"].append({
            "file": f, "gpus": mine[0]["gpus"], "workers": mine[0].get("workers", "exec"), "cpus": mine[0].get("cpus"),
            "parallel": mine[0]["parallel"], "evaluations": len(recs), "wall_s": round(wall, 1),
            "calls": len(mine), "complete": not mine[-1]["cut"],
            "per_minute": round(60 * len(recs) / wall, 1) if wall else None,
            "passed": sum(r["status"] in ("ok", "unverified") for r in recs), "stage_means_s": stage_means(recs),
            "worker_kinds": dict(Counter(r.get("sandbox", {}).get("worker", "?") for r in recs)),
            **_busy(mine)})

    def base_of(s: dict) -> dict:        # scaling: against the fewest GPUs whose workers started the same way
        return min((b for b in report["sweeps"] if b["workers"] == s["workers"]), key=lambda b: b["gpus"] or 0)

    def rate(s: dict) -> float:          # unrounded: 27.3 / 15.2 per minute reads 1.8x, 1.79x measured
        return s["evaluations"] / s["wall_s"] if s["wall_s"] else 0.0

    for s in report["sweeps"]:
        s["scaling"] = round(rate(s) / rate(base_of(s)), 2) if rate(base_of(s)) else None
    base = min(report["sweeps"], key=lambda s: (s["workers"] != "forked", s["gpus"] or 0)) if report["sweeps"] else None
    timeline(d, report["sweeps"], {s["file"]: swept[s["file"]] for s in report["sweeps"] if s["calls"] == 1})
    cold = [p for p in ps if p["stage"] == "cold"]
    if cold and base:
        recs = records(d / "cold.jsonl")
        wall = sum(p["wall_s"] for p in cold)
        per_cold, per_warm = wall / max(1, len(recs)), base["wall_s"] / max(1, base["evaluations"])
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
            stab[kk] = {"medians_ms": xs, **_spread(xs, runs[3].get(kk, {}).get("kernel_ms"))}
            for f in ("host_call_ms", "cpu_probe_ms"):   # the host path, and the timing core's speed beside it:
                hs = [run[kk].get(f) for run in runs[:3]]   # do they move with the median?
                if all(hs):
                    stab[kk][f] = [round(h, 4) for h in hs]
            es = [run[kk].get("eager_ms") for run in runs[:3]]
            if all(es):     # the speedup's denominator, timed in each sweep
                stab[kk].update(eager_ms=[round(e, 4) for e in es], eager_cv=_spread(es, None)["cv"])
            ds = [run[kk].get("kernel_device_ms") for run in runs[:3]]
            if all(ds):     # the GPU time alone, which leaves the host call path out
                dev = _spread(ds, runs[3].get(kk, {}).get("kernel_device_ms"))
                stab[kk].update(device_ms=ds, device_cv=dev["cv"], device_under_load_ms=dev["under_load_ms"],
                                device_load_shift=dev["load_shift"])
        report["stability"] = stab
        report["stability_steal"] = [p.get("steal") for p in ps if p["stage"] == "stable"]
    (d / "report.json").write_text(json.dumps(report, indent=1))
    (d / "README.md").write_text(markdown(report))
    return report


def _ends(recs: list[dict]) -> list[float]:
    """Seconds from the sweep's first evaluation start to each evaluation's end, sorted (a record's
    ``created_at`` is when its evaluation started)."""
    starts = [(datetime.fromisoformat(r["created_at"]).timestamp(), r["stages_s"]["total"])
              for r in recs if r.get("created_at") and "total" in r.get("stages_s", {})]
    t0 = min((t for t, _ in starts), default=0.0)
    return sorted(t - t0 + total for t, total in starts)


def label(s: dict) -> str:
    where = "CPU tier" if s["gpus"] is None else f"{s['gpus']} GPU{'s' if s['gpus'] > 1 else ''}"
    return f"{where}, " + ("forked" if s.get("workers") == "forked" else "exec'd") + " workers"


def timeline(d: Path, sweeps: list[dict], recs_by_file: dict[str, list[dict]]) -> None:
    """When each quarter of a one-call sweep's evaluations had ended (``quarters_s``), and
    timeline.png: evaluations ended against time, one line per sweep (GPU count, how workers started).
    Where the lines part shows where scaling is lost (start-up, the tail, or throughout)."""
    lines = {}
    for s in sweeps:
        ends = _ends(recs_by_file.get(s["file"], []))
        if len(ends) >= 4:
            s["quarters_s"] = [round(ends[-(-k * len(ends) // 4) - 1], 1) for k in (1, 2, 3, 4)]
            lines[label(s)] = ends
    if not lines:
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for name, ends in sorted(lines.items()):
        ax.step(ends, range(1, len(ends) + 1), where="post", label=name)
    ax.set(xlabel="seconds since the first evaluation started", ylabel="evaluations ended",
           title="Sweep progress (one device call each)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(d / "timeline.png", dpi=110)


def _busy(mine: list[dict]) -> dict:
    """The sweep's parts' CPU and GPU busy shares and its processes' cores, weighted by their wall time
    (parts without them left out)."""
    def weighted(pairs: list[tuple[float, float]]) -> float:
        return round(sum(x * w for x, w in pairs) / sum(w for _, w in pairs), 3)

    out: dict = {}
    for k in ("cpu_busy", "parent_cores"):
        have = [p for p in mine if p.get(k) is not None and p["wall_s"]]
        if have:
            out[k] = weighted([(p[k], p["wall_s"]) for p in have])
    for k in ("gpu_busy", "gpu_process_cores"):             # one value per GPU
        have = [p for p in mine if p.get(k) and p["wall_s"]]
        if have:
            out[k] = [weighted([(p[k][i], p["wall_s"]) for p in have if i < len(p[k])]) for i in range(len(have[0][k]))]
    return out


def _spread(xs: list[float], load: float | None) -> dict:
    """Coefficient of variation of three medians, and how far the one under load moved from their mean."""
    m = statistics.mean(xs)
    return {"cv": round(statistics.pstdev(xs) / m, 4), "under_load_ms": load,
            "load_shift": None if load is None else round(load / m - 1, 4)}


def markdown(report: dict) -> str:
    cpu_tier = bool(report["sweeps"]) and all(s["gpus"] is None for s in report["sweeps"])
    lines = ["# Sweep benchmark (" + ("CPU tier, compile-only, warm workers)" if cpu_tier else
             "GPU tier, warm workers; torch.compile times from the cache, the eager reference timed once per problem "
             "in each sweep)"), "",
             "| sweep | CPU cores | in flight | evaluations | passed | wall s | device calls | per minute | scaling "
             "| cores busy | GPU busy | parent cores |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["sweeps"]:
        gpu = ", ".join(f"{x:.0%}" for x in s.get("gpu_busy") or []) or "-"
        lines.append(f"| {label(s)} | {s.get('cpus') or '-'} | {s['parallel']} | {s['evaluations']} | {s['passed']} | {s['wall_s']} | "
                     f"{s['calls']}{'' if s['complete'] else ' (cut)'} | {s['per_minute']} | {s['scaling']}x | "
                     f"{_f(s.get('cpu_busy'), '.0%')} | {gpu} | {_f(s.get('parent_cores'), '.2f')}"
                     + (f" (per GPU {', '.join(f'{x:.2f}' for x in s['gpu_process_cores'])})" if s.get("gpu_process_cores") else "")
                     + " |")
    for s in report["sweeps"]:          # a fork server that could not serve leaves exec'd workers behind it
        other = sum(n for kind, n in s.get("worker_kinds", {}).items() if ("forked" in kind) != (s["workers"] == "forked"))
        if other:
            lines += ["", f"**{label(s)}: {other} of {s['evaluations']} evaluations had workers that started "
                          f"otherwise** ({s['worker_kinds']})."]
    if any(s.get("parent_cores") is not None for s in report["sweeps"]):
        lines += ["", "Parent cores: CPU used by the sweep's own process (judging, lanes, polling, whose Python "
                      "shares one GIL; not the workers), in cores; over several GPUs the parent only hands out jobs "
                      "and each GPU's sweep process does that work (its cores in brackets)."]
    if report["sweeps"]:
        lines += ["", "Mean seconds per evaluation by stage (stages overlap across evaluations in flight; the last two "
                  "are the worker's CPU seconds, all its threads: before its job, and in all):", "",
                  "| sweep | " + " | ".join(STAGES) + " |", "|---:|" + "---:|" * len(STAGES)]
        for s in report["sweeps"]:
            lines.append(f"| {label(s)} | " + " | ".join(str(s["stage_means_s"].get(x, "-")) for x in STAGES) + " |")
    quarters = [s for s in report["sweeps"] if s.get("quarters_s")]
    if quarters:
        lines += ["", "A quarter, half, three quarters and all of the evaluations had ended after (s since the first "
                      "started; `timeline.png`): " + "; ".join(
                          f"{label(s)} {', '.join(str(x) for x in s['quarters_s'])}"
                          for s in quarters) + "."]
    if "cold" in report:
        c = report["cold"]
        lines += ["", f"Cold, one at a time (fresh process, no preloaded imports, 1 GPU): {c['evaluations']} evaluations, "
                      f"{c['s_per_evaluation']} s each; the 1-GPU sweep {c['sweep_s_per_evaluation']} s per evaluation "
                      f"→ **{c['ratio']}x**."]
    if report.get("stability"):
        lines += ["", "Timing stability: the same solutions swept 3 times on 1 GPU, then a 4th time beside a "
                      "CPU-tier sweep compiling every shipped solution. The median is event-timed around each call "
                      "(host call path included, as the verifier reports it); the device time is the GPU time alone "
                      "(records' `kernel_device_ms`: since commit 01b0f6e the median of 10 calls queued behind a GPU "
                      "sleep, before it CUPTI's mean of 3); the host call is the median time until `solve` returned; "
                      "the core probe is a fixed piece of Python work timed on the timing core beside the timed draws "
                      "(the slower of before and after; '-' where the records predate it); the eager baseline is the "
                      "speedup's denominator, timed in each sweep.", "",
                  "| solution | medians ms (3 sweeps) | CV | under load ms | shift | device ms (3 sweeps) | device CV | "
                  "device shift under load | host call ms (3 sweeps) | core probe ms (3 sweeps) | eager ms (3 sweeps) | eager CV |",
                  "|---|---|---:|---:|---:|---|---:|---:|---|---|---|---:|"]
        for kk, v in report["stability"].items():
            lines.append(f"| {kk} | {', '.join(f'{x:.4f}' for x in v['medians_ms'])} | {v['cv']:.4f} | "
                         f"{_f(v['under_load_ms'], '.4f')} | {_f(v['load_shift'], '+.4f')} | "
                         f"{', '.join(_f(x, '.4f') for x in v.get('device_ms') or [])} | {_f(v.get('device_cv'), '.4f')} | "
                         f"{_f(v.get('device_load_shift'), '+.4f')} | "
                         f"{', '.join(_f(x, '.4f') for x in v.get('host_call_ms') or []) or '-'} | "
                         f"{', '.join(_f(x, '.3f') for x in v.get('cpu_probe_ms') or []) or '-'} | "
                         f"{', '.join(_f(x, '.3f') for x in v.get('eager_ms') or []) or '-'} | {_f(v.get('eager_cv'), '.4f')} |")
        big = [v for v in report["stability"].values()       # the kernel's size: its GPU time where known
               if statistics.mean(v.get("device_ms") or v["medians_ms"]) > 0.05]
        dev = [v for v in big if v.get("device_cv") is not None]
        lines += ["", f"Kernels above 50 µs: CV ≤ 1% for {sum(v['cv'] <= 0.01 for v in big)} of {len(big)} event-timed "
                      f"medians and {sum(v['device_cv'] <= 0.01 for v in dev)} of {len(dev)} device times."]
        steal = [x for x in report.get("stability_steal") or [] if x is not None]
        if steal:
            lines[-1] += f" CPU steal during these sweeps: {', '.join(f'{100 * x:.1f}%' for x in steal)}."
        loaded = [v for v in big if v["load_shift"] is not None]
        if loaded:
            lines[-1] += (f" Under load within 1%: {sum(abs(v['load_shift']) <= 0.01 for v in loaded)} of {len(loaded)} "
                          f"medians, {sum(abs(v['device_load_shift'] or 9) <= 0.01 for v in loaded)} device times.")
    return "\n".join(lines) + "\n"


def spread(d: Path, files: list[Path]) -> dict:
    """Run-to-run spread of every kernel passing in all of ``files`` (full sweeps of the same kernels):
    CV of the event-timed median and of the device time, by the kernel's device time; writes
    spread.json and spread.png (CV against device time, both measures, the 1% goal drawn) in ``d``."""
    runs = [{key(r): r["timing"] for r in records(f) if r["status"] == "ok"} for f in files]
    rows = []
    for kk in sorted(set.intersection(*(set(r) for r in runs))):
        xs, ds = [r[kk]["kernel_ms"] for r in runs], [r[kk].get("kernel_device_ms") for r in runs]
        if all(ds):
            rows.append({"kernel": kk, "device_ms": round(statistics.mean(ds), 5),
                         "cv": _spread(xs, None)["cv"], "device_cv": _spread(ds, None)["cv"]})
    big = [r for r in rows if r["device_ms"] > 0.05]
    out = {"files": [f.name for f in files], "kernels": len(rows), "above_50us": len(big),
           "cv_within_1pct": sum(r["cv"] <= 0.01 for r in big),
           "device_cv_within_1pct": sum(r["device_cv"] <= 0.01 for r in big), "rows": rows}
    (d / "spread.json").write_text(json.dumps(out, indent=1))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for k, label, m in (("cv", "event-timed median (host call path included)", "o"), ("device_cv", "device time", "x")):
        ax.scatter([r["device_ms"] for r in rows], [max(r[k], 1e-4) * 100 for r in rows], s=14, marker=m, label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.axvline(0.05, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="kernel device time (ms)", ylabel="CV across sweeps (%)",
           title=f"Run-to-run spread over {len(files)} full sweeps ({len(rows)} kernels)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(d / "spread.png", dpi=110)
    return out


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/bench_sweep")
    ap.add_argument("--stage", default="sweep,cold,stable,summary",
                    help="comma list of sweep, cold, stable, summary, spread (no GPU: compares --records)")
    ap.add_argument("--tier", default="gpu", choices=("gpu", "cpu"), help="cpu: try the stages out without a GPU")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs visible to the sweep stage")
    ap.add_argument("--parallel", type=int, default=8, help="evaluations in flight per GPU")
    ap.add_argument("--cpus", type=int, default=0, help="sweep stage on the first N cores only (0: all)")
    ap.add_argument("--problems", default="", help="restrict the sweep stage to these problem ids")
    ap.add_argument("--cold", type=int, default=8, help="evaluations run cold, one at a time, for the ratio")
    ap.add_argument("--stable-problems", default=STABLE_PROBLEMS, help="problems (both DSLs) of the stability runs")
    ap.add_argument("--records", default="", help="stage spread: comma list of full-sweep record files to compare")
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
            sweep(d / f"sweep_{args.gpus}gpu{'_exec' if workers_mode() == 'exec' else ''}.jsonl", log, stage="sweep",
                  tier=args.tier, parallel=args.parallel * args.gpus,
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
        elif stage == "spread":
            rep = spread(d, [Path(f) for f in args.records.split(",") if f])
            print(f"{rep['above_50us']} kernels above 50 µs: CV <= 1% for {rep['cv_within_1pct']} event-timed medians, "
                  f"{rep['device_cv_within_1pct']} device times", flush=True)
        elif stage == "summary":
            print(markdown(summary(d)), flush=True)
        else:
            ap.error(f"unknown stage {stage!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
