"""Sweeps: verify many (problem, DSL, kernel) triples, resumably, and tabulate the records.

A sweep appends one record per evaluation to a JSONL file; rerunning skips every triple whose
record matches the current problem hash, kernel hash, tier and GPU, so an interrupted sweep
resumes where it stopped and a changed kernel or problem is evaluated again.
"""

from __future__ import annotations

import collections
import hashlib
import math
import statistics
import threading
from collections.abc import Callable, Iterable
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


def spread_order(jobs: list[Job]) -> list[Job]:
    """The order a local sweep starts ``jobs`` in: families dealt in turn, and a problem's second
    kernel half a sweep after its first (the two DSLs take turns going first).

    Evaluations in flight share their GPU's memory, and a family's problems are alike: in id order
    the MoE layers (44-51) ran together and four of them ran a GPU short of memory. A second kernel
    started apart from the first also finds the problem's eager time already cached.
    """
    by_problem: dict[int, list[Job]] = {}
    families: dict[str, list[int]] = {}
    for j in jobs:
        if j.problem.id not in by_problem:
            families.setdefault(j.problem.family, []).append(j.problem.id)
        by_problem.setdefault(j.problem.id, []).append(j)
    turns: list[list[Job]] = []                       # one per problem, in the dealt order
    for i in range(max(map(len, families.values()), default=0)):
        for ids in families.values():
            if i < len(ids):
                mine = by_problem[ids[i]]
                k = i % len(mine)                     # within a family the DSLs take turns going first
                turns.append(mine[k:] + mine[:k])
    return [t[r] for r in range(max(map(len, turns), default=0)) for t in turns if r < len(t)]


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


class JobQueue:
    """The jobs of a sweep, taken one at a time by its threads. ``bound`` is how many more it may
    still hand out: a warm pool starts no worker beyond what could still be taken."""

    def __init__(self, jobs: Iterable[Job]) -> None:
        self._jobs = collections.deque(jobs)
        self._lock = threading.Lock()
        self.taken = 0

    def take(self) -> Job | None:
        with self._lock:
            if not self._jobs:
                return None
            self.taken += 1
            return self._jobs.popleft()

    def bound(self) -> int:
        return len(self._jobs)


def _done_keys(out: Path, tier: str, gpu: str | None) -> set[tuple[str, str, str]]:
    if not out.exists():
        return set()
    keys = set()
    for r in read_jsonl(out):
        if r.get("kind") == "verification" and r.get("tier") == tier and r.get("env", {}).get("gpu") == gpu:
            keys.add((r["problem_hash"], r["dsl"], r["kernel_sha256"]))
    return keys


def run_sweep(jobs: list[Job], out: Path, *, tier: str = "auto", verify_kwargs: dict[str, Any] | None = None,
              parallel: int = 1, executor: str = "local", address: str | None = None, warm: bool = False) -> list[dict]:
    """Verify every job not already in ``out``; returns the new records. Shows a progress bar.

    ``executor="local"`` (the default) runs a thread pool here: with ``parallel`` > 1 evaluations
    overlap (process start, imports, compilation and correctness run side by side), while the GPU's
    lane lets one timed phase at a time have it. With more than one GPU each GPU gets a sweep process
    of its own that asks for the next job when it has room (:mod:`mkb_eval.sweep_per_gpu`);
    ``parallel`` is then the total in flight. ``executor="ray"`` runs each evaluation as a Ray task on the cluster at
    ``address`` (default: a local Ray instance), see :mod:`mkb_eval.ray_executor`; ``parallel`` is
    then Ray's to decide. Both give the same records, written here and resumed the same way.
    ``warm`` takes each evaluation's worker from a :class:`WarmPool` (on Ray, one per actor).
    """
    kwargs = verify_kwargs or {}
    if executor == "ray":
        from mkb_eval import ray_executor as R

        started = R.connect(address)
        try:
            tier, gpu = R.tier_and_gpu(tier)
            return _sweep(jobs, out, tier, gpu, R.describe() + (", warm actors" if warm else ""),
                          lambda todo, sink: R.run_jobs(todo, tier, kwargs, sink.record, sink.failed, warm))
        finally:
            if started:
                import ray

                ray.shutdown()
    if executor != "local":
        raise ValueError(f"executor must be 'local' or 'ray', not {executor!r}")
    import torch

    tier = ("gpu" if torch.cuda.is_available() else "cpu") if tier == "auto" else tier
    gpu = torch.cuda.get_device_properties(0).name if tier == "gpu" else None
    n_gpus = torch.cuda.device_count() if tier == "gpu" else 0
    how = f"{parallel} at a time{', warm workers' if warm else ''}"
    if n_gpus > 1:
        from mkb_eval import sweep_per_gpu

        return _sweep(jobs, out, tier, gpu, f"{how}, a sweep process per GPU ({n_gpus})",
                      lambda todo, sink: sweep_per_gpu.run(todo, tier, kwargs, parallel, n_gpus, sink, warm))
    return _sweep(jobs, out, tier, gpu, how, lambda todo, sink: _run_local(JobQueue(spread_order(todo)), tier, kwargs,
                                                                          parallel, sink, warm))


class _Sink:
    """Where finished evaluations go, from any executor: the store, the progress bar, the new list."""

    def __init__(self, out: Path, bar: Any, task: Any) -> None:
        self.out, self.bar, self.task = out, bar, task
        self.new: list[dict] = []
        self.failures = 0
        self._lock = threading.Lock()

    def record(self, rec: dict, job: Job | None = None) -> None:
        with self._lock:
            append_jsonl(self.out, rec)
            self.new.append(rec)
            t = rec["timing"]
            self.bar.console.print(f"  {rec['problem'][:44]:44s} {rec['dsl']:8s} {rec['status']:15s} "
                                   f"{_f(t.get('kernel_ms'))} ms  x{_f(t.get('speedup'), '.2f')}",
                                   markup=False, highlight=False)
            self.bar.advance(self.task)

    def note(self, text: str) -> None:
        with self._lock:
            self.bar.console.print(text, markup=False, highlight=False)

    def failed(self, job: Job, error: str) -> None:
        """An evaluation that produced no record (infrastructure failure): said, not stored, retried next run."""
        with self._lock:
            self.failures += 1
            self.bar.console.print(f"  {job.problem.name[:44]:44s} {job.dsl:8s} NOT RECORDED ({error}); "
                                   "rerun the sweep to retry it", markup=False, highlight=False)
            self.bar.advance(self.task)


def _sweep(jobs: list[Job], out: Path, tier: str, gpu: str | None, how: str,
           run: Callable[[list[Job], _Sink], None]) -> list[dict]:
    """The part shared by the executors: skip what is done, show progress, store what ``run`` hands back."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    done = _done_keys(out, tier, gpu)
    todo = [j for j in jobs if (j.problem.hash, j.dsl, j.kernel_sha256) not in done]
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols) as bar:
        sink = _Sink(out, bar, bar.add_task(f"verify ({tier}, {how}; {len(jobs) - len(todo)} already done)",
                                            total=len(todo)))
        run(todo, sink)
        if sink.failures:
            bar.console.print(f"{sink.failures} evaluation(s) not recorded; rerun the same sweep to retry them",
                              markup=False, highlight=False)
    return sink.new


def _run_local(queue: JobQueue, tier: str, verify_kwargs: dict[str, Any], parallel: int, sink: Any,
               warm: bool = False) -> None:
    """A sweep on one GPU (or the CPU tier): ``parallel`` threads each take the queue's next job until
    it is empty, and the GPU's lane lets one timed phase at a time have the GPU. On a host with GPUs
    everything here, and every worker started, keeps off the timing cores
    (:mod:`mkb_eval.harness.cores`), whatever the tier: a CPU-tier sweep's compilation must not slow
    another sweep's timed calls. An evaluation short of GPU memory while others share the GPU is run
    again alone at the end; one the harness fails on is reported, not stored, and the sweep goes on."""
    import contextlib
    import traceback
    from concurrent.futures import ThreadPoolExecutor

    from mkb_eval.harness.cores import keep_off_timing_cores
    from mkb_eval.harness.lanes import GpuLanes
    from mkb_eval.harness.pool import WarmPool
    from mkb_eval.harness.verify import Limits, verify

    limits = verify_kwargs.get("limits") or Limits()
    crowded: list[Job] = []

    def crowded_out(job: Job) -> None:
        """Run ``job`` again alone at the end, with a worker started ahead for it like every other
        job's (a cold start cost ~10 s)."""
        crowded.append(job)
        if workers is not None:
            workers.allow(1)
            workers.fill(tier, 0, limits)

    def drain() -> None:
        while (job := queue.take()) is not None:
            if workers is not None:               # no worker started for an evaluation that will not come
                workers.cap(queue.taken + queue.bound() + len(crowded))
            evaluate(job, False)

    def evaluate(job: Job, alone: bool) -> None:
        """``job`` beside the others under the GPU's lane, or ``alone`` (a retry)."""
        try:
            rec = verify(job.problem, job.dsl, job.kernel, tier=tier, gpu=0, lane=None if alone else lane,
                         pool=workers, **verify_kwargs).to_dict()
        except Exception as e:  # noqa: BLE001 - the harness's own failure: this evaluation is retried next run
            if not alone and parallel > 1 and oom_text(f"{type(e).__name__}: {e}"):
                crowded_out(job)       # the judge ran short of GPU memory beside the other evaluations
                with lane.exclusive():             # the release takes the allocator's lock: never mid-timing
                    _release_gpu_cache()
                return
            sink.failed(job, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            return
        if not alone and parallel > 1 and out_of_memory(rec):
            crowded_out(job)           # GPU memory is shared by the evaluations in flight: not yet the kernel's fault
            return
        if alone:
            rec["flags"].append("retried_alone_after_oom")
        sink.record(rec, job)

    with contextlib.ExitStack() as stack:
        n_gpus = 1 if tier == "gpu" else _visible_gpus()
        if n_gpus:
            stack.enter_context(keep_off_timing_cores(n_gpus))
        lanes = GpuLanes(1, reference_timers=tier == "gpu" and parallel > 1)   # the timer born on the work cores
        stack.callback(lanes.close)
        lane = lanes[0]
        workers = stack.enter_context(WarmPool.for_lanes(tier, 1, parallel, limits, limit=queue.bound())) if warm else None
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for f in [pool.submit(drain) for _ in range(max(1, parallel))]:
                f.result()
        for job in crowded:            # the judge's cached GPU memory handed back first: what runs out now is the kernel's doing
            _release_gpu_cache()
            evaluate(job, True)


_OOM = ("OutOfMemoryError", "out of memory", "cudaErrorMemoryAllocation", "CUBLAS_STATUS_ALLOC_FAILED")


def oom_text(text: str) -> bool:
    """An error text that says GPU memory ran out (torch's, the CUDA runtime's or cuBLAS's words)."""
    return any(s in text for s in _OOM)


def out_of_memory(rec: dict) -> bool:
    """A GPU evaluation that failed for want of GPU memory (torch's OutOfMemoryError, or the CUDA
    error an allocation outside torch's allocator raises)."""
    return rec.get("tier") == "gpu" and rec.get("status") == "runtime_error" and oom_text(rec.get("message") or "")


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: no timing cores to keep
        return 0


def _release_gpu_cache() -> None:
    """Hand this process's cached GPU blocks back, so evaluations that follow find the memory."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a failing release must not end the sweep
        pass


# (stage key in a record's stages_s, what it is); GPU-tier and CPU-tier keys, in the order they happen
STAGES = (("worker_start", "worker start and imports (warm: taking a started worker)"),
          ("w_setup", "worker setup"), ("w_dsl_import", "DSL toolchain import"), ("w_kernel_import", "kernel import"),
          ("reference_smoke", "reference at smoke size"), ("compile_s", "compile only"),
          ("first_call_s", "first call (compile and launch)"), ("correctness_draws_s", "correctness draws"),
          ("compile_lane_wait", "waiting for the GPU after compiling"), ("judge_correctness", "judging correctness"),
          ("lane_step_aside", "stepping aside for other timed phases"), ("timing_lane_wait", "waiting to time"),
          ("worker_timing", "timing"), ("attested_window", "attested window"),
          ("eager_baseline", "eager baseline and its window"), ("retime", "re-timed window"), ("compile_baseline", "torch.compile baseline"),
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


def _f(x: Any, spec: str = ".4f") -> str:
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
        ms = known.get(baseline_key(r["problem_hash"], r.get("size"), env), {}).get("ms")
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
