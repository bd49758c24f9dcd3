"""The timed phase, parent side: event draws, attested windows, the eager baseline beside them, and
the verdict on the kernel's time (:mod:`mkb_eval.harness.attest` holds the protocol and the rules).

Order inside the GPU's exclusive lane hold: the timing gate brings the event draws' seeds (the job
sent at start has none), the worker reports its event-timed draws, the parent runs one attested
window (re-check indices chosen only after it), the trusted side times the eager reference (event
draws, then its own window on the same seeds: the make and commitment costs the kernel's window is
measured against), and the decision may ask for one re-time under the parent's clock.
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval.harness import attest, cores
from mkb_eval.harness.attest import TimingVerdict, WindowCalibration, WindowStamps
from mkb_eval.harness.protocol import (CALLED, PREPPED, PROTOCOL_FLAG, PROTOCOL_STATUS, READY, SAVED, EndOp, EventsReport,
                                       Op, PrepOp, ProtocolError, SaveOp, WindowOp, decode_digests, reply_text)
from mkb_eval.records import Timing


class WindowFailed(Exception):
    """A window did not complete: ``status`` None means the worker ended (its final message says why)."""

    def __init__(self, status: str | None, message: str, how: str = "exited", flags: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.how, self.flags = status, message, how, flags


def seeds(n: int) -> list[int]:
    return [secrets.randbits(63) for _ in range(n)]


def _send(w: Any, op: Op) -> int:
    """Send one operation to the worker; its send time (a worker that is gone ends the window)."""
    try:
        return w.gate.send_op(op)
    except OSError:
        raise WindowFailed(None, "the worker ended during the timed phase") from None


def _reply(w: Any, timeout: float) -> tuple[bytes, int]:
    """The worker's next packet on its gate, watching its caps and its exit meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WindowFailed("timeout", f"no reply from the worker's timed window in {timeout:.0f} s", "timeout")
        try:
            data, stamp = w.gate.recv(min(0.25, left))
        except TimeoutError:
            if w.proc.poll() is not None:
                raise WindowFailed(None, "the worker ended during a timed window") from None
            w._watch()
            continue
        if not data:
            raise WindowFailed(None, "the worker ended during a timed window")
        return data, stamp


def run_window(w: Any, calls: int, tag: str, timeout: float, rechecks: int = attest.WINDOW_RECHECKS) -> WindowStamps:
    """One attested window of worker ``w`` (see :mod:`attest`): prep, seeds, ``R``, digests, then the
    ``rechecks`` outputs chosen now, at random, saved by the worker as ``<out>/<tag>_<i>.pt``."""
    _send(w, PrepOp(calls))
    data, _ = _reply(w, timeout)
    if data != PREPPED:
        raise WindowFailed("runtime_error", "timed window: " + reply_text(data))
    win_seeds, key = seeds(calls), secrets.randbits(63)
    sent = _send(w, WindowOp(win_seeds, key, tag))
    data, ready = _reply(w, timeout)
    if data != READY:
        raise WindowFailed("runtime_error", "timed window: " + reply_text(data))
    data, called = _reply(w, timeout)
    if data != CALLED:
        raise WindowFailed("runtime_error", "timed window: " + reply_text(data))
    data, done = _reply(w, timeout)
    try:
        digests = decode_digests(data, calls)
    except ProtocolError as e:
        raise WindowFailed(PROTOCOL_STATUS, f"timed window: the worker broke the protocol: {e}",
                           flags=(PROTOCOL_FLAG,)) from None
    which = sorted(secrets.SystemRandom().sample(range(calls), min(rechecks, calls)))
    _send(w, SaveOp(which, tag))
    data, _ = _reply(w, timeout)
    if data != SAVED:
        raise WindowFailed("runtime_error", "saving the timed window's outputs: " + reply_text(data))
    return WindowStamps(calls=calls, sent_ns=sent, ready_ns=ready, done_ns=done, called_ns=called, digests=digests,
                        saved=which, seeds=win_seeds, key=key, tag=tag)


def finish(w: Any, timeout: float = 10.0) -> None:
    """Tell the worker the timed phase is over and give it a moment for its final message."""
    try:
        _send(w, EndOp())
    except WindowFailed:
        return
    w.wait_for(("final",), timeout)


@dataclass
class Reference:
    """How the trusted side times the reference for one evaluation: the GPU's timer process where there
    is one (a sweep), else the judge in this process, pinned to the GPU's timing core."""

    prob: Any
    size: str
    judge: Any
    timer: Any = None
    cpu: int | None = None
    reuse: bool = False        # one calibration for every window (a re-timing: same shapes, same K)
    share: bool = False        # a first window may take the calibration another evaluation of the problem made
    shared: bool = field(default=False, init=False)      # whether the last window's calibration was shared
    _cal: WindowCalibration | None = field(default=None, init=False, repr=False)

    def event_ms(self, warmup: list[int], timing: list[int], compiled: bool = False) -> float:
        if self.timer is not None:
            return self.timer.time(self.prob.path, self.size, warmup, timing, compiled, self.cpu)[0]
        with cores.pinned(self.cpu):
            return self.judge.time_reference(warmup, timing, compiled=compiled)[0].median_ms

    def window(self, stamps: WindowStamps) -> WindowCalibration:
        """The trusted calibration of a window like ``stamps`` (its seeds, its key). With ``reuse`` the
        first one serves every later window of as many calls: the make and commitment costs depend on
        the shapes, not on the seeds, and the reference is not timed again for nothing. With ``share`` (a
        sweep that reuses the eager time) a first window takes the calibration of an earlier evaluation of
        the same problem, size, GPU and K in this process: the trusted side's numbers, the same for every
        kernel of the problem (the other DSL's evaluation no longer re-runs the reference's window in its
        timing lane); a re-time always calibrates afresh."""
        cal = self._cal
        if self.reuse and cal is not None and _fits(cal, stamps):
            return cal
        key = (self.prob.hash, self.size, self.judge.device, stamps.calls)
        if self.share and cal is None and (kept := _SHARED.get(key)) is not None and _fits(kept, stamps):
            self._cal, self.shared = kept, True
            return kept
        if self.timer is not None:
            cal = self.timer.window(self.prob.path, self.size, stamps.seeds, stamps.key, self.cpu)
        else:
            with cores.pinned(self.cpu):
                cal = self.judge.time_window(stamps.seeds, stamps.key)
        self._cal, self.shared = cal, False
        if self.share:
            with _SHARED_LOCK:        # (a sweep's evaluations are threads of one process)
                _SHARED.pop(key, None)
                _SHARED[key] = cal    # the newest (a re-time's fresh one replaces the first window's)
                while len(_SHARED) > SHARED_CALIBRATIONS:
                    _SHARED.pop(next(iter(_SHARED)))
        return cal


SHARED_CALIBRATIONS = 256     # problems x sizes x GPUs x K kept: a few numbers each
_SHARED: dict[tuple[str, str, str, int], WindowCalibration] = {}
_SHARED_LOCK = threading.Lock()


def _fits(cal: WindowCalibration, stamps: WindowStamps) -> bool:
    """A calibration of as many calls that can serve ``stamps`` (a commitment as long as the whole
    window would be a bad calibration: then the window is calibrated afresh)."""
    return cal.calls == stamps.calls and cal.commit_ms * cal.calls < stamps.window_ms


@dataclass
class TimedOutcome:
    timing: Timing
    verdict: TimingVerdict
    windows: list[WindowStamps] = field(default_factory=list)
    calibrations: list[WindowCalibration] = field(default_factory=list)


@dataclass
class AttestedWindows:
    """A kernel's attested windows (the first, then a re-time when asked), their calibrations and what
    the verdict was decided on: the attested per-call times and the pre-window excesses."""

    windows: list[WindowStamps] = field(default_factory=list)
    calibrations: list[WindowCalibration] = field(default_factory=list)
    attested: list[float] = field(default_factory=list)
    excess: list[float] = field(default_factory=list)

    def add(self, stamps: WindowStamps, cal: WindowCalibration) -> None:
        self.windows.append(stamps)
        self.calibrations.append(cal)
        self.attested.append(attest.attested_ms(stamps, cal))
        self.excess.append(attest.precompute_excess_ms(stamps, cal))


def attest_kernel(w: Any, ref: Reference, calls: int, tags: tuple[str, str], timeout: float, event_ms: float,
                  sol_ms: float | None, device_ms: float | None, *, rechecks: int = attest.WINDOW_RECHECKS,
                  calibrate_first: Callable[[WindowStamps], WindowCalibration] | None = None,
                  stages: dict[str, float] | None = None) -> tuple[AttestedWindows, TimingVerdict]:
    """One attested window of worker ``w``, its trusted calibration and the verdict, and when the verdict
    asks, one re-time (a second window, tagged ``tags[1]``) before it decides again. ``calibrate_first``
    replaces ``ref.window`` for the first window (``verify`` times the eager reference there too);
    ``stages`` gets the seconds of the first window and of the re-time."""
    wins = AttestedWindows()
    t0 = time.perf_counter()
    first = run_window(w, calls, tags[0], timeout, rechecks)
    if stages is not None:
        stages["attested_window"] = round(time.perf_counter() - t0, 3)
    wins.add(first, (calibrate_first or ref.window)(first))
    verdict = attest.decide(event_ms, wins.attested, wins.excess, sol_ms, device_ms)
    if verdict.status == "retime":
        t0 = time.perf_counter()
        second = run_window(w, calls, tags[1], timeout, rechecks)
        wins.add(second, ref.window(second))
        verdict = attest.decide(event_ms, wins.attested, wins.excess, sol_ms, device_ms)
        if stages is not None:
            stages["retime"] = round(time.perf_counter() - t0, 3)
    return wins, verdict


def attested_phase(w: Any, ref: Reference, events: EventsReport, calls: int, timeout: float,
                   eager: Callable[[Callable[[], float]], float], stages: dict[str, float],
                   sol_ms: float | None, n_warmup: int, n_timed: int, warmup: list[int],
                   timing: list[int]) -> TimedOutcome:
    """Window, eager baseline and its window, the decision and at most one re-time. ``eager(measure)``
    gives the eager event ms (a sweep may take a problem's from its cache)."""
    times = [float(x) for x in events.times_ms]
    event_ms = float(statistics.median(times))
    device_ms = events.device_ms
    eager_event: list[float] = []
    shared_first: list[bool] = []

    def eager_and_its_window(first: WindowStamps) -> WindowCalibration:
        t0 = time.perf_counter()
        eager_event.append(eager(lambda: ref.event_ms(warmup, timing)))
        cal = ref.window(first)
        shared_first.append(ref.shared)
        stages["eager_baseline"] = round(time.perf_counter() - t0, 3)
        return cal

    wins, verdict = attest_kernel(w, ref, calls, ("win0", "win1"), timeout, event_ms, sol_ms, device_ms,
                                  calibrate_first=eager_and_its_window, stages=stages)
    eager_att = wins.calibrations[0].attested_ms      # this evaluation's or, shared, the problem's first
    if shared_first and shared_first[0]:
        verdict.flags.append("window_calibration_shared")
    eager_ms = max(eager_event[0], eager_att)
    t = Timing(kernel_ms=verdict.kernel_ms, worker_event_ms=event_ms, attested_ms=verdict.attested_ms,
               attested_windows_ms=[round(x, 5) for x in wins.attested], window_calls=calls,
               prewindow_excess_ms=[round(e, 4) for e in wins.excess],
               window_span_ms=[round(w.window_ms, 4) for w in wins.windows],
               window_commit_ms=[round(c.commit_ms, 5) for c in wins.calibrations],
               kernel_device_ms=device_ms, host_call_ms=events.host_call_ms, cpu_probe_ms=events.cpu_probe_ms,
               kernel_cv=float(statistics.pstdev(times) / statistics.mean(times)) if times else None,
               eager_ms=eager_ms, eager_event_ms=eager_event[0], eager_attested_ms=eager_att,
               n_warmup=n_warmup, n_timed=n_timed, times_ms=[round(x, 5) for x in times])
    t.speedup = eager_ms / t.kernel_ms if t.kernel_ms else None
    if sol_ms:
        t.sol_ms = sol_ms
        t.sol_fraction = sol_ms / t.kernel_ms if t.kernel_ms else None
    return TimedOutcome(t, verdict, wins.windows, wins.calibrations)


def judge_windows(judge: Any, windows: list[WindowStamps], out: Path,
                  between: Callable[[], float] = lambda: 0.0) -> str | None:
    """The re-checked window outputs against the reference and their commitments; the first failure's
    message, or None."""
    for win in windows:
        for i in win.saved:
            between()
            bad = judge.check(win.seeds[i], out / f"{win.tag}_{i}.pt", commitment=win.digests[i], key=win.key)
            if bad:
                return (f"timed call {i + 1} of {win.calls} in attested window {win.tag[-1]} (re-checked at random, "
                        f"chosen after the window): {bad}")
    return None
