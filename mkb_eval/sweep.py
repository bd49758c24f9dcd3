"""Sweeps: verify many (problem, DSL, kernel) triples, resumably, and tabulate the records.

A sweep appends one record per evaluation to a JSONL file; rerunning skips every triple whose
record matches the current problem hash, kernel hash, tier and GPU, so an interrupted sweep
resumes where it stopped and a changed kernel or problem is evaluated again.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.records import append_jsonl, read_jsonl


@dataclass(frozen=True)
class Job:
    problem: P.Problem
    dsl: str
    kernel: Path

    @property
    def kernel_sha256(self) -> str:
        return hashlib.sha256(self.kernel.read_text(errors="replace").encode()).hexdigest()


def shipped_jobs(problems: Iterable[P.Problem], dsls: Iterable[str]) -> list[Job]:
    dsls = list(dsls)
    return [Job(p, d, p.solution_path(d)) for p in problems for d in dsls if p.solution_path(d).exists()]


def folder_jobs(folder: Path, problems: Iterable[P.Problem]) -> list[Job]:
    """Kernels named ``<NN>_<dsl>.py`` or ``<NN>/<dsl>.py`` in a folder."""
    by_id = {p.id: p for p in problems}
    jobs = []
    for path in sorted(folder.rglob("*.py")):
        stem, parent = path.stem, path.parent.name
        if "_" in stem and stem.split("_")[0].isdigit() and stem.split("_", 1)[1] in P.DSLS:
            pid, dsl = int(stem.split("_")[0]), stem.split("_", 1)[1]
        elif parent.isdigit() and stem in P.DSLS:
            pid, dsl = int(parent), stem
        else:
            continue
        if pid in by_id:
            jobs.append(Job(by_id[pid], dsl, path))
    return jobs


def _done_keys(out: Path, tier: str, gpu: str | None) -> set[tuple[str, str, str]]:
    if not out.exists():
        return set()
    keys = set()
    for r in read_jsonl(out):
        if r.get("kind") == "verification" and r.get("tier") == tier and r.get("env", {}).get("gpu") == gpu:
            keys.add((r["problem_hash"], r["dsl"], r["kernel_sha256"]))
    return keys


def run_sweep(jobs: list[Job], out: Path, *, tier: str = "auto", verify_kwargs: dict[str, Any] | None = None,
              parallel: int = 1) -> list[dict]:
    """Verify every job not already in ``out``; returns the new records. Shows a progress bar.

    With ``parallel`` > 1 evaluations overlap: process start, imports, compilation and
    correctness run side by side, while each visible GPU's lane lets one timed phase at a time
    have that GPU (jobs are spread round-robin over the GPUs).
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mkb_eval.harness.lanes import GpuLane
    from mkb_eval.harness.verify import verify

    tier = ("gpu" if torch.cuda.is_available() else "cpu") if tier == "auto" else tier
    gpu = torch.cuda.get_device_properties(0).name if tier == "gpu" else None
    n_gpus = torch.cuda.device_count() if tier == "gpu" else 1
    lanes = [GpuLane(i) for i in range(max(1, n_gpus))]
    done = _done_keys(out, tier, gpu)
    todo = [j for j in jobs if (j.problem.hash, j.dsl, j.kernel_sha256) not in done]
    new: list[dict] = []
    lock = threading.Lock()
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols) as bar:
        task = bar.add_task(f"verify ({tier}, {parallel} at a time, {len(lanes)} GPU lane(s); "
                            f"{len(jobs) - len(todo)} already done)", total=len(todo))

        def one(k: int, job: Job) -> None:
            g = k % len(lanes)
            rec = verify(job.problem, job.dsl, job.kernel, tier=tier, gpu=g, lane=lanes[g],
                         **(verify_kwargs or {})).to_dict()
            with lock:
                append_jsonl(out, rec)
                new.append(rec)
                bar.console.print(f"  {rec['problem'][:44]:44s} {rec['dsl']:8s} {rec['status']:15s} "
                                  f"{_f(rec['timing'].get('kernel_ms'))} ms  x{_f(rec['timing'].get('speedup'), '.2f')}")
                bar.advance(task)

        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for f in [pool.submit(one, k, j) for k, j in enumerate(todo)]:
                f.result()
    return new


def _f(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def latest(records: Iterable[dict]) -> list[dict]:
    """The newest verification record per (problem, DSL, tier)."""
    last: dict[tuple, dict] = {}
    for r in records:
        if r.get("kind") == "verification":
            last[(r["problem_id"], r["dsl"], r["tier"])] = r
    return [last[k] for k in sorted(last)]


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
        rows.append(f"| {r['problem']} | {r['dsl']} | {r['status']} | {_f(t.get('kernel_ms'))} | "
                    f"{_f(t.get('kernel_device_ms'))} | {_f(t.get('eager_ms'))} | {_f(t.get('compile_ms'))} | "
                    f"{_f(t.get('speedup'), '.2f')} | {_f(t.get('speedup_vs_compile'), '.2f')} | "
                    f"{_f(t.get('sol_fraction'), '.2f')} | {e.get('gpu', '-')} (driver {e.get('driver', '-')}) | {ver} |")
    s = summary(records)
    rows += ["", "| DSL | passed | geomean x eager | geomean x torch.compile | median SOL fraction |",
             "|---|---:|---:|---:|---:|"]
    for dsl, d in s["by_dsl"].items():
        rows.append(f"| {dsl} | {d['passed']}/{d['evaluated']} | {_f(d['geomean_vs_eager'], '.2f')} | "
                    f"{_f(d['geomean_vs_compile'], '.2f')} | {_f(d['median_sol_fraction'], '.2f')} |")
    rows += ["", "| DSL / family | passed | geomean x eager | geomean x torch.compile |", "|---|---:|---:|---:|"]
    for k, d in s["by_dsl_family"].items():
        rows.append(f"| {k} | {d['passed']} | {_f(d['geomean_vs_eager'], '.2f')} | {_f(d['geomean_vs_compile'], '.2f')} |")
    return "\n".join(rows) + "\n"
