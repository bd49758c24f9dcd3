"""Run a sweep's evaluations as Ray tasks on a Ray cluster (``mkb verify --all --executor ray``).

Ray does the scheduling: each evaluation is one task that asks for one CPU, plus one whole GPU on
the GPU tier. Ray's GPU accounting therefore runs at most one evaluation per GPU at a time and
sets ``CUDA_VISIBLE_DEVICES`` to the GPU it granted, so the task verifies on its ``cuda:0`` with a
private timing lane; the shared per-GPU ``GpuLane``s of the local pool are not needed (nor
possible: tasks on different nodes share no lock). The price is that, unlike the local pool, two
evaluations on one GPU do not overlap their compile phases with each other's timing.

What travels to a task is chosen to work across nodes: the kernel's bytes (the driver's file need
not exist on the worker node; they are written to a temp file of the same name, so the policy
check and the kernel hash see exactly what the local pool sees) and the problem folder relative
to the problems root (problems ship with the repository, which every node must have installed at
the same commit; the task refuses to run when its copy of the problem hashes differently).

Records are the local pool's, field for field, with two GPU-tier consequences of running on other
processes and nodes: ``env.gpu_count`` is the one GPU the task was granted, and the torch.compile
baseline cache is each node's own (``MKB_CACHE_DIR`` there), so ``--cached-compile-baseline`` needs
it filled on every node, or a shared folder.

With ``warm`` (``mkb verify --all --executor ray --warm``) the evaluations go to long-lived actors
instead, one per GPU of the cluster (on the CPU tier one per CPU, at most one per job), each holding
a :class:`~mkb_eval.harness.pool.WarmPool`: the actor's fork server imports torch and both
toolchains once, and every evaluation still gets a fresh process, forked ahead of need while the
previous one runs, so a task no longer pays ~10 s of start-up (records say ``warm (forked ...)``,
as the local pool's warm records do). A job goes to whichever actor is free next, as
``ray.util.ActorPool`` would hand it, kept here with its job so that a failure names it; an actor
that dies (its node lost) takes its job with it, reported as not recorded, and is not replaced,
so a shrinking cluster ends the sweep early instead of waiting for resources that may not return.

Only the driver writes the JSONL store: results come back as record dicts and the caller's
``emit`` appends them as they finish. A task that raises (its node died and Ray's own retries ran
out, the harness hit a bug, the problem copies differ) is an infrastructure failure, not a verdict
on the kernel, and the closed record status set has no such status (``crashed`` means the
candidate's worker died), so it is reported through ``fail`` and left unrecorded: the next run of
the sweep retries it.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mkb_eval import problems as P

if TYPE_CHECKING:
    from mkb_eval.sweep.jobs import Job

INSTALL_HINT = "the Ray executor needs Ray: pip install 'mkb-eval[ray]'"


def require_ray() -> None:
    """Raise ImportError with the install hint when Ray is missing (checked before any work starts)."""
    if importlib.util.find_spec("ray") is None:
        raise ImportError(INSTALL_HINT)


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (None: ``RAY_ADDRESS`` or a new local instance).

    Returns True when this call started the connection, so the caller should shut it down; an
    already initialised Ray (a notebook, a test) is used as it is.
    """
    require_ray()
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return True


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_properties(0).name


def tier_and_gpu(tier: str) -> tuple[str, str | None]:
    """Resolve ``auto`` from the cluster's resources, not the driver's (a head node often has no
    GPU), and the GPU model that resume keys are matched on, read by a one-GPU probe task.

    A cluster of mixed GPU models gets records of whichever model ran each task, while resuming
    matches the probed model only: give such a sweep one model per run.
    """
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    tier = ("gpu" if gpus > 0 else "cpu") if tier == "auto" else tier
    if tier != "gpu":
        return tier, None
    if not gpus:
        raise RuntimeError("the GPU tier was asked for, but the Ray cluster has no GPUs")
    return tier, ray.get(ray.remote(_gpu_name).options(num_cpus=1, num_gpus=1).remote())


def describe() -> str:
    """The progress bar's note on where evaluations run."""
    import ray

    res = ray.cluster_resources()
    return f"ray: {len(ray.nodes())} node(s), {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU"


def _problem_ref(problem: P.Problem) -> str:
    """The problem folder relative to the problems root when it sits there (absolute otherwise)."""
    try:
        return str(problem.path.resolve().relative_to(P.problems_root().resolve()))
    except ValueError:
        return str(problem.path)


def verify_task(problem_ref: str, problem_hash: str, dsl: str, kernel_name: str, kernel_bytes: bytes, tier: str,
                verify_kwargs: dict[str, Any], *, pool: Any = None) -> dict[str, Any]:
    """One evaluation inside a Ray worker (or a warm actor's ``pool``); returns ``VerificationRecord.to_dict()``."""
    from mkb_eval.harness.verify import verify

    prob = P.load_problem(P.problems_root().resolve() / problem_ref)   # an absolute ref stays as it is
    if prob.hash != problem_hash:
        raise RuntimeError(f"{prob.name}: this node's copy of the problem hashes to {prob.hash[:12]}, the driver's to "
                           f"{problem_hash[:12]}; install the same commit on every node")
    with tempfile.TemporaryDirectory(prefix="mkb-ray-") as d:
        kernel = Path(d) / kernel_name
        kernel.write_bytes(kernel_bytes)
        return verify(prob, dsl, kernel, tier=tier, gpu=0, pool=pool, **verify_kwargs).to_dict()


class WarmEvaluator:
    """A Ray actor's state: one GPU's (or CPU slot's) evaluations, one at a time, each in a worker forked
    ahead of need by this actor's fork server."""

    def __init__(self, tier: str, verify_kwargs: dict[str, Any]) -> None:
        from mkb_eval.harness.pool import WarmPool
        from mkb_eval.harness.verify import Limits

        self.pool = WarmPool(per_key=1)
        self.pool.fill(tier, 0, verify_kwargs.get("limits") or Limits())   # the first job's worker, started now

    def verify(self, *args: Any) -> dict[str, Any]:
        return verify_task(*args, pool=self.pool)

    def close(self) -> None:
        self.pool.close()


def _args(job: Job, tier: str, verify_kwargs: dict[str, Any]) -> tuple:
    return (_problem_ref(job.problem), job.problem.hash, job.dsl, job.kernel.name, job.kernel.read_bytes(), tier,
            verify_kwargs)


def _error(e: Exception) -> str:
    cause = getattr(e, "cause", None) or e     # a task's own exception, without Ray's traceback
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"


def run_jobs(jobs: Sequence[Job], tier: str, verify_kwargs: dict[str, Any], emit: Callable[[dict[str, Any]], None],
             fail: Callable[[Job, str], None], warm: bool = False) -> None:
    """Submit every job as a task (``warm``: to warm actors), then hand each result to ``emit`` (or the
    error to ``fail``) as it finishes.

    Interrupted (Ctrl-C), the tasks still pending are cancelled; the finished ones are already stored.
    """
    import ray

    if warm:
        _run_warm(list(jobs), tier, verify_kwargs, emit, fail)
        return
    task = ray.remote(verify_task).options(num_cpus=1, num_gpus=1 if tier == "gpu" else 0)
    pending = {task.remote(*_args(j, tier, verify_kwargs)): j for j in jobs}
    try:
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            job = pending.pop(ref)
            try:
                rec = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - RayTaskError, WorkerCrashedError, NodeDiedError, ...: one job, not the sweep
                fail(job, _error(e))
                continue
            emit(rec)
    finally:
        for ref in pending:
            ray.cancel(ref)


def _run_warm(jobs: list[Job], tier: str, verify_kwargs: dict[str, Any], emit: Callable[[dict[str, Any]], None],
              fail: Callable[[Job, str], None]) -> None:
    import ray
    from ray.exceptions import RayActorError

    if not jobs:                                  # a resumed sweep with nothing left: no actor, no fork server
        return
    res = ray.cluster_resources()
    n = max(1, min(len(jobs), int(res.get("GPU", 0) if tier == "gpu" else res.get("CPU", 1))))
    actor = ray.remote(WarmEvaluator).options(num_cpus=1, num_gpus=1 if tier == "gpu" else 0)
    idle = [actor.remote(tier, verify_kwargs) for _ in range(n)]
    everyone = list(idle)
    running: dict[Any, tuple[Job, Any]] = {}
    todo = list(reversed(jobs))
    try:
        while todo or running:
            while idle and todo:
                a, job = idle.pop(), todo.pop()
                running[a.verify.remote(*_args(job, tier, verify_kwargs))] = (job, a)
            if not running:                       # every actor is gone: what is left cannot run
                for job in reversed(todo):
                    fail(job, "no Ray actor left to evaluate it (their nodes were lost)")
                return
            (ref,), _ = ray.wait(list(running), num_returns=1)
            job, a = running.pop(ref)
            try:
                rec = ray.get(ref)
            except RayActorError as e:            # the actor died: its job is lost, and so is the actor
                fail(job, _error(e))
                continue
            except Exception as e:  # noqa: BLE001 - the task's own failure (a stale problem copy, a harness error): one job
                fail(job, _error(e))
            else:
                emit(rec)
            idle.append(a)
    finally:
        for ref in running:
            ray.cancel(ref)
        closing = [a.close.remote() for a in everyone]
        ray.wait(closing, num_returns=len(closing), timeout=30)   # fork servers and idle workers stop
        for a in everyone:
            ray.kill(a)
