"""``mkb run`` as a library call: validate, lock the run folder, plan, start the model, run, record.

The order matters for bad input: problems, arms and the model spec are checked and the run
folder is planned (read-only apart from its lock) before the model is started, and nothing is
written to the folder until the model is up, so a typo or an unreachable server leaves it as it was.
"""

from __future__ import annotations

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
    warm: bool = False
    gpus: int | None = None
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


def run_trials(opts: RunOptions, backend: Backend | None = None, verify_fn: Any = None,
               log: Any = print) -> tuple[RunSummary | None, list[PL.Planned]]:
    """Plan and run; returns (summary, plan). ``backend`` and ``verify_fn`` may be injected (tests)."""
    if opts.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, not {opts.device!r}")
    tier = "gpu" if opts.device == "cuda" else "cpu"
    problems = select_problems(opts.problems, opts.root)
    arms = parse_arms(opts.arms)
    spec: ModelSpec = parse_model_spec(opts.model) if backend is None else ModelSpec("injected", backend.name)
    run_dir = Path(opts.run_dir or Path("runs") / model_slug(spec.name))
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
        if opts.dry_run or all(p.status == PL.REUSE for p in planned):
            return None, planned
        owned = backend is None
        if backend is None:
            backend = open_backend(spec, engine=opts.engine, device=opts.device, seed=opts.sampling.seed or 0,
                                   max_model_len=opts.max_model_len, api_key=opts.api_key, log=log)
        store.pin_model(spec.name, backend.identity())
        store.log_invocation({
            "model": spec.name, "backend": backend.identity(), "problems": [p.id for p in problems], "arms": arms,
            "replicates": opts.replicates, "device": opts.device, "tier": tier, "budget": opts.budget.to_dict(),
            "sampling": opts.sampling.to_dict(), "rerun_stale": opts.rerun_stale, "plan": c, **git_commit(),
        })
        workers = opts.workers or max(1, min(4, os.cpu_count() or 1))
        gpus = opts.gpus if opts.gpus is not None else (_gpu_count() if tier == "gpu" else 0)
        pool = VerificationPool(tier, workers, gpus, verify_fn=verify_fn, warm=opts.warm)
        try:
            runner = Runner(store, backend, {p.id: p for p in problems}, planned, stamps, budget=opts.budget,
                            sampling=opts.sampling, tier=tier, pool=pool, progress=ProgressView(opts.progress))
            summary = runner.run()
        finally:
            pool.close()
            if owned:
                backend.close()
        return summary, planned


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
