"""CPU cores for timed host call paths, and cores for everything else.

A timed call includes its host call path (the event pair brackets the Python call), so the core
that runs it must be quiet. One core per visible GPU, with its SMT siblings, is kept for timing;
worker start-up and imports, compilation, correctness work and the judge's own threads run on
the rest. Nothing is reserved on a host with fewer than 4 cores per GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

_base: set[int] | None = None          # the mask before keep_off_timing_cores narrowed this process


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8"`` → {0, 1, 2, 3, 8} (the kernel's cpu list format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def smt_siblings(cpu: int) -> set[int]:
    """The hardware threads sharing ``cpu``'s core (itself alone where the topology is not exposed)."""
    try:
        return parse_cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def allowed() -> list[int]:
    """The cores this process may use (as it was before being kept off the timing cores)."""
    if _base is not None:
        return sorted(_base)
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def plan(n_gpus: int, cores: list[int] | None = None,
         siblings: Callable[[int], set[int]] | None = None) -> tuple[list[int], list[int]] | None:
    """(the timing core of each GPU, the cores for all other work), or None when too few cores.

    Timing cores come from the top of the list; a timing core's SMT siblings are left out of the
    work cores (a busy sibling slows the core), unless that would leave fewer than 2 per GPU.
    """
    cores = sorted(cores if cores is not None else allowed())
    siblings = siblings or smt_siblings
    n = max(1, n_gpus)
    if len(cores) < 4 * n:
        return None
    timing: list[int] = []
    taken: set[int] = set()
    for c in reversed(cores):
        if len(timing) == n:
            break
        if c not in taken:
            timing.append(c)
            taken |= siblings(c) | {c}
    work = [c for c in cores if c not in taken]
    if len(timing) < n or len(work) < 2 * n:        # siblings would eat the host: reserve the cores alone
        timing = cores[-n:][::-1]
        work = cores[:-n]
    return timing, work


def split(n: int, cores: list[int] | None = None,
          siblings: Callable[[int], set[int]] | None = None) -> list[list[int]] | None:
    """The cores dealt into ``n`` contiguous shares of whole physical cores (SMT siblings stay in one
    share), for one sweep process per GPU; None when there are fewer physical cores than shares."""
    cores = sorted(cores if cores is not None else allowed())
    siblings = siblings or smt_siblings
    groups: list[list[int]] = []
    seen: set[int] = set()
    for c in cores:
        if c not in seen:
            g = sorted((siblings(c) | {c}) & set(cores))
            seen.update(g)
            groups.append(g)
    if n < 1 or len(groups) < n:
        return None
    edges = [round(i * len(groups) / n) for i in range(n + 1)]
    return [sorted(c for g in groups[edges[i]:edges[i + 1]] for c in g) for i in range(n)]


@contextlib.contextmanager
def keep_off_timing_cores(n_gpus: int) -> Iterator[list[int] | None]:
    """Run every thread of this process, and every process it starts, on the work cores.

    Threads that take a timing core for a timed phase pin themselves there explicitly (a thread's
    own mask may name any core); workers inherit the work cores from birth, so their imports and
    compilation never land on a timing core. The previous masks come back on exit.
    """
    global _base  # noqa: PLW0603 - the process's affinity is process-wide state: one owner at a time
    p = plan(n_gpus)
    if p is None or _base is not None or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = set(allowed())
    _base = before
    try:
        _set_all_threads(set(p[1]))
        yield p[1]
    finally:
        _set_all_threads(before)
        _base = None


def _set_all_threads(mask: set[int]) -> None:
    """Linux affinity is per thread: set it on each thread of this process."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:
            pass                                    # a thread that ended meanwhile


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run the calling thread on one core (Linux affinity is per thread), then restore it."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before: set[int] | None = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        before = None
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
