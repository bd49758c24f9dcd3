"""A local sweep over several GPUs: one sweep process per GPU, fed one job at a time from here.

One process running every GPU's evaluations shares one GIL among their judging, lanes and
polling threads: a 1-GPU sweep's process used 0.73 of a core on the H200 (12 in flight), so one
process could not keep two GPUs going, let alone four (results/h200/2026-11-30_bench6, where the
GPUs' processes of a 2-GPU sweep used 0.6-0.7 each). Here each GPU gets a sweep process of its own, on its own share
of the cores (timing core included), seeing only its GPU; this process only hands out jobs (in
:func:`~mkb_eval.sweep.jobs.spread_order`, to whichever GPU's process asks next, so a slow GPU takes
fewer) and stores what comes back, so records, resumption and the progress bar are the same as a
one-process sweep's.

Protocol, JSON lines: the child sends ``{"want": 1}`` and gets ``{"job": i, "problem": folder,
"hash", "dsl", "kernel", "remaining"}`` or ``{"done": true}``; it sends ``{"job": i, "record": {...}}``
or ``{"job": i, "failed": "error"}`` per job, then ``{"cpu_s", "wall_s"}``. Its first stdin line is
its configuration (a pickle, base64: same code, same user). A job handed to a child that ended
without answering for it is reported as not recorded, like any harness failure; jobs nobody took
are handed to the children still running.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.harness import cores
from mkb_eval.harness.gpus import physical_gpu
from mkb_eval.harness.sandbox import own_code_env
from mkb_eval.sweep.jobs import Job, JobQueue, spread_order
from mkb_eval.sweep.local import run_local

CHILD = [sys.executable, "-m", "mkb_eval.sweep.per_gpu"]


def run(todo: list[Job], tier: str, verify_kwargs: dict[str, Any], parallel: int, n_gpus: int, sink: Any,
        warm: bool = False) -> None:
    """Evaluate ``todo`` with one child sweep per GPU, ``parallel`` in flight over all of them."""
    queue = JobQueue(spread_order(todo))
    dealt = cores.split(n_gpus)
    shares: list[list[int] | None] = list(dealt) if dealt else [None] * n_gpus
    per_gpu = -(-max(1, parallel) // n_gpus)
    children = [_start(g, {"tier": tier, "verify_kwargs": verify_kwargs, "parallel": per_gpu, "warm": warm,
                           "expected": len(todo), "cores": shares[g]}) for g in range(n_gpus)]
    numbers = itertools.count()
    threads = [threading.Thread(target=_serve, args=(g, c, queue, sink, numbers), daemon=True)
               for g, c in enumerate(children)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)                       # a timed join: Ctrl-C reaches this thread
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    while (job := queue.take()) is not None:      # every child ended before taking these
        sink.failed(job, "no GPU's sweep process was left to run it")


def _start(g: int, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                            env=own_code_env(CUDA_VISIBLE_DEVICES=physical_gpu(g)))
    assert proc.stdin is not None
    proc.stdin.write(base64.b64encode(pickle.dumps(cfg)).decode() + "\n")
    proc.stdin.flush()
    return proc


def _serve(g: int, proc: subprocess.Popen[str], queue: JobQueue, sink: Any, numbers: Iterator[int]) -> None:
    """Answer GPU ``g``'s child until it ends; what it took and never answered for is reported."""
    assert proc.stdin is not None and proc.stdout is not None
    handed: dict[int, Job] = {}
    for line in proc.stdout:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("job", 0), int):
            print(f"GPU {g}'s sweep process wrote an unreadable line: {line[:200]!r}", file=sys.stderr)
            continue
        if "want" in msg:
            job, n = queue.take(), next(numbers)
            if job is not None:
                handed[n] = job
            reply = {"done": True} if job is None else {
                "job": n, "problem": str(job.problem.path), "hash": job.problem.hash, "dsl": job.dsl,
                "kernel": str(job.kernel), "remaining": queue.bound()}
            try:
                proc.stdin.write(json.dumps(reply) + "\n")
                proc.stdin.flush()
            except OSError:
                break                               # it ended: its jobs are reported below
        elif "record" in msg and msg.get("job") in handed:
            handed.pop(msg["job"])
            sink.record(msg["record"])
        elif "failed" in msg and msg.get("job") in handed:
            sink.failed(handed.pop(msg["job"]), str(msg["failed"]))
        elif "cpu_s" in msg:
            wall = max(1e-9, float(msg.get("wall_s") or 0))
            sink.note(f"GPU {g} sweep process: {float(msg['cpu_s']) / wall:.2f} cores "
                      f"({float(msg['cpu_s']):.0f} CPU s in {wall:.0f} s)")
    rc = proc.wait()
    for job in handed.values():
        sink.failed(job, f"GPU {g}'s sweep process ended (exit code {rc}) before it finished")


class _RemoteQueue(JobQueue):
    """The child's side: each take asks the parent for the next job."""

    def __init__(self, expected: int, proto: Any) -> None:
        super().__init__([])
        self._remaining, self._proto = expected, proto
        self._problems: dict[str, P.Problem] = {}
        self.ids: dict[int, int] = {}              # id(Job) here -> the parent's job number

    def take(self) -> Job | None:
        with self._lock:
            while True:
                self._proto.send({"want": 1})
                line = sys.stdin.readline()
                msg: dict[str, Any] = json.loads(line) if line.strip() else {"done": True}    # stdin closed: parent gone
                if msg.get("done"):
                    self._remaining = 0
                    return None
                self._remaining = int(msg["remaining"])
                try:
                    prob = self._problems.get(msg["problem"]) or P.load_problem(msg["problem"])
                    if prob.hash != msg["hash"]:
                        raise P.ProblemError(f"{prob.name} changed on disk during the sweep (hash {prob.hash[:12]}, "
                                             f"was {msg['hash'][:12]})")
                except (OSError, P.ProblemError) as e:
                    self._proto.send({"job": msg["job"], "failed": f"{type(e).__name__}: {e}"})
                    continue
                self._problems[msg["problem"]] = prob
                job = Job(prob, msg["dsl"], Path(msg["kernel"]))
                self.ids[id(job)] = msg["job"]
                self.taken += 1
                return job

    def bound(self) -> int:
        return self._remaining


class _Protocol:
    """The child's private line to its parent (stdout, before anything else may print there)."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)                               # stray prints (toolchains, warnings) go to stderr
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self._out.write(json.dumps(msg, default=str) + "\n")


class _Reply:
    """The sink the child's sweep writes to: each outcome goes to the parent with its job number."""

    def __init__(self, proto: _Protocol, queue: _RemoteQueue) -> None:
        self._proto, self._queue = proto, queue

    def record(self, rec: dict, job: Job) -> None:
        self._proto.send({"job": self._queue.ids.pop(id(job)), "record": rec})

    def failed(self, job: Job, error: str) -> None:
        self._proto.send({"job": self._queue.ids.pop(id(job)), "failed": error})


def _die_with_parent() -> None:
    """Linux: this child is killed when the process that started it dies (a sweep cut with SIGKILL),
    and its workers then end with it, as they do when a one-process sweep dies."""
    import ctypes
    import signal

    ppid = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != ppid:                        # it died before the request took hold
        os._exit(1)


def main() -> int:
    t0 = time.perf_counter()
    _die_with_parent()
    proto = _Protocol()
    cfg = pickle.loads(base64.b64decode(sys.stdin.readline()))
    if cfg.get("cores") and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cfg["cores"])         # before any thread starts: all of them inherit it
    queue = _RemoteQueue(cfg["expected"], proto)
    run_local(queue, cfg["tier"], cfg["verify_kwargs"], cfg["parallel"], _Reply(proto, queue), cfg["warm"])
    usage = os.times()
    proto.send({"cpu_s": usage.user + usage.system, "wall_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
