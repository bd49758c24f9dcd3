"""A sweep on one GPU (or the CPU tier) in this process: a thread pool over a job queue, the GPU's
timing lane, warm workers, and the retry alone of evaluations crowded out of GPU memory."""

from __future__ import annotations

from typing import Any

from mkb_eval.sweep.jobs import Job, JobQueue


def run_local(queue: JobQueue, tier: str, verify_kwargs: dict[str, Any], parallel: int, sink: Any,
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
