"""Worker processes as the parent sees them: spawned (exec'd, or forked by a fork server) in a
fresh evaluation folder and sandbox, watched against the sandbox caps, read through their message
channel, ended with everything they started; and what their messages say in a record."""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mkb_eval.dsl import SPECS
from mkb_eval.harness.channel import read_messages
from mkb_eval.harness.forkserver import ForkServer, killpg
from mkb_eval.harness.gate import GateSocket
from mkb_eval.harness.job import Job
from mkb_eval.harness.lanes import physical_gpu
from mkb_eval.harness.protocol import (FAILURES, GO, PROTOCOL_FLAG, PROTOCOL_STATUS, STOP, EventsReport, Final,
                                       Malformed, Message, Progress, ProtocolError, Setup)
from mkb_eval.harness.procs import session_usage
from mkb_eval.harness.sandbox import Sandbox, SandboxConfig, code_root, pythonpath_first
from mkb_eval.records import VerificationRecord, artifacts_from_worker

OUTPUT_TAIL = 4000
_SECRET_ENV = ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "ACCESS_KEY", "CREDENTIAL")


@dataclass


class Limits:
    """Wall-clock limits (seconds) and the worker's sandbox caps."""

    correctness_s: float = 300.0
    timing_s: float = 300.0
    cpu_s: float = 300.0
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def _scrubbed_env(extra: dict[str, str], code: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not any(s in k.upper() for s in _SECRET_ENV) and not k.upper().startswith(("HF_TOKEN", "OPENAI", "MKB_API"))}
    env["PYTHONPATH"] = pythonpath_first(code, env)
    env.update(extra)
    return env


def tail(path: Path, n: int = OUTPUT_TAIL) -> str:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            data = f.read().decode(errors="replace")
        return (f"[... {size - n} bytes cut ...]\n" if size > n else "") + data
    except FileNotFoundError:
        return ""


class Worker:
    """One worker process in its own session, sandbox, temp dir and DSL caches.

    Spawned before its job is known (so a warm pool can start it ahead of need); the job, with
    the secret seeds, goes through a pipe, never through a file, when ``start`` is called.
    """

    def __init__(self, root: Path, limits: Limits, env: dict[str, str], preload: bool = False,
                 server: ForkServer | None = None) -> None:
        self.root = root
        self.limits = limits
        self.preloaded = preload
        self.server = server
        self.sentinel = secrets.token_hex(16)
        self.channel = root / "channel"
        self.gate = GateSocket()               # lane gates and timing ops out, window replies in (stamped)
        self.gate_r = self.gate.child_fd()
        ready_w, self._ready_r = -1, None
        if preload:                            # the worker writes a byte here once its imports are done
            self._ready_r, ready_w = os.pipe()
        self.killed_for: str | None = None
        self._ready_lock = threading.Lock()
        self._next_watch = 0.0
        self._channel_seen: tuple[int, int] = (-1, -1)
        self._messages: list[Message | Malformed] = []
        self.sandbox = Sandbox.create(limits.sandbox, owned=root)
        self.stdout, self.stderr = root / "stdout.txt", root / "stderr.txt"
        # a forked worker gets its descriptors as fds 0-4 (gate 3, ready pipe 4); an exec'd one keeps ours
        self.child_gate_fd = 3 if server else self.gate_r
        if preload:
            env = {**env, "MKB_WORKER_PRELOAD": "4" if server else str(ready_w)}
        with open(self.stdout, "wb") as so, open(self.stderr, "wb") as se:
            if server is not None:
                stdin_r, stdin_w = os.pipe()
                stdin = open(stdin_w, "wb")
                try:
                    self.proc: Any = server.spawn(env, str(root / "work"), self.sandbox.spec,
                                                  [stdin_r, so.fileno(), se.fileno(), self.gate_r] + [ready_w] * preload,
                                                  stdin)
                except RuntimeError:           # the server ended: nothing of this worker may stay open
                    stdin.close()
                    self.gate.close()
                    for fd in (ready_w, self._ready_r):
                        if fd is not None and fd >= 0:
                            os.close(fd)
                    self.sandbox.cleanup()
                    raise
                finally:
                    os.close(stdin_r)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "mkb_eval.harness.worker", "-"], cwd=root / "work", env=env,
                    stdin=subprocess.PIPE, stdout=so, stderr=se, start_new_session=True,
                    pass_fds=(self.gate_r,) + ((ready_w,) if preload else ()),
                    # the sandbox is entered in the child between fork and exec (cgroups, network, rlimits, user):
                    # only this exec'd path does so; the fork server (the default) enters it from Sandbox.spec
                    preexec_fn=self.sandbox.preexec)  # noqa: PLW1509 - deliberate: see the comment above
        self.gate.close_child()
        if preload:
            os.close(ready_w)

    @property
    def forked(self) -> bool:
        return self.server is not None

    def start(self, job: Job) -> None:
        """Send ``job``, with this worker's channel and gate attached, and close the worker's stdin."""
        job = replace(job, sentinel=self.sentinel, channel=str(self.channel), gate_fd=self.child_gate_fd)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(job.encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def lost_by_server(self, timeout: float) -> bool:
        """A forked worker whose server ended or refused (CUDA initialised) before forking it, waiting up
        to ``timeout`` s for the server to decide: its evaluation needs another worker, not a crash."""
        server = self.server                   # (self.forked, spelled out for mypy)
        if server is None or self.proc.wait_forked(timeout):
            return False
        if server.error is None:               # hung: its later workers are exec'd too
            server.error = f"fork server: no worker forked within {timeout:.0f} s"
        return True

    def wait_preloaded(self, timeout: float) -> bool:
        """Whether a warm worker's imports are done (or it ended), waiting up to ``timeout`` s for it."""
        deadline = time.monotonic() + timeout
        while True:
            with self._ready_lock:             # short slices: ``kill`` closes the pipe under this lock
                if self._ready_r is None:
                    return True
                if select.select([self._ready_r], [], [], min(0.05, max(0.0, deadline - time.monotonic())))[0]:
                    os.close(self._ready_r)
                    self._ready_r = None
                    return True
            if time.monotonic() >= deadline:
                return False

    def _watch(self) -> None:
        """Kill the worker's session past the memory or process caps (where cgroups are missing too)."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + 0.25
        cfg = self.limits.sandbox
        if self.proc.pid is None:              # a forked worker not forked yet
            return
        rss, n = session_usage(self.proc.pid, max_age=0.2)
        if cfg.memory_bytes and rss > cfg.memory_bytes:
            self.killed_for = f"resident memory {rss / 2**30:.1f} GiB over the cap of {cfg.memory_bytes / 2**30:.1f} GiB"
        elif cfg.max_tasks and n > cfg.max_tasks:
            self.killed_for = f"{n} processes, over the cap of {cfg.max_tasks}"
        if self.killed_for:
            self.kill_group()

    def messages(self) -> list[Message | Malformed]:
        """The worker's messages so far; parsed again only when the channel has grown (waits poll it 50x a second)."""
        try:
            st = os.stat(self.channel)
        except FileNotFoundError:
            return []
        if (st.st_size, st.st_mtime_ns) != self._channel_seen:
            self._messages = read_messages(self.channel, self.sentinel)
            self._channel_seen = (st.st_size, st.st_mtime_ns)
        return self._messages

    def wait_for(self, kinds: tuple[str, ...], timeout: float,
                 unless: Callable[[Message], bool] | None = None) -> tuple[Message | None, str]:
        """The first message of one of ``kinds`` (a kind, or a progress stage) that ``unless`` does not
        rule out (e.g. one already handled); else (None, 'timeout' | 'exited'), or (None, 'protocol')
        when a message the protocol does not allow comes first (:func:`fail_from_worker` says which)."""
        deadline = time.monotonic() + timeout

        def found() -> Message | Malformed | None:
            for m in self.messages():
                if isinstance(m, Malformed):
                    return m
                if (m.kind in kinds or (m.kind == "progress" and getattr(m, "stage", None) in kinds)) and \
                        not (unless and unless(m)):
                    return m
            return None

        def answer(m: Message | Malformed) -> tuple[Message | None, str]:
            return (None, "protocol") if isinstance(m, Malformed) else (m, "message")

        while True:
            m = found()
            if m is not None:
                return answer(m)
            if self.proc.poll() is not None:
                m = found()                   # a message written just before exit
                return answer(m) if m is not None else (None, "exited")
            if time.monotonic() > deadline:
                return None, "timeout"
            self._watch()
            time.sleep(0.02)

    def last_stage(self) -> str:
        stages = [getattr(m, "stage", "") for m in self.messages()]
        return stages[-1] if stages else "startup"

    def open_gate(self, go: bool) -> None:
        try:
            self.gate.send(GO if go else STOP)
        except OSError:
            pass

    def kill_group(self) -> None:
        if self.forked:
            self.proc.cancel()                 # kills its session, now or once the server has forked it
        else:
            killpg(self.proc.pid)

    def kill(self) -> None:
        """End the worker and everything it started (process group, then its cgroups). Idempotent."""
        if getattr(self, "_killed", False):
            return
        self._killed = True
        self.kill_group()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.sandbox.cleanup()
        self.leftover = session_usage(self.proc.pid)[1] if self.proc.pid else 0
        if self.leftover:                      # a child outlived the group kill: try once more
            self.kill_group()
        with self._ready_lock:
            self.gate.close()
            try:
                if self._ready_r is not None:
                    os.close(self._ready_r)
            except OSError:
                pass
            self._ready_r = None

    def facts(self) -> dict[str, str]:
        setup = [m for m in self.messages() if isinstance(m, Setup)][:1]   # sent before the candidate existed
        return {**self.sandbox.facts,
                "network": setup[0].network if setup else "unknown (worker never started)",
                "outside_write": setup[0].outside_write if setup else "unknown",
                "worker": ("warm (forked from a server with the toolchains imported)" if self.forked else
                           "warm (started ahead, toolchains preloaded)" if self.preloaded else "cold"),
                "leftover_processes": str(getattr(self, "leftover", 0))}

    def death(self) -> str:
        if self.killed_for:
            return f"killed by the sandbox: {self.killed_for}"
        if self.sandbox.memory_events():
            cap = self.limits.sandbox.memory_bytes
            return "killed at the host memory cap" + (f" ({cap / 2**30:.1f} GiB)" if cap is not None else "")
        rc = self.proc.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            try:
                return f"killed by signal {-rc} ({signal.Signals(-rc).name})"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with code {rc}"


def host_gpu(gpu: int) -> int | str:
    """The host's number for this process's GPU ``gpu`` (a sweep process per GPU sees only its own as 0)."""
    p = physical_gpu(gpu)
    return int(p) if p.isdigit() else p


def stage_times(w: Worker) -> dict[str, float]:
    """Seconds spent in each worker stage, from the timestamps of its progress messages; and the
    worker's CPU seconds (all its threads): before its job arrived (interpreter start and, warm,
    the preloaded imports) and in all, as it last reported them."""
    msgs = w.messages()
    prog = [m for m in msgs if isinstance(m, (Progress, Setup, EventsReport))]
    out: dict[str, float] = {}
    for a, b in zip(prog, prog[1:], strict=False):     # consecutive pairs: the second is one shorter
        key = "w_" + a.stage
        out[key] = round(out.get(key, 0.0) + b.t - a.t, 3)
    cpu = [m.cpu for m in msgs if isinstance(m, (Progress, Setup, EventsReport, Final))]
    if cpu:
        out.update(worker_cpu_before_job_s=cpu[0], worker_cpu_s=max(cpu))
    return out


def protocol_failure(rec: VerificationRecord, stage: str, err: ProtocolError) -> None:
    """The verdict on a worker that broke the message protocol (:mod:`.protocol`)."""
    rec.status, rec.stage = PROTOCOL_STATUS, stage
    rec.message = f"the worker broke the message protocol: {err}"
    rec.flags = sorted(set(rec.flags) | {PROTOCOL_FLAG})


def fail_from_worker(rec: VerificationRecord, w: Worker, how: str, timeout: float) -> None:
    """The verdict when the worker stopped short: a message the protocol does not allow, else its last
    final message (a failure it may claim), else its silence (timeout, crashed)."""
    msgs = w.messages()
    bad = next((m for m in msgs if isinstance(m, Malformed)), None)
    final = [m for m in msgs if isinstance(m, Final)]
    if bad is not None:
        protocol_failure(rec, w.last_stage(), bad.error)
    elif final and final[-1].status not in FAILURES:
        protocol_failure(rec, final[-1].stage, ProtocolError(
            "final.status", f"{final[-1].status!r} where the worker may only report a failure"))
    elif final:
        m = final[-1]
        rec.status, rec.stage, rec.message = m.status, m.stage, m.message
        rec.flags = sorted(set(rec.flags) | set(m.flags))
        if m.artifacts:
            rec.artifacts = artifacts_from_worker(m.artifacts)
    elif how == "timeout":
        rec.status, rec.stage = "timeout", w.last_stage()
        rec.message = f"kernel evaluation hung during {rec.stage}, killed after {timeout:.0f}s"
    else:
        w.proc.wait()
        rec.status, rec.stage = "crashed", w.last_stage()
        rec.message = f"worker {w.death()} during {rec.stage}"


def _eval_folder(prefix: str = "mkb-eval-") -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    for sub in ("work", "tmp", "out", "dump", "cache", *(d for s in SPECS.values() for d in s.cache_dirs), "home"):
        (root / sub).mkdir()
    return root


def _worker_env(tier: str, gpu: int, root: Path, limits: Limits) -> dict[str, str]:
    """A worker's environment: scrubbed of secrets, its caches and temp files in its folder (each DSL's
    variables from its spec)."""
    dsl_env = {k: v for s in SPECS.values() for k, v in s.worker_env(root, tier).items()}
    return _scrubbed_env({
        "TMPDIR": str(root / "tmp"), "XDG_CACHE_HOME": str(root / "cache"), "HOME": str(root / "home"),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **dsl_env,
        "CUDA_VISIBLE_DEVICES": "" if tier == "cpu" else physical_gpu(gpu),
    }, code_root(limits.sandbox.run_as))


def spawn_worker(tier: str, gpu: int, limits: Limits, preload: bool = False,
                 server: ForkServer | None = None) -> Worker:
    """A fresh worker process in a fresh evaluation folder, waiting for its job: exec'd, or forked by
    ``server`` (started by ``start_fork_server`` for the same tier, GPU and limits)."""
    root = _eval_folder()
    try:
        return Worker(root, limits, _worker_env(tier, gpu, root, limits), preload, server)
    except RuntimeError:
        shutil.rmtree(root, ignore_errors=True)
        raise


def start_fork_server(tier: str, gpu: int, limits: Limits) -> ForkServer:
    """A fork server whose workers get what ``spawn_worker`` gives them (it imports in the background).
    Each DSL's spec adds its fork-server variables (CuTe DSL fixes its dump folder on import: a relative
    one lands in each worker's own folder); torch answers ``cuda.is_available()`` through NVML, so an
    import that asks (TVM's FFI does) leaves CUDA uninitialised before the fork."""
    folder = _eval_folder("mkb-forkserver-")
    fork_env = {k: v for s in SPECS.values() for k, v in s.fork_env.items()}
    server = ForkServer({**_worker_env(tier, gpu, folder, limits), **fork_env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},
                        folder)
    server.gpu = host_gpu(gpu) if tier == "gpu" else "-"
    return server

