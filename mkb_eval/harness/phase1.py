"""Phase 1 on the parent's side: gate 1 and the worker's lane requests while it compiles and runs the
correctness draws, then the judge's verdict on those draws and the DSL-dependence draw. Shared by a
verification and by a re-timing's sanity check."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkb_eval.harness.job import Job
from mkb_eval.harness.jobs import CORRECTNESS_DRAWS, REUSE_DRAWS
from mkb_eval.harness.lane_hold import Held
from mkb_eval.harness.protocol import Lane, Message, Phase1Report, ProtocolError
from mkb_eval.harness.spawn import Worker, protocol_failure
from mkb_eval.records import VerificationRecord


def run_phase1(w: Worker, held: Held, budget: float, rec: VerificationRecord) -> tuple[Message | None, str]:
    """Open gate 1 and wait for the worker's phase-1 report. Between a compile's start and end the lane
    is given back (compiling is CPU work; timing on this GPU need not wait for it); the worker resumes
    only once it is held again. Between draws the worker asks to step aside for a waiting timed phase.
    Time spent waiting for the lane does not count against ``budget``."""
    w.open_gate(True)
    t0, seen, held.waited = time.perf_counter(), 0, 0.0
    while True:
        left = budget + held.waited + held.stepped_aside - (time.perf_counter() - t0)
        if left <= 0:
            msg, how = None, "timeout"
            break
        def handled(m: Message, seen: int = seen) -> bool:       # a lane request already answered
            return isinstance(m, Lane) and m.n <= seen

        msg, how = w.wait_for(("phase1", "final", "lane"), left, unless=handled)
        if not isinstance(msg, Lane):
            break
        seen = msg.n
        if msg.want == "release":
            held.release()
        elif msg.want == "step_aside":       # between draws, the worker's GPU work done
            held.step_aside()
            w.open_gate(True)
        else:
            held.acquire()
            w.open_gate(True)
    rec.stages_s["worker_phase1"] = round(time.perf_counter() - t0, 3)
    if seen:
        rec.stages_s["compile_lane_wait"] = round(held.waited, 3)
    return msg, how


def _not_as_asked(job: Job, msg: Phase1Report) -> ProtocolError | None:
    """A phase-1 report of other draws than the job's (each seed once, in order), or of a DSL-dependence
    draw the job did not ask for: judged as it stands it would skip a check or fail the parent."""
    got, want = [d.draw for d in msg.draws], list(range(len(job.correctness_seeds)))
    if got != want:
        return ProtocolError("phase1.draws", f"draws {got[:8]} for a job of {len(want)} draws")
    if (msg.nodsl == "skipped") != (job.nodsl_seed is None):
        return ProtocolError("phase1.nodsl", f"{msg.nodsl!r} for a job {'without' if job.nodsl_seed is None else 'with'}"
                                             " a DSL-dependence draw")
    return None


def judge_phase1(rec: VerificationRecord, judge: Any, job: Job, msg: Phase1Report, out: Path,
                  between: Callable[[], float] = lambda: 0.0) -> bool:
    """Correctness of the 5 draws and the DSL-dependence draw; False (status set) when they fail.
    ``between`` runs between checks (the lane's step aside; its seconds are not judging time)."""
    err = _not_as_asked(job, msg)
    if err is not None:
        protocol_failure(rec, "correctness", err)
        return False
    rec.stages_s.update(import_s=round(msg.import_s, 3), first_call_s=round(msg.first_call_s or 0.0, 3),
                        correctness_draws_s=round(msg.correctness_s, 3))
    t0 = time.perf_counter()
    for d in msg.draws:
        t0 += between()
        bad = judge.check(job.correctness_seeds[d.draw], out / f"corr_{d.draw}.pt", d.input_digests)
        if bad:
            reused = " (inputs refilled in the previous draw's buffers)" if d.draw in REUSE_DRAWS else ""
            rec.status, rec.stage = "incorrect", "correctness"
            rec.message = f"correctness draw {d.draw + 1} of {CORRECTNESS_DRAWS}{reused}: {bad}"
            c = rec.correctness
            c.draws_passed, c.max_error, c.allowance = d.draw, bad.max_error, bad.allowance
            return False
    addrs = [tuple(d.addresses) for d in msg.draws]
    c = rec.correctness
    c.draws_passed, c.launches = CORRECTNESS_DRAWS, [d.launches for d in msg.draws]
    c.distinct_input_addresses = len(set(addrs))
    t0 += between()
    if msg.nodsl == "returned" and judge.check(job.nodsl_seed, out / "nodsl.pt") is None:
        rec.status, rec.stage = "no_dsl_kernel", "dsl_dependence"
        rec.message = ("the output is still correct with every DSL launch suppressed and free memory poisoned: "
                       "the DSL kernel does not compute the result")
        return False
    c.dsl_dependence = f"fails without the DSL ({msg.nodsl})"
    rec.stages_s["judge_correctness"] = round(time.perf_counter() - t0, 3)
    return True
