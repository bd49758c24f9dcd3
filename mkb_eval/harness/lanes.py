"""One timing lane per GPU: many evaluations may share a GPU for correctness work, but a timed
phase has the GPU to itself.

A shared holder (correctness draws, judging) and an exclusive holder (timing, baselines) never
overlap on the same GPU; CPU-only work (process start, imports) needs no lane at all. Writers
are preferred, so timing is not starved by a stream of correctness work. A timed phase still
waits for every shared hold in progress to end, so shared holders also step aside at their
natural breaks (between correctness draws or checks) when a timed phase is waiting: the wait is
then one draw, not a whole evaluation's correctness work (on the H200 those waits, a few seconds
before every timed phase, made the lane the bottleneck of a 1-GPU sweep).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from mkb_eval.harness.gpus import physical_gpu

__all__ = ["GpuLane", "GpuLanes", "physical_gpu"]   # physical_gpu: still importable from here


class GpuLane:
    """A readers-writer lock for one GPU, and the GPU's baseline timer process where there is one."""

    def __init__(self, index: int = 0, timer: Any = None) -> None:
        self.index, self.timer = index, timer
        self._cond = threading.Condition(threading.RLock())
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting_exclusive:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            self._cond.notify_all()

    def yield_shared(self) -> bool:
        """Held shared: if a timed phase is waiting, let it (and any queued behind it) run, then hold
        shared again. Returns whether it stepped aside."""
        with self._cond:                # reentrant: the check and the hand-over are one step
            if not self._waiting_exclusive:
                return False
            self.release_shared()
            self.acquire_shared()
            return True

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting_exclusive += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class GpuLanes:
    """One lane per GPU, and where the next evaluation goes: the GPU with the fewest evaluations in
    flight, the least recently chosen among equals. (Dealing jobs k % n lets slow ones pile up on
    one GPU while another idles.) With ``reference_timers`` each GPU gets a process that times the
    PyTorch baselines away from this process's threads (:mod:`mkb_eval.harness.reference_timer`);
    ``close`` ends them."""

    def __init__(self, n: int, reference_timers: bool = False) -> None:
        if reference_timers:
            from mkb_eval.harness.reference_timer import ReferenceTimer
        self.lanes = [GpuLane(i, ReferenceTimer(i) if reference_timers else None) for i in range(max(1, n))]
        self._busy = [0] * len(self.lanes)
        self._last = [0] * len(self.lanes)
        self._turn = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.lanes)

    def close(self) -> None:
        for lane in self.lanes:
            if lane.timer is not None:
                lane.timer.close()

    def __getitem__(self, index: int) -> GpuLane:
        return self.lanes[index]

    @contextlib.contextmanager
    def least_busy(self) -> Iterator[GpuLane]:
        """The chosen GPU's lane (``.index`` is the GPU), counted as busy for the block."""
        with self._lock:
            g = min(range(len(self.lanes)), key=lambda i: (self._busy[i], self._last[i]))
            self._busy[g] += 1
            self._turn += 1
            self._last[g] = self._turn
        try:
            yield self.lanes[g]
        finally:
            with self._lock:
                self._busy[g] -= 1

