"""Many trials advancing together: batched generation, a verification pool, records as trials end.

Each step, every trial that waits for the model is put into one ``backend.generate`` call (so
vLLM batches their decoding) while submissions are verified in a pool of threads, each running
the verifier's own subprocesses. On the GPU tier the verifier's timing lanes let compiles and
correctness draws overlap while only one timed evaluation runs per GPU at a time.
A skill trial starts as soon as its own source solo has finished.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.agent import prompts
from mkb_eval.agent.arms import DIRECTION, TrialKey
from mkb_eval.agent.backends import Backend, BackendError, Sampling
from mkb_eval.agent.loop import DONE, GENERATE, Attempt, Budget
from mkb_eval.agent.plan import REUSE, Planned, Stamps, skill_sha256
from mkb_eval.agent.progress import ProgressView
from mkb_eval.agent.store import RunStore
from mkb_eval.attempt_record import AttemptRecord

Verify = Callable[..., Any]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _fail_batch(batch: list[tuple[TrialRun, list[Any], Sampling]], msg: str) -> None:
    """Every trial of a generation batch gets the same infrastructure error."""
    for run, _, _ in batch:
        assert run.attempt is not None
        run.attempt.on_error(msg)


class VerificationPool:
    """Verifies submissions in threads.

    CPU tier: each verification is its own set of subprocesses, ``workers`` at a time. GPU tier:
    each submission goes to the GPU with the fewest in flight when it starts, each GPU with one timing lane of the
    verifier (imports, compiles and correctness draws overlap; a timed phase has its GPU alone).
    ``warm`` keeps workers started ahead of need, so an attempt's next evaluation skips the
    interpreter and toolchain start-up.
    """

    def __init__(self, tier: str, workers: int, gpus: int = 0, verify_fn: Verify | None = None,
                 limits: Any = None, warm: bool = False, verify_kwargs: dict[str, Any] | None = None,
                 dedupe: bool = False) -> None:
        real = verify_fn is None
        self._kwargs = dict(verify_kwargs or {})
        self._dedupe = dedupe
        self._memo: dict[tuple[str, str, str, str], Future[dict[str, Any]]] = {}
        self._memo_lock = threading.Lock()
        self.reused = 0
        if verify_fn is None:
            from mkb_eval.harness.verify import verify as default_verify

            verify_fn = default_verify
        if tier == "gpu" and gpus < 1:
            raise ValueError("the GPU tier needs at least one GPU (torch sees none); use --device cpu")
        self.tier = tier
        self._verify = verify_fn
        self._limits = limits
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="mkb-verify")
        self._lanes: Any = None
        if tier == "gpu":
            from mkb_eval.harness.lanes import GpuLanes

            self._lanes = GpuLanes(gpus, reference_timers=real and workers > 1)
        self._warm = None
        if warm:            # each verification's worker started ahead of need (see harness.pool)
            from mkb_eval.harness.pool import WarmPool
            from mkb_eval.harness.verify import Limits

            self._warm = WarmPool.for_lanes(tier, len(self._lanes) if self._lanes is not None else 1, workers,
                                            limits or Limits())

    def _run(self, problem: P.Problem, dsl: str, kernel: Path) -> dict[str, Any]:
        kw: dict[str, Any] = {"limits": self._limits} if self._limits is not None else {}
        kw.update(self._kwargs)
        if self._warm is not None:
            kw["pool"] = self._warm
        if self._lanes is None:
            return self._verify(problem, dsl, kernel, tier="cpu", **kw).to_dict()
        with self._lanes.least_busy() as lane:
            return self._verify(problem, dsl, kernel, tier="gpu", gpu=lane.index, lane=lane, **kw).to_dict()

    def submit(self, problem: P.Problem, dsl: str, kernel: Path) -> Future[dict[str, Any]]:
        """The kernel's verification record. With ``dedupe`` a kernel already verified (or being verified) in
        this run for the same problem, DSL and tier is not verified again: its record is handed back,
        flagged ``verification_reused`` (an A/A run's arms submit the same kernel; the paired verdict
        rests on the re-timing, which times each arm's kernel on its own)."""
        if not self._dedupe:
            return self._pool.submit(self._run, problem, dsl, kernel)
        try:
            sha = hashlib.sha256(Path(kernel).read_text(errors="replace").encode()).hexdigest()
        except OSError:
            return self._pool.submit(self._run, problem, dsl, kernel)
        key = (problem.hash, dsl, sha, self.tier)
        with self._memo_lock:
            first = self._memo.get(key)
            if first is None:
                self._memo[key] = fut = self._pool.submit(self._run, problem, dsl, kernel)
                return fut
            self.reused += 1
        copy: Future[dict[str, Any]] = Future()

        def hand_on(f: Future[dict[str, Any]]) -> None:
            err = f.exception()
            if err is not None:
                copy.set_exception(err)
                return
            rec = json.loads(json.dumps(f.result(), default=str))
            rec["flags"] = [*rec.get("flags", []), "verification_reused"]
            copy.set_result(rec)

        first.add_done_callback(hand_on)
        return copy

    @property
    def lanes(self) -> Any:
        """The GPU lanes (None on the CPU tier)."""
        return self._lanes

    @property
    def warm(self) -> Any:
        """The warm pool (None without warm workers)."""
        return self._warm

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._warm is not None:
            self._warm.close()
        if self._lanes is not None:
            self._lanes.close()


@dataclass
class TrialRun:
    """A trial being run in this invocation."""

    key: TrialKey
    problem: P.Problem
    attempt: Attempt | None = None
    task: prompts.RenderedPrompt | None = None
    first_sha256: str | None = None
    skill_sha256: str | None = None
    future: Future[dict[str, Any]] | None = None
    prompt_tokens: int | None = None


@dataclass
class RunSummary:
    finished: list[dict[str, Any]] = field(default_factory=list)
    skipped_no_record: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.finished:
            key = "error" if r.get("error") else r["status"]
            out[key] = out.get(key, 0) + 1
        return out


class Runner:
    """Runs the planned trials of one invocation to completion."""

    def __init__(self, store: RunStore, backend: Backend, problems: dict[int, P.Problem], planned: list[Planned],
                 stamps: dict[int, Stamps], *, budget: Budget, sampling: Sampling, tier: str, pool: VerificationPool,
                 progress: ProgressView | None = None, max_batch: int = 64, retimer: Any = None) -> None:
        self.store, self.backend, self.problems = store, backend, problems
        self.stamps, self.budget, self.sampling, self.tier, self.pool = stamps, budget, sampling, tier, pool
        self.progress = progress or ProgressView(enabled=False)
        self.max_batch = max_batch
        self.todo = [p.key for p in planned if p.status != REUSE]
        self.reused = {p.key for p in planned if p.status == REUSE}
        self.keys = [p.key for p in planned]
        self.retimer = retimer
        self.finished: dict[TrialKey, dict[str, Any]] = {}
        self.summary = RunSummary()
        self.settings = prompts.TaskSettings(
            n_submissions=budget.submissions, max_tokens_per_turn=budget.max_tokens_per_turn,
            max_total_tokens=budget.max_total_tokens, wall_minutes=budget.wall_s / 60, tier=tier)

    # -- starting trials ---------------------------------------------------------------------------
    def _source_state(self, key: TrialKey) -> tuple[str, dict[str, Any] | None]:
        """'ready' / 'waiting' / 'failed' for the source of a skill trial, with its record."""
        src = key.source
        assert src is not None
        if src in self.finished:
            rec = self.finished[src]
            return ("failed" if rec.get("error") else "ready"), rec
        if src in self.reused:
            return "ready", self.store.records().get(src.id)
        if src in self.todo:
            return "waiting", None
        return "failed", None

    def _start(self, key: TrialKey) -> TrialRun | None:
        problem = self.problems[key.problem_id]
        run = TrialRun(key, problem)
        task = prompts.render_task(problem, key.dsl, self.settings)
        run.task = task
        first = task
        if key.is_skill:
            assert key.source is not None
            body = self.store.final_skill(key.source.id)
            if body is None or not body.strip():
                self._write_record(run, None, skipped=True, note="the source solo wrote no SKILL.md")
                return None
            first = prompts.render_skill_task(task, body)
            run.skill_sha256 = skill_sha256(body)
            self.store.write_attachment(key.id, prompts.skill_attachment(body))
        run.first_sha256 = first.sha256
        art = self.store.begin_trial(key.id)
        run.attempt = Attempt(key.id, first.text, self.budget, self.sampling, tier=self.tier, artifacts=art)
        self.progress.start(key.id, key.arm, self.budget.submissions)
        return run

    # -- records ---------------------------------------------------------------------------------
    def _write_record(self, run: TrialRun, att: Attempt | None, *, skipped: bool = False, note: str = "") -> None:
        key, problem = run.key, run.problem
        final = att.final if att else None
        best = att.best if att else None
        if skipped:
            status, message = "skipped", note
        elif att is not None and att.error:
            status, message = (final.status if final else "crashed"), att.error
        elif final is not None:
            status, message = final.status, final.message
        else:
            status, message = "compile_error", f"no usable kernel.py was submitted (attempt ended: {att.stop_reason if att else '?'})"
        fields: dict[str, Any] = {
            "trial": key.id, "problem_id": key.problem_id,
            "problem": problem.name, "family": problem.family, "arm": key.arm, "dsl": key.dsl,
            "replicate": key.replicate, "status": status,
            "speedup": final.speedup if final and status == "ok" else None,
            "kernel_ms": final.kernel_ms if final else None, "eager_ms": final.eager_ms if final else None,
            "skipped": skipped, "error": att.error if att else None, "skill_sha256": run.skill_sha256,
            "model": self.backend.name,
            # extras beyond the metrics' format
            "message": (message or "")[:2000], "tier": self.tier, "created_at": _now(),
            "direction": DIRECTION.get(key.arm), "source_trial": key.source.id if key.source else None,
            **self.stamps[key.problem_id].to_dict(),
            "prompt_version": prompts.set_version(), "prompts": prompts.prompt_set(),
            "task_prompt_sha256": run.task.sha256 if run.task else None, "first_message_sha256": run.first_sha256,
            "backend": self.backend.identity(), "sampling": self.sampling.to_dict(), "budget": self.budget.to_dict(),
            "stop_reason": att.stop_reason if att else ("skipped" if skipped else ""),
            "usage": att.usage() if att else None,
            "final": final.summary() if final else None, "best": best.summary() if best else None,
            "submissions": [s.summary() for s in att.submissions] if att else [],
            "skill_md_sha256": (hashlib.sha256(att.skill.encode()).hexdigest() if att and att.skill else None),
            "skill_md_written": bool(att and att.skill and att.skill.strip()),
            "final_kernel_sha256": final.kernel_sha256 if final else None,
        }
        rec = AttemptRecord(**fields).to_json()        # a field missing or of the wrong type fails here
        if att is not None and att.art is not None:
            att.art.final(final.kernel if final else None, rec)
        self.store.append_record(rec)
        self.finished[key] = rec
        self.summary.finished.append(rec)
        self.progress.finish(key.id, rec)
        self._retime_ready({(key.problem_id, key.replicate)})

    def _retime_ready(self, groups: set[tuple[int, int]] | None = None) -> None:
        """Queue the re-timing of every group (problem, replicate) whose selected trials are all finished."""
        if self.retimer is None:
            return
        from mkb_eval.agent.retiming import queue_ready

        queue_ready(self.retimer, self.store, self.keys, groups, self.progress.note)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        waiting = [k for k in self.todo]
        active: dict[TrialKey, TrialRun] = {}
        self._retime_ready()            # groups finished by an earlier invocation (resume)
        with self.progress:
            while waiting or active:
                for key in list(waiting):
                    if key.is_skill:
                        state, _ = self._source_state(key)
                        if state == "waiting":
                            continue
                        if state == "failed":
                            waiting.remove(key)
                            self.summary.skipped_no_record.append(key.id)
                            self.progress.note(f"{key.id}: not run, its source {key.source.id if key.source else '?'} "
                                               "failed with an infrastructure error (no record; it runs next time)")
                            continue
                    waiting.remove(key)
                    run = self._start(key)
                    if run is not None:
                        active[key] = run
                self._generate_step(active)
                self._collect(active, block=not any(r.attempt and r.attempt.state == GENERATE for r in active.values()))
                for key in [k for k, r in active.items() if r.attempt and r.attempt.state == DONE]:
                    run = active.pop(key)
                    self._write_record(run, run.attempt)
            if self.retimer is not None:
                self.progress.note("waiting for the paired re-timing of the finished units ...")
                self.retimer.wait()
        return self.summary

    def _generate_step(self, active: dict[TrialKey, TrialRun]) -> None:
        batch: list[tuple[TrialRun, list[Any], Sampling]] = []
        for run in active.values():
            att = run.attempt
            if att is None or att.state != GENERATE:
                continue
            n_prompt = self.backend.count_prompt_tokens(att.messages)
            req = att.request(n_prompt, self.backend.max_context)
            if req is not None:
                batch.append((run, req[0], req[1]))
            if len(batch) >= self.max_batch:
                break
        if not batch:
            return
        for run, _, _ in batch:
            self.progress.update(run.key.id, state="generating")
        try:
            gens = self.backend.generate([b[1] for b in batch], [b[2] for b in batch])
        except BackendError as e:
            _fail_batch(batch, f"backend: {e}")
            return
        except Exception as e:  # noqa: BLE001 - an engine crash is an infrastructure error of these trials, not a run abort
            msg = f"backend: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            self.progress.note(traceback.format_exc(limit=3))
            _fail_batch(batch, msg)
            return
        if len(gens) != len(batch):        # a backend's bug, reported as these trials' infrastructure error
            _fail_batch(batch, f"backend: {len(gens)} generations for {len(batch)} requests")
            return
        for (run, _, _), gen in zip(batch, gens, strict=True):
            att = run.attempt
            assert att is not None
            if gen.error:                  # this request failed: this trial's infrastructure error, the others go on
                att.on_error(f"backend: {gen.error}")
                self.progress.update(run.key.id, state=att.state)
                continue
            sub = att.on_answer(gen)
            self.progress.update(run.key.id, tokens=att.completion_tokens, corrections=att.corrections,
                                 state="verifying" if sub else att.state)
            if sub is not None:
                assert att.art is not None
                run.future = self.pool.submit(run.problem, run.key.dsl, att.art.kernel_path(sub.k))

    def _collect(self, active: dict[TrialKey, TrialRun], block: bool) -> None:
        futs = {r.future: r for r in active.values() if r.future is not None}
        if not futs:
            return
        done, _ = wait(list(futs), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for f in done:
            run = futs[f]
            run.future = None
            att = run.attempt
            assert att is not None
            try:
                rec = f.result()
            except Exception as e:  # noqa: BLE001 - a verifier crash is this trial's infrastructure error, not a run abort
                att.on_error(f"verifier: {type(e).__name__}: {e}")
                continue
            att.on_verified(rec)
            self.progress.update(run.key.id, submissions=len(att.submissions), last=rec["status"], state=att.state)

