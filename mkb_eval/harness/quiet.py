"""A host-wide quiet hold for the paired re-timing's timed rounds.

The A/A run on the H200 showed why: while other re-timings started and compiled their workers beside
a group's timed rounds, a kernel's end-to-end time varied by 2-13% over its rounds (its device time by
under 1%), wider than the +-3% band a paired verdict needs. The lane's exclusive hold keeps other
*timing* off the GPU; this keeps other *work* of the process off the host: starting workers,
compiling, sanity draws and judging run as ``busy`` sections, which share the host with each other; a
``quiet`` section waits until no busy section runs and, while it waits or runs, no new busy section
starts (quiet sections are preferred, so a stream of busy work cannot starve them). Quiet sections
run one at a time: the host is quiet for one group's rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class QuietHost:
    """Busy sections share the host; a quiet section has it to itself (see the module's docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._quiet = False
        self._waiting_quiet = 0
        self.quiet_wait_s = 0.0          # total time quiet sections waited for busy ones to end
        self.busy_wait_s = 0.0           # total time busy sections waited for quiet ones

    @property
    def busy_now(self) -> int:
        with self._cond:
            return self._busy

    @property
    def quiet_pending(self) -> int:
        """Quiet sections waiting to start."""
        with self._cond:
            return self._waiting_quiet

    @contextmanager
    def busy(self) -> Iterator[float]:
        """Work that may share the host; yields how long it waited for quiet sections to end."""
        t0 = time.perf_counter()
        with self._cond:
            while self._quiet or self._waiting_quiet:
                self._cond.wait()
            self._busy += 1
            waited = time.perf_counter() - t0
            self.busy_wait_s += waited
        try:
            yield waited
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    @contextmanager
    def quiet(self) -> Iterator[float]:
        """Work that needs the host to itself; yields how long it waited for busy sections to end."""
        t0 = time.perf_counter()
        with self._cond:
            self._waiting_quiet += 1
            try:
                while self._quiet or self._busy:
                    self._cond.wait()
            finally:
                self._waiting_quiet -= 1
            self._quiet = True
            waited = time.perf_counter() - t0
            self.quiet_wait_s += waited
        try:
            yield waited
        finally:
            with self._cond:
                self._quiet = False
                self._cond.notify_all()


class _Loud:
    """The stand-in when no quiet hold is asked for: every section enters at once."""

    @contextmanager
    def busy(self) -> Iterator[float]:
        yield 0.0

    @contextmanager
    def quiet(self) -> Iterator[float]:
        yield 0.0


LOUD = _Loud()
