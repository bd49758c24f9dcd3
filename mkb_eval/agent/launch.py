"""``mkb run`` as a library call: validate, lock the run folder, plan, start the model, run, record.

The order matters for bad input: problems, arms and the model spec are checked and the run
folder is planned (read-only apart from its lock) before the model is started, and nothing is
written to the folder until the model is up, so a typo or an unreachable server leaves it as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.agent import plan as PL
from mkb_eval.agent.arms import parse_arms
from mkb_eval.agent.backends import Backend, ModelSpec, Sampling, open_backend, parse_model_spec
from mkb_eval.agent.loop import Budget
from mkb_eval.agent.models import DEFAULT_MODEL
from mkb_eval.agent.progress import ProgressView
from mkb_eval.agent.runner import Runner, RunSummary, VerificationPool
from mkb_eval.agent.store import RunStore
from mkb_eval.env import git_commit


@dataclass
class RunOptions:
    """Everything ``mkb run`` takes (defaults = the protocol's defaults)."""

    model: str = DEFAULT_MODEL
    problems: str = "28,36"
    arms: str = "all"
    replicates: int = 1
    device: str = "cpu"
    run_dir: str | None = None
    engine: str = "vllm"
    budget: Budget = field(default_factory=Budget)
    sampling: Sampling = field(default_factory=lambda: Sampling(seed=0))
    max_model_len: int | None = None
    workers: int | None = None
    warm: bool | None = None            # None: warm workers on the GPU tier (as a sweep), cold on the CPU tier
    gpus: int | None = None
    submissions_given: bool = True      # False: a replay run's budget is its source's number of submissions
    retime: bool = True                 # re-time each finished (problem, replicate)'s final kernels together
    retime_rounds: int = 5
    dedupe: bool = True                 # a kernel verified once per run (problem, DSL, tier)
    rerun_stale: bool = False
    dry_run: bool = False
    api_key: str | None = None
    root: str | None = None
    progress: bool = True


def model_slug(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z._-]", "-", name.rstrip("/").split("/")[-1]) or "model"


def select_problems(text: str, root: str | None = None) -> list[P.Problem]:
    """Comma-separated ids or names, or ``all``; an unknown one raises ProblemError naming it."""
    if text.strip() == "all":
        return P.load_all(root)
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise P.ProblemError("--problems is empty; give ids like 28,36 or 'all'")
    out: dict[int, P.Problem] = {}
    for t in items:
        p = P.find(t, root)
        out[p.id] = p
    return [out[k] for k in sorted(out)]


def _budget(opts: RunOptions, spec: ModelSpec) -> Budget:
    """The attempt budget; a replay run without --submissions gets as many as its source holds."""
    if spec.kind != "replay" or opts.submissions_given:
        return opts.budget
    from mkb_eval.agent import replay

    n = replay.open_source(spec.source or "", opts.root).max_submissions
    return dataclasses.replace(opts.budget, submissions=n)


def run_trials(opts: RunOptions, backend: Backend | None = None, verify_fn: Any = None,
               log: Any = print, retime_fn: Any = None,
               baseline_measure: Any = None) -> tuple[RunSummary | None, list[PL.Planned]]:
    """Plan and run; returns (summary, plan). ``backend``, ``verify_fn``, ``retime_fn`` (the re-timing,
    default ``mkb_eval.harness.retime.retime``) and ``baseline_measure`` may be injected (tests)."""
    if opts.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, not {opts.device!r}")
    tier = "gpu" if opts.device == "cuda" else "cpu"
    problems = select_problems(opts.problems, opts.root)
    arms = parse_arms(opts.arms)
    spec: ModelSpec = parse_model_spec(opts.model, opts.root) if backend is None else ModelSpec("injected", backend.name)
    run_dir = Path(opts.run_dir or Path("runs") / model_slug(spec.name))
    opts = dataclasses.replace(opts, budget=_budget(opts, spec))
    protocol = PL.protocol_sha256(opts.budget.to_dict(), opts.sampling.to_dict(), tier)
    stamps = {p.id: PL.stamps_for(p, protocol) for p in problems}
    keys = PL.select([p.id for p in problems], arms, opts.replicates)

    with RunStore(run_dir) as store:
        for note in store.notes:
            log(f"note: {note}")
        store.check_model(spec.name)
        records = store.records()
        skills = {k.id: store.final_skill(k.id) for k in keys if not k.is_skill}
        planned = PL.plan(keys, records, stamps, skills)
        c = PL.counts(planned)
        log(f"run folder {run_dir}: {len(planned)} trials: {c['run']} to run, {c['rerun']} to rerun after an "
            f"error, {c['stale']} stale, {c['reuse']} finished (reused)")
        PL.check_stale(planned, opts.rerun_stale)
        if opts.dry_run:
            return None, planned
        if all(p.status == PL.REUSE for p in planned):
            if opts.retime:            # a run killed while re-timing: the rest of its re-timing
                _retime_only(opts, store, run_dir, problems, planned, tier, spec.name, retime_fn, log)
            return None, planned
        owned = backend is None
        if backend is None:
            backend = open_backend(spec, engine=opts.engine, device=opts.device, seed=opts.sampling.seed or 0,
                                   max_model_len=opts.max_model_len, api_key=opts.api_key, log=log, root=opts.root)
        store.pin_model(spec.name, backend.identity())
        store.log_invocation({
            "model": spec.name, "backend": backend.identity(), "problems": [p.id for p in problems], "arms": arms,
            "replicates": opts.replicates, "device": opts.device, "tier": tier, "budget": opts.budget.to_dict(),
            "sampling": opts.sampling.to_dict(), "rerun_stale": opts.rerun_stale, "plan": c,
            "commit": None, "dirty": None, **git_commit(),        # git_commit() is {} where git cannot be asked
        })
        gpus = opts.gpus if opts.gpus is not None else (_gpu_count() if tier == "gpu" else 0)
        with contextlib.ExitStack() as stack:
            pool = _pool(opts, tier, gpus, run_dir, verify_fn, stack)
            if owned:
                stack.callback(backend.close)
            if tier == "gpu":
                _shared_baselines(problems, run_dir, pool, baseline_measure, log)
            retimer = _retimer(opts, run_dir, problems, tier, spec.name, pool, retime_fn, log, stack)
            runner = Runner(store, backend, {p.id: p for p in problems}, planned, stamps, budget=opts.budget,
                            sampling=opts.sampling, tier=tier, pool=pool, progress=ProgressView(opts.progress),
                            retimer=retimer)
            summary = runner.run()
            if retimer is not None:
                log(f"paired re-timing: {retimer.stored} group(s) re-timed in {retimer.gpu_s:.1f} s, "
                    f"{retimer.skipped_done} already done, {len(retimer.failed)} failed (re-timed by the next run)")
            if pool.reused:
                log(f"verification: {pool.reused} submission(s) were kernels already verified in this run (reused)")
        return summary, planned


def default_workers(tier: str, gpus: int) -> int:
    """Verifications in flight: on a GPU host the sweep's parallelism (8 per GPU, leaving two cores), else 4."""
    cpus = os.cpu_count() or 1
    if tier == "gpu":
        return max(2, min(8 * max(1, gpus), cpus - 2))
    return max(1, min(4, cpus))


def _pool(opts: RunOptions, tier: str, gpus: int, run_dir: Path, verify_fn: Any,
          stack: contextlib.ExitStack) -> VerificationPool:
    """The sweep's machinery on a GPU host: forked warm workers, a lane and baseline timer per GPU, the
    timing cores kept free, shared baselines; on the CPU tier a plain pool unless --warm-workers."""
    from mkb_eval.agent import baselines

    workers = opts.workers or default_workers(tier, gpus)
    warm = opts.warm if opts.warm is not None else (tier == "gpu" and verify_fn is None)
    if tier == "gpu" and verify_fn is None:
        from mkb_eval.harness.cores import keep_off_timing_cores

        stack.enter_context(keep_off_timing_cores(max(1, gpus)))
    kwargs = baselines.verify_kwargs(run_dir) if tier == "gpu" else {}
    pool = VerificationPool(tier, workers, gpus, verify_fn=verify_fn, warm=warm, verify_kwargs=kwargs,
                            dedupe=opts.dedupe)
    stack.callback(pool.close)
    return pool


def _shared_baselines(problems: list[P.Problem], run_dir: Path, pool: VerificationPool, measure: Any,
                      log: Any) -> None:
    from mkb_eval.agent import baselines
    from mkb_eval.env import describe

    got = baselines.prepare(problems, run_dir, pool.lanes, describe(gpu=True), measure=measure, log=log)
    bad = [f"{b.problem_id:02d} {b.kind}" for b in got if b.ms is None]
    log(f"shared baselines in {baselines.baseline_dir(run_dir)}: {len(got) - len(bad)} of {len(got)} timed"
        + (f"; without a time: {', '.join(bad)}" if bad else ""))


def _retimer(opts: RunOptions, run_dir: Path, problems: list[P.Problem], tier: str, model: str,
             pool: VerificationPool | None, retime_fn: Any, log: Any, stack: contextlib.ExitStack) -> Any:
    if not opts.retime:
        return None
    from mkb_eval.agent.retiming import Retimer, RetimeSettings

    lanes = pool.lanes if pool is not None else None
    r = Retimer(run_dir, {p.id: p for p in problems}, tier, model=model,
                settings=RetimeSettings(rounds=opts.retime_rounds), lanes=lanes,
                pool=pool.warm if pool is not None else None, retime_fn=retime_fn, log=log,
                defer=tier == "gpu")      # on a GPU: after the run's verifications, with the host quiet
    stack.callback(r.close)
    return r


def _retime_only(opts: RunOptions, store: RunStore, run_dir: Path, problems: list[P.Problem],
                 planned: list[PL.Planned], tier: str, model: str, retime_fn: Any, log: Any) -> None:
    """Every trial is finished: re-time the groups that have no stored re-timing yet."""
    from mkb_eval.agent.retiming import queue_ready

    gpus = opts.gpus if opts.gpus is not None else (_gpu_count() if tier == "gpu" else 0)
    with contextlib.ExitStack() as stack:
        pool = None
        if tier == "gpu":
            pool = VerificationPool(tier, 1, gpus, verify_fn=lambda *a, **k: None)   # its lanes only
            stack.callback(pool.close)
        r = _retimer(opts, run_dir, problems, tier, model, pool, retime_fn, log, stack)
        n = queue_ready(r, store, [p.key for p in planned], None, log)
        if n:
            log(f"every trial is finished; re-timing {n} group(s) left from an earlier invocation")
        r.wait()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
