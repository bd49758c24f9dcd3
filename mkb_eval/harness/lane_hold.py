"""An evaluation's shared hold on its GPU lane (:mod:`mkb_eval.harness.lanes`) while its worker
compiles and runs correctness draws: given back during compiles, offered between draws to a timed
phase that waits. Phase 1 and the judge's re-checks both run under it."""

from __future__ import annotations

import time

from mkb_eval.harness.lanes import GpuLane


class Held:
    """This evaluation's shared hold on its GPU lane, which phase 1 gives back while the worker compiles
    and which steps aside between draws for a waiting timed phase."""

    def __init__(self, lane: GpuLane) -> None:
        self.lane, self.held, self.waited, self.stepped_aside = lane, False, 0.0, 0.0
        self.acquire()

    def step_aside(self) -> float:
        """Let a waiting timed phase have the GPU, then hold it again (nothing of ours may be queued on
        it); the seconds that took."""
        t0 = time.perf_counter()
        if not (self.held and self.lane.yield_shared()):
            return 0.0
        took = time.perf_counter() - t0
        self.stepped_aside += took
        return took

    def acquire(self) -> None:
        if not self.held:
            t0 = time.perf_counter()
            self.lane.acquire_shared()
            self.held, self.waited = True, self.waited + time.perf_counter() - t0

    def release(self) -> None:
        if self.held:
            self.lane.release_shared()
            self.held = False

