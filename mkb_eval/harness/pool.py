"""Warm workers: each evaluation still gets a fresh process, but one started ahead of need.

A worker is spawned with its evaluation folder, sandbox and environment, imports torch and both
DSL toolchains, then blocks reading its job. Taking one hands that process to a single
evaluation (it is never reused) and spawns its replacement, so the process start and imports
(15-18 s and as many CPU seconds on the H200 host, results/h200/2026-11-30_bench7) overlap the
previous evaluation instead of adding to it. With ``fork`` (the default; ``MKB_FORK_SERVER=0``
turns it off) the imports are paid once per tier, GPU and worker user: a fork server (``forkserver.py``)
forks every worker, whatever sandbox caps it asks for (each child enters its own), and exec'd workers
are the fallback where it cannot start. A worker taken while still importing gets its
replacement only once its imports are done: at a sweep's start every worker is taken at once,
and replacements importing beside them made the first evaluations wait 20 s for their workers
(results/h200/2026-11-30_bench6). A worker holds no job, seed or candidate code until it is
taken; an idle one left behind exits when its stdin closes.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from typing import Any


class WarmPool:
    """``per_key`` idle workers for every (tier, GPU, sandbox caps) combination asked for.

    ``limit`` caps the workers ever started (a sweep knows how many evaluations it has), so no
    process is started, and no CPU spent preloading, for an evaluation that will never come.
    """

    def __init__(self, per_key: int = 1, limit: int | None = None, fork: bool | None = None) -> None:
        self.per_key = max(1, per_key)
        self.limit = limit
        self.fork = os.environ.get("MKB_FORK_SERVER", "1") != "0" if fork is None else fork
        self.servers: dict[tuple, Any] = {}
        self._idle: dict[tuple, list[Any]] = {}
        self._lock = threading.Lock()
        self.taken = self.spawned = 0
        self.closed = False
        self.import_timeout_s = 120.0

    @classmethod
    def for_lanes(cls, tier: str, n_lanes: int, in_flight: int, limits: Any, limit: int | None = None) -> WarmPool:
        """A pool already filled for ``n_lanes`` GPUs (one key on the CPU tier), enough idle
        workers per GPU for ``in_flight`` evaluations spread over them."""
        pool = cls(per_key=-(-max(1, in_flight) // n_lanes), limit=limit)
        if limit != 0:
            for g in range(n_lanes):
                pool.fill(tier, g, limits)
        return pool

    @staticmethod
    def _key(tier: str, gpu: int, limits: Any) -> tuple:
        return tier, gpu if tier == "gpu" else 0, repr(limits.sandbox)

    def _spawn(self, key: tuple, tier: str, gpu: int, limits: Any) -> Any:
        from mkb_eval.harness.spawn import spawn_worker, start_fork_server

        self.spawned += 1
        # the server's environment depends on the tier, the GPU and the user whose code copy it imports;
        # the caps (memory, processes, file size, network, confinement) are entered by each forked child
        skey = key[:2] + (limits.sandbox.run_as,)
        if self.fork and skey not in self.servers:
            self.servers[skey] = start_fork_server(tier, gpu, limits)
        server = self.servers.get(skey)
        if server is not None and not server.broken:
            try:
                return spawn_worker(tier, gpu, limits, preload=True, server=server)
            except RuntimeError:
                pass
        if server is not None and not server.warned:
            server.warned = True
            print(f"warning: {server.error}; workers are exec'd from now on", file=sys.stderr, flush=True)
        return spawn_worker(tier, gpu, limits, preload=True)

    def fill(self, tier: str, gpu: int, limits: Any) -> None:
        """Start workers for this key up to ``per_key`` (e.g. before a sweep begins)."""
        key = self._key(tier, gpu, limits)
        with self._lock:
            idle = self._idle.setdefault(key, [])
            idle[:] = [w for w in idle if w.proc.poll() is None]
            while not self.closed and len(idle) < self.per_key and (self.limit is None or self.spawned < self.limit):
                idle.append(self._spawn(key, tier, gpu, limits))

    def allow(self, n: int = 1) -> None:
        """Start ``n`` more workers than the limit first said: evaluations that will run again
        (a retry alone after running out of memory) then start warm too."""
        with self._lock:
            if self.limit is not None:
                self.limit += n

    def cap(self, n: int) -> None:
        """Start no more than ``n`` workers in all (a sweep fed one job at a time learns as it goes
        how many evaluations may still come)."""
        with self._lock:
            self.limit = n if self.limit is None else min(self.limit, n)

    def take(self, tier: str, gpu: int, limits: Any) -> Any | None:
        """A live started worker for this evaluation (or None), replaced at once by a new one."""
        key = self._key(tier, gpu, limits)
        w = None
        while w is None:
            with self._lock:
                idle = self._idle.setdefault(key, [])
                if not idle:
                    break
                cand = idle.pop(0)
            if cand.lost_by_server(self.import_timeout_s):       # waits while its server imports
                _discard(cand)
                self.allow(1)                  # its replacement is exec'd (the server is broken)
                self.fill(tier, gpu, limits)
            elif cand.proc.poll() is None:
                w = cand
            else:
                _discard(cand)
        with self._lock:
            self.taken += w is not None
        if w is None or w.wait_preloaded(0):
            self.fill(tier, gpu, limits)
        else:
            threading.Thread(target=self._fill_once_ready, args=(w, tier, gpu, limits), daemon=True).start()
        return w

    def _fill_once_ready(self, w: Any, tier: str, gpu: int, limits: Any) -> None:
        w.wait_preloaded(self.import_timeout_s)
        self.fill(tier, gpu, limits)

    def close(self) -> None:
        """Stop every idle worker and remove its folder, then the fork servers."""
        with self._lock:
            self.closed = True
            for idle in self._idle.values():
                for w in idle:
                    _discard(w)
            self._idle.clear()
            for server in self.servers.values():
                if server.started:             # what forking saved: these imports were paid once
                    print(f"fork server (GPU {server.gpu}): imports took {server.started['import_s']} s, "
                          f"{server.started['import_cpu_s']} CPU s", file=sys.stderr, flush=True)
                server.close()
                shutil.rmtree(server.folder, ignore_errors=True)

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _discard(w: Any) -> None:
    w.kill()
    shutil.rmtree(w.root, ignore_errors=True)
