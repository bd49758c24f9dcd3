"""The job a worker gets at start (a :class:`.job.Job`), and the protocol's draw counts.

Kept apart from the orchestration so that re-timing and the agent's baselines build the same job
(seeds, cores, the worker's view of the problem folder) without importing all of :mod:`verify`.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from mkb_eval import problems as P
from mkb_eval.harness import cores
from mkb_eval.harness.job import Job, checked
from mkb_eval.harness.sandbox import code_root, repo_root

CORRECTNESS_DRAWS = 5
WARMUP_DRAWS = 10
TIMING_DRAWS = 50
REUSE_DRAWS = (2, 4)           # correctness draws that refill the previous draw's buffers


def _seed() -> int:
    return secrets.randbits(63)


def make_job(prob: P.Problem, dsl: str, root: Path, tier: str, size: str, device: str, gpu: int = 0,
             user: str | None = None, mode: str = "verify") -> Job:
    """What a worker gets at start: correctness seeds only. The timed draws' seeds come through the
    gate at the timing gate and each attested window's with it; re-checks are chosen after the window.
    ``mode="retime"``: one correctness draw and no DSL-dependence draw (the kernel was verified before).
    The worker's channel and gate are attached by its ``start``; a value outside the job's vocabularies
    is refused here (:func:`.job.checked`)."""
    timing_cpu, work_cpus = gpu_cores(gpu) if tier == "gpu" else (None, None)
    n = 1 if mode == "retime" else CORRECTNESS_DRAWS
    return checked(problem_dir=str(worker_path(prob.path, user)), dsl=dsl, tier=tier, size=size, device=device,
                   kernel_path=str(root / "work" / "kernel.py"), out_dir=str(root / "out"), dump_dir=str(root / "dump"),
                   mode=mode, correctness_seeds=[_seed() for _ in range(n)],
                   reuse_draws=list(REUSE_DRAWS) if mode == "verify" else [],
                   nodsl_seed=_seed() if mode == "verify" else None,
                   timing_cpu=timing_cpu, work_cpus=work_cpus)


def worker_path(path: Path, user: str | None) -> Path:
    """Where the worker finds a problem folder: the same folder in the staged copy of the checkout
    when its user cannot read the checkout (``sandbox.code_root``); folders outside it unchanged."""
    code, repo = code_root(user), repo_root()
    try:
        return code / Path(path).resolve().relative_to(repo) if code != repo else Path(path)
    except ValueError:
        return Path(path)


def gpu_cores(gpu: int) -> tuple[int | None, list[int] | None]:
    """(the core kept for GPU ``gpu``'s timed phase, the cores for all other worker work); see
    :mod:`mkb_eval.harness.cores`. (All workers once pinned themselves to one shared core: 8 in
    flight made start-up 8x slower.)"""
    import torch

    n = max(1, torch.cuda.device_count())
    p = cores.plan(n)
    if p is None or gpu >= n:
        return None, None
    return p[0][gpu], p[1]

