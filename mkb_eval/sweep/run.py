"""Sweeps: verify many (problem, DSL, kernel) triples, resumably, through one of three executors.

A sweep appends one record per evaluation to a JSONL file; rerunning skips every triple whose
record matches the current problem hash, kernel hash, tier and GPU, so an interrupted sweep
resumes where it stopped and a changed kernel or problem is evaluated again. The executors
(:mod:`~mkb_eval.sweep.local`, :mod:`~mkb_eval.sweep.per_gpu`, :mod:`~mkb_eval.sweep.ray_executor`)
are imported only by the sweep that uses them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkb_eval.records import append_jsonl
from mkb_eval.sweep.jobs import Job, JobQueue, done_keys, spread_order
from mkb_eval.sweep.tables import fmt


def run_sweep(jobs: list[Job], out: Path, *, tier: str = "auto", verify_kwargs: dict[str, Any] | None = None,
              parallel: int = 1, executor: str = "local", address: str | None = None, warm: bool = False) -> list[dict]:
    """Verify every job not already in ``out``; returns the new records. Shows a progress bar.

    ``executor="local"`` (the default) runs a thread pool here: with ``parallel`` > 1 evaluations
    overlap (process start, imports, compilation and correctness run side by side), while the GPU's
    lane lets one timed phase at a time have it. With more than one GPU each GPU gets a sweep process
    of its own that asks for the next job when it has room (:mod:`mkb_eval.sweep.per_gpu`);
    ``parallel`` is then the total in flight. ``executor="ray"`` runs each evaluation as a Ray task on the cluster at
    ``address`` (default: a local Ray instance), see :mod:`mkb_eval.sweep.ray_executor`; ``parallel`` is
    then Ray's to decide. Both give the same records, written here and resumed the same way.
    ``warm`` takes each evaluation's worker from a :class:`WarmPool` (on Ray, one per actor).
    """
    kwargs = verify_kwargs or {}
    if executor == "ray":
        from mkb_eval.sweep import ray_executor as R

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
        from mkb_eval.sweep import per_gpu

        return _sweep(jobs, out, tier, gpu, f"{how}, a sweep process per GPU ({n_gpus})",
                      lambda todo, sink: per_gpu.run(todo, tier, kwargs, parallel, n_gpus, sink, warm))
    from mkb_eval.sweep.local import run_local

    return _sweep(jobs, out, tier, gpu, how, lambda todo, sink: run_local(JobQueue(spread_order(todo)), tier, kwargs,
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
                                   f"{fmt(t.get('kernel_ms'))} ms  x{fmt(t.get('speedup'), '.2f')}",
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

    done = done_keys(out, tier, gpu)
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
