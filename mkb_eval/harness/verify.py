"""Verify one kernel against one problem: the orchestration of worker (untrusted) and judge (trusted).

GPU tier: static policy → worker phase 1 (5 secret-seed draws + the DSL-dependence draw) →
judge → worker phase 2 under the GPU's exclusive lane: 10 warmup + 50 event-timed draws (their seeds
sent at the timing gate), then a parent-attested window (:mod:`mkb_eval.harness.attest`) and the eager
baseline with its own window → the timing verdict (re-timed once when in doubt) → torch.compile
baseline → judge the 3 window outputs chosen after the window → record. CPU tier: static policy, the reference at smoke
size, and a compile-only run of the candidate; what needs a GPU is marked ``unverified``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.env import describe
from mkb_eval.harness import attest, cores, timed
from mkb_eval.harness.attest import GateSocket
from mkb_eval.harness.channel import read_messages
from mkb_eval.harness.forkserver import ForkServer, killpg
from mkb_eval.harness.lanes import GpuLane, physical_gpu
from mkb_eval.harness.policy import check_source
from mkb_eval.harness.sandbox import (Sandbox, SandboxConfig, code_root, pythonpath_first, repo_root,
                                     session_usage)
from mkb_eval.records import Timing, VerificationRecord

CORRECTNESS_DRAWS = 5
WARMUP_DRAWS = 10
TIMING_DRAWS = 50
REUSE_DRAWS = (2, 4)           # correctness draws that refill the previous draw's buffers
OUTPUT_TAIL = 4000
_SECRET_ENV = ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "ACCESS_KEY", "CREDENTIAL")


@dataclass
class Limits:
    """Wall-clock limits (seconds) and the worker's sandbox caps."""

    correctness_s: float = 300.0
    timing_s: float = 300.0
    cpu_s: float = 300.0
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MKB_CACHE_DIR", Path.home() / ".cache" / "mkb"))


def _seed() -> int:
    return secrets.randbits(63)


def _scrubbed_env(extra: dict[str, str], code: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not any(s in k.upper() for s in _SECRET_ENV) and not k.upper().startswith(("HF_TOKEN", "OPENAI", "MKB_API"))}
    env["PYTHONPATH"] = pythonpath_first(code, env)
    env.update(extra)
    return env


def _tail(path: Path, n: int = OUTPUT_TAIL) -> str:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            data = f.read().decode(errors="replace")
        return (f"[... {size - n} bytes cut ...]\n" if size > n else "") + data
    except FileNotFoundError:
        return ""


class _Worker:
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
        self._messages: list[dict[str, Any]] = []
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

    def start(self, job: dict[str, Any]) -> None:
        import json

        job = {**job, "sentinel": self.sentinel, "channel": str(self.channel), "gate_fd": self.child_gate_fd}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(job).encode())
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

    def messages(self) -> list[dict[str, Any]]:
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
                 unless: Callable[[dict[str, Any]], bool] | None = None) -> tuple[dict[str, Any] | None, str]:
        """The first message of one of ``kinds`` (a kind, or a progress stage) that ``unless`` does not
        rule out (e.g. one already handled); else (None, 'timeout' | 'exited')."""
        deadline = time.monotonic() + timeout

        def found() -> dict[str, Any] | None:
            for m in self.messages():
                if (m.get("kind") in kinds or (m.get("kind") == "progress" and m.get("stage") in kinds)) and \
                        not (unless and unless(m)):
                    return m
            return None

        while True:
            m = found()
            if m is not None:
                return m, "message"
            if self.proc.poll() is not None:
                m = found()                   # a message written just before exit
                return (m, "message") if m is not None else (None, "exited")
            if time.monotonic() > deadline:
                return None, "timeout"
            self._watch()
            time.sleep(0.02)

    def last_stage(self) -> str:
        stages = [m.get("stage", "") for m in self.messages()]
        return stages[-1] if stages else "startup"

    def open_gate(self, go: bool) -> None:
        try:
            self.gate.send(b"go" if go else b"stop")
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
        setup = [m for m in self.messages() if m.get("stage") == "setup"][:1]   # sent before the candidate existed
        return {**self.sandbox.facts,
                "network": str(setup[0].get("network", "unknown")) if setup else "unknown (worker never started)",
                "outside_write": str(setup[0].get("outside_write", "unknown")) if setup else "unknown",
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


def _host_gpu(gpu: int) -> int | str:
    """The host's number for this process's GPU ``gpu`` (a sweep process per GPU sees only its own as 0)."""
    p = physical_gpu(gpu)
    return int(p) if p.isdigit() else p


def verify(problem: P.Problem | str | int, dsl: str, kernel: str | Path, *, tier: str = "auto",
           size: str | None = None, gpu: int = 0, lane: GpuLane | None = None, limits: Limits | None = None,
           compile_baseline: bool | str = True, cache_dir: Path | None = None, keep_dir: bool = False,
           pool: Any = None, reuse_eager: bool = False) -> VerificationRecord:
    """Verify ``kernel`` (a path to kernel.py) for ``problem`` in ``dsl``; never raises for candidate faults.

    ``gpu`` picks the device; ``lane`` is that GPU's timing lane when several evaluations run at
    once (a private one otherwise). ``compile_baseline="cached"`` takes the torch.compile time
    from the cache only, so a sweep never compiles a reference inside a timing lane; ``reuse_eager``
    measures the eager time once per problem (size, GPU model, torch) in the cache and reuses it
    (flag ``eager_baseline_from_cache``): the other DSL's evaluation skips it inside its timing lane. ``pool`` (a
    :class:`~mkb_eval.harness.pool.WarmPool`) supplies a worker started ahead of need.
    """
    if dsl not in P.DSLS:
        raise ValueError(f"unknown DSL '{dsl}' (choose from {', '.join(P.DSLS)})")
    prob = problem if isinstance(problem, P.Problem) else P.find(problem)
    kernel = Path(kernel)
    source = kernel.read_text(errors="replace")
    import torch

    if tier == "auto":
        tier = "gpu" if torch.cuda.is_available() else "cpu"
    if tier not in ("gpu", "cpu"):
        raise ValueError(f"tier must be gpu, cpu or auto, not {tier!r}")
    size = size or ("full" if tier == "gpu" else "smoke")
    limits = limits or Limits()
    cache_dir = cache_dir or default_cache_dir()
    t_start = time.perf_counter()
    rec = VerificationRecord(
        status="crashed", problem_id=prob.id, problem=prob.name, problem_hash=prob.hash, dsl=dsl,
        kernel_sha256=hashlib.sha256(source.encode()).hexdigest(), tier=tier, size=size,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        env={**describe(gpu=tier == "gpu"), **({"gpu_index": _host_gpu(gpu)} if tier == "gpu" else {})})
    pol = check_source(source, kernel.name)
    rec.flags, rec.policy_details = list(pol.flags), list(pol.details)
    if {"syntax_error", "missing_solve"} & set(pol.flags):
        rec.status, rec.stage = "compile_error", "parse"
        rec.message = ("SyntaxError: " if "syntax_error" in pol.flags else "") + "; ".join(pol.details)
        return rec
    if pol.violations:
        rec.status, rec.stage = "policy_violation", "static_check"
        rec.message = "forbidden: " + "; ".join(d for d in pol.details if d.split(":")[0] in pol.violations)
        return rec

    w = (pool.take(tier, gpu, limits) if pool is not None else None) or spawn_worker(tier, gpu, limits)
    root = w.root
    shutil.copyfile(kernel, root / "work" / "kernel.py")
    try:
        if tier == "cpu":
            _run_cpu(rec, prob, dsl, w, limits)
        else:
            _run_gpu(rec, prob, dsl, w, size, gpu, lane or GpuLane(gpu), limits, compile_baseline, cache_dir,
                     reuse_eager)
    finally:
        w.kill()
        rec.message, rec.stdout_tail, rec.stderr_tail = (
            redact_paths(x, root) for x in (rec.message, rec.stdout_tail, rec.stderr_tail))
        rec.stages_s["total"] = round(time.perf_counter() - t_start, 3)
        warn_unconfined(rec.sandbox)
        if not keep_dir:
            shutil.rmtree(root, ignore_errors=True)
    return rec


_WARNED: list[str] = []


def warn_unconfined(facts: dict[str, str]) -> None:
    """Warn once per process when a worker could write outside its evaluation folder (no Landlock)."""
    ow = facts.get("outside_write", "unknown")
    if _WARNED or ow in ("denied", "unknown") or ow.startswith("denied"):
        return
    _WARNED.append(ow)
    import warnings

    warnings.warn(f"the worker could write outside its evaluation folder ({facts.get('confinement', '?')}): "
                  "candidate code runs with this user's rights on files; see the record's sandbox facts",
                  RuntimeWarning, stacklevel=3)


def verify_source(problem: P.Problem | str | int, dsl: str, source: str, **kwargs: Any) -> dict[str, Any]:
    """Verify kernel source text; returns the record as a dict (for the metric's GPU mode)."""
    with tempfile.TemporaryDirectory(prefix="mkb-src-") as d:
        path = Path(d) / "kernel.py"
        path.write_text(source)
        return verify(problem, dsl, path, **kwargs).to_dict()


def _job(prob: P.Problem, dsl: str, root: Path, tier: str, size: str, device: str, gpu: int = 0,
         user: str | None = None, mode: str = "verify") -> dict[str, Any]:
    """What a worker gets at start: correctness seeds only. The timed draws' seeds come through the
    gate at the timing gate and each attested window's with it; re-checks are chosen after the window.
    ``mode="retime"``: one correctness draw and no DSL-dependence draw (the kernel was verified before)."""
    timing_cpu, work_cpus = _cores(gpu) if tier == "gpu" else (None, None)
    n = 1 if mode == "retime" else CORRECTNESS_DRAWS
    return {"problem_dir": str(_worker_path(prob.path, user)), "dsl": dsl, "tier": tier, "size": size, "device": device,
            "kernel_path": str(root / "work" / "kernel.py"), "out_dir": str(root / "out"), "dump_dir": str(root / "dump"),
            "mode": mode, "correctness_seeds": [_seed() for _ in range(n)],
            "reuse_draws": list(REUSE_DRAWS) if mode == "verify" else [],
            "nodsl_seed": _seed() if mode == "verify" else None,
            "timing_cpu": timing_cpu, "work_cpus": work_cpus}


def _worker_path(path: Path, user: str | None) -> Path:
    """Where the worker finds a problem folder: the same folder in the staged copy of the checkout
    when its user cannot read the checkout (``sandbox.code_root``); folders outside it unchanged."""
    code, repo = code_root(user), repo_root()
    try:
        return code / Path(path).resolve().relative_to(repo) if code != repo else Path(path)
    except ValueError:
        return Path(path)


def _cores(gpu: int) -> tuple[int | None, list[int] | None]:
    """(the core kept for GPU ``gpu``'s timed phase, the cores for all other worker work); see
    :mod:`mkb_eval.harness.cores`. (All workers once pinned themselves to one shared core: 8 in
    flight made start-up 8x slower.)"""
    import torch

    n = max(1, torch.cuda.device_count())
    p = cores.plan(n)
    if p is None or gpu >= n:
        return None, None
    return p[0][gpu], p[1]


def _stage_times(w: _Worker) -> dict[str, float]:
    """Seconds spent in each worker stage, from the timestamps of its progress messages; and the
    worker's CPU seconds (all its threads): before its job arrived (interpreter start and, warm,
    the preloaded imports) and in all, as it last reported them."""
    msgs = w.messages()
    prog = [m for m in msgs if m.get("kind") == "progress" and "t" in m]
    out: dict[str, float] = {}
    for a, b in zip(prog, prog[1:], strict=False):     # consecutive pairs: the second is one shorter
        key = "w_" + a["stage"]
        out[key] = round(out.get(key, 0.0) + b["t"] - a["t"], 3)
    cpu = [m["cpu"] for m in msgs if isinstance(m.get("cpu"), (int, float))]
    if cpu:
        out.update(worker_cpu_before_job_s=cpu[0], worker_cpu_s=max(cpu))
    return out


def _fail_from_worker(rec: VerificationRecord, w: _Worker, how: str, timeout: float) -> None:
    final = [m for m in w.messages() if m.get("kind") == "final"]
    if final:
        m = final[-1]
        rec.status, rec.stage, rec.message = m["status"], m.get("stage", ""), m.get("message", "")
        rec.flags = sorted(set(rec.flags) | set(m.get("flags", [])))
        if m.get("artifacts"):
            rec.artifacts = m["artifacts"]
    elif how == "timeout":
        rec.status, rec.stage = "timeout", w.last_stage()
        rec.message = f"kernel evaluation hung during {rec.stage}, killed after {timeout:.0f}s"
    else:
        w.proc.wait()
        rec.status, rec.stage = "crashed", w.last_stage()
        rec.message = f"worker {w.death()} during {rec.stage}"


def _run_cpu(rec: VerificationRecord, prob: P.Problem, dsl: str, w: _Worker, limits: Limits) -> None:
    import torch

    from mkb_eval.harness.judge import Judge

    from mkb_eval.harness import transport
    from mkb_eval.harness.tolerance import Mismatch, check_descriptor

    root = w.root
    job = _job(prob, dsl, root, "cpu", "smoke", "cpu", user=w.limits.sandbox.run_as)
    t0 = time.perf_counter()
    judge = Judge(prob, "smoke", "cpu")
    ref, _ = judge.expected(judge.inputs(job["correctness_seeds"][0]))   # reference and anchor at smoke size
    rec.stages_s["reference_smoke"] = round(time.perf_counter() - t0, 3)
    rec.correctness["reference_smoke"] = "ok"
    del torch
    w.start(job)
    try:
        msg, how = w.wait_for(("final",), limits.cpu_s)
        out_path = root / "out" / "cpu_out.pt"
        bad = None
        if msg and os.path.lexists(out_path):
            try:                                  # the worker's file: strictly parsed, structure only
                with transport.open_output(out_path) as saved:
                    bad = check_descriptor(saved.root, ref)
            except transport.TransportError as e:
                bad = Mismatch("output", f"unreadable output file: {e}")
        if msg and msg["status"] == "unverified" and bad:
            rec.status, rec.stage = "incorrect", "structure"
            rec.message = f"the returned structure does not match the reference's: {bad}"
        elif msg and msg["status"] == "unverified":
            rec.status, rec.stage = "unverified", "compile_only"
            rec.message = (f"compiled for sm_90a on CPU ({msg.get('launches', 0)} launch(es) intercepted); "
                           "correctness and speed need a GPU")
            rec.artifacts = msg.get("artifacts", {})
            rec.stages_s.update(import_s=round(msg.get("import_s", 0.0), 3), compile_s=round(msg.get("compile_s", 0.0), 3))
            if msg.get("after_launch_error"):
                rec.artifacts["after_launch_error"] = msg["after_launch_error"][-1000:]
        else:
            _fail_from_worker(rec, w, how, limits.cpu_s)
    finally:
        w.kill()
        rec.stdout_tail, rec.stderr_tail = _tail(w.stdout), _tail(w.stderr)
        rec.stages_s.update(_stage_times(w))
        rec.sandbox = w.facts()


def _run_gpu(rec: VerificationRecord, prob: P.Problem, dsl: str, w: _Worker, size: str, gpu: int, lane: GpuLane,
             limits: Limits, compile_baseline: bool | str, cache_dir: Path, reuse_eager: bool = False) -> None:
    """Worker start → (lane shared) phase 1 + judging → (lane exclusive) timing + baselines → rechecks."""
    from mkb_eval.harness.judge import Judge

    job = _job(prob, dsl, w.root, "gpu", size, "cuda:0", gpu, user=w.limits.sandbox.run_as)    # the worker sees one GPU
    judge = Judge(prob, size, f"cuda:{gpu}")
    out = w.root / "out"
    w.start(job)
    try:
        t0 = time.perf_counter()
        msg, how = w.wait_for(("ready", "final"), limits.correctness_s)
        rec.stages_s["worker_start"] = round(time.perf_counter() - t0, 3)
        if not msg or msg["kind"] == "final":
            _fail_from_worker(rec, w, how, limits.correctness_s)
            return
        held = _Held(lane)
        try:
            msg, how = _phase1(w, held, limits.correctness_s, rec)
            if not msg or msg["kind"] == "final":
                _fail_from_worker(rec, w, how, limits.correctness_s)
                return
            if not _judge_phase1(rec, judge, job, msg, out, between=held.step_aside):
                return
        finally:
            held.release()
            rec.stages_s["lane_step_aside"] = round(held.stepped_aside, 3)
        t0 = time.perf_counter()
        with lane.exclusive():
            rec.stages_s["timing_lane_wait"] = round(time.perf_counter() - t0, 3)
            outcome = _timed_phase(rec, prob, judge, job, w, size, gpu, lane, limits, cache_dir, reuse_eager)
            if outcome is None:
                return
            timed.finish(w)
            w.kill()
            _compile_baseline(rec, prob, size, outcome.timing, compile_baseline, cache_dir,
                              timed.Reference(prob, size, judge, lane.timer, job["timing_cpu"]), outcome.warmup,
                              outcome.timing_seeds)
    finally:
        w.kill()
        rec.stdout_tail, rec.stderr_tail = _tail(w.stdout), _tail(w.stderr)
        rec.stages_s.update(_stage_times(w))
        rec.sandbox = w.facts()
    held.waited = 0.0
    held.acquire()
    try:
        rec.stages_s["recheck_lane_wait"] = round(held.waited, 3)
        t0 = time.perf_counter()
        bad = timed.judge_windows(judge, outcome.windows, out, between=held.step_aside)
        rec.stages_s["judge_rechecks"] = round(time.perf_counter() - t0, 3)
    finally:
        held.release()
        rec.stages_s["lane_step_aside"] = round(held.stepped_aside, 3)     # phase 1 and rechecks
    rec.timing = outcome.timing
    if bad:
        rec.status, rec.stage, rec.message = "incorrect", "timing_recheck", bad
        return
    v = outcome.verdict
    rec.flags = sorted(set(rec.flags) | set(v.flags))
    if v.status != "ok":
        rec.status, rec.stage, rec.message = v.status, "timing_verdict", v.message
        return
    timing = outcome.timing
    rec.status, rec.stage = "ok", "done"
    n_checked = sum(len(win.saved) for win in outcome.windows)
    rec.message = (f"passed {CORRECTNESS_DRAWS} draws + {n_checked} re-checked window outputs; {timing.kernel_ms:.4f} ms "
                   f"(attested {timing.attested_ms:.4f}, worker {timing.worker_event_ms:.4f}) vs eager "
                   f"{timing.eager_ms:.4f} ms ({timing.speedup:.2f}x)")


@dataclass
class _Outcome(timed.TimedOutcome):
    warmup: list[int] = field(default_factory=list)
    timing_seeds: list[int] = field(default_factory=list)


def _timed_phase(rec: VerificationRecord, prob: P.Problem, judge: Any, job: dict[str, Any], w: _Worker, size: str,
                 gpu: int, lane: GpuLane, limits: Limits, cache_dir: Path, reuse_eager: bool) -> _Outcome | None:
    """Inside the exclusive lane: the timing gate with the event draws' seeds, the worker's event report,
    then :func:`timed.attested_phase`. None (status set) when the worker failed."""
    import torch

    from mkb_eval.harness.judge import baseline_cached

    warmup, timing_seeds = timed.seeds(WARMUP_DRAWS), timed.seeds(TIMING_DRAWS)
    t0 = time.perf_counter()
    try:                                  # the timing gate: the event draws' seeds reach the worker only now
        w.gate.send_op(op="events", warmup_seeds=warmup, timing_seeds=timing_seeds, device=True)
    except OSError:
        pass                              # the worker is gone: waiting below says how
    ev, how = w.wait_for(("events", "final"), limits.timing_s)
    rec.stages_s["worker_timing"] = round(time.perf_counter() - t0, 3)
    if not ev or ev.get("kind") == "final":
        _fail_from_worker(rec, w, how, limits.timing_s)
        return None
    l2 = int(getattr(torch.cuda.get_device_properties(gpu), "L2_cache_size", 0) or 0)
    io = judge.io_bytes                   # (input, reference output) bytes of a draw, once a draw was judged
    calls = attest.window_calls(io[0], io[1], l2) if io is not None else attest.WINDOW_CALLS
    ref = timed.Reference(prob, size, judge, lane.timer, job["timing_cpu"])

    def eager(measure: Callable[[], float]) -> float:
        if not reuse_eager:
            return measure()
        ms, cached, _ = baseline_cached(prob, size, rec.env, cache_dir, measure, kind="eager")
        if ms is None:                    # a cached entry without a time (eager failures are not cached): time it here
            return measure()
        if cached:
            rec.flags.append("eager_baseline_from_cache")
        return ms

    try:
        res = timed.attested_phase(w, ref, ev, calls, limits.timing_s, eager, rec.stages_s,
                                   prob.sol.sol_ms if size == "full" else None, WARMUP_DRAWS, TIMING_DRAWS,
                                   warmup, timing_seeds)
    except timed.WindowFailed as f:
        if f.status is None:
            _fail_from_worker(rec, w, f.how, limits.timing_s)
        else:
            rec.status, rec.stage, rec.message = f.status, "attested_window", f.message
        return None
    return _Outcome(res.timing, res.verdict, res.windows, res.calibrations, warmup, timing_seeds)


def _compile_baseline(rec: VerificationRecord, prob: P.Problem, size: str, t: Timing, compile_baseline: bool | str,
                      cache_dir: Path, ref: timed.Reference, warmup: list[int], timing_seeds: list[int]) -> None:
    """The torch.compile baseline (event draws, from the cache when asked), beside the eager one."""
    from mkb_eval.harness.judge import baseline_cached

    if not compile_baseline:
        return
    t0 = time.perf_counter()
    t.compile_ms, t.compile_cached, err = baseline_cached(
        prob, size, rec.env, cache_dir,
        None if compile_baseline == "cached" else lambda: ref.event_ms(warmup, timing_seeds, compiled=True))
    if err:
        rec.flags.append("compile_baseline_failed")
    rec.stages_s["compile_baseline"] = round(time.perf_counter() - t0, 3)
    t.speedup_vs_compile = t.compile_ms / t.kernel_ms if t.compile_ms and t.kernel_ms else None


_SITE = re.compile(r"(?:/[^\s\"':]+)*/(?:site|dist)-packages/")
_CODE = re.compile(r"(?:/[^\s\"':]+)*/mkb-code-[0-9a-f]+")
_EVAL = re.compile(r"(?:/[^\s\"':]+)*/mkb-eval-[A-Za-z0-9_]+(/?)")


def redact_paths(text: str, root: Path | None = None) -> str:
    """Machine paths out of messages and output tails, so records can be shared and committed:
    files in the evaluation folder get paths relative to it (the folder itself is ``<eval>``),
    installed packages and this repository become ``<site-packages>`` and ``<repo>``."""
    if not text:
        return text
    if root is not None:
        text = text.replace(str(root) + "/", "").replace(str(root), "<eval>")
    text = _SITE.sub("<site-packages>/", text)               # first: a virtualenv may sit inside the repo
    text = _CODE.sub("<repo>", text.replace(str(repo_root()), "<repo>"))
    return _EVAL.sub(lambda m: "" if m.group(1) else "<eval>", text)


def _eval_folder(prefix: str = "mkb-eval-") -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    for sub in ("work", "tmp", "out", "dump", "cache", "cute_cache", "tvm", "home"):
        (root / sub).mkdir()
    return root


def _worker_env(tier: str, gpu: int, root: Path, limits: Limits) -> dict[str, str]:
    """A worker's environment: scrubbed of secrets, its caches and temp files in its folder."""
    tier_env = ({"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(root / "dump"),
                 "CUDA_VISIBLE_DEVICES": ""} if tier == "cpu" else {"CUDA_VISIBLE_DEVICES": physical_gpu(gpu)})
    return _scrubbed_env({
        "TMPDIR": str(root / "tmp"), "CUTE_DSL_DISABLE_FILE_CACHING": "1", "CUTE_DSL_CACHE_DIR": str(root / "cute_cache"),
        "XDG_CACHE_HOME": str(root / "cache"), "TVM_HOME": str(root / "tvm"), "HOME": str(root / "home"),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **tier_env,
    }, code_root(limits.sandbox.run_as))


def spawn_worker(tier: str, gpu: int, limits: Limits, preload: bool = False,
                 server: ForkServer | None = None) -> _Worker:
    """A fresh worker process in a fresh evaluation folder, waiting for its job: exec'd, or forked by
    ``server`` (started by ``start_fork_server`` for the same tier, GPU and limits)."""
    root = _eval_folder()
    try:
        return _Worker(root, limits, _worker_env(tier, gpu, root, limits), preload, server)
    except RuntimeError:
        shutil.rmtree(root, ignore_errors=True)
        raise


def start_fork_server(tier: str, gpu: int, limits: Limits) -> ForkServer:
    """A fork server whose workers get what ``spawn_worker`` gives them (it imports in the background).
    CuTe DSL fixes its dump folder on import: a relative one lands in each worker's own folder."""
    folder = _eval_folder("mkb-forkserver-")
    server = ForkServer({**_worker_env(tier, gpu, folder, limits), "CUTE_DSL_DUMP_DIR": "../dump",
                         "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}, folder)
    server.gpu = _host_gpu(gpu) if tier == "gpu" else "-"
    return server


class _Held:
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


def _phase1(w: _Worker, held: _Held, budget: float, rec: VerificationRecord) -> tuple[dict[str, Any] | None, str]:
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
        def handled(m: dict[str, Any], seen: int = seen) -> bool:       # a lane request already answered
            return m.get("kind") == "lane" and (not isinstance(m.get("n"), int) or m["n"] <= seen)

        msg, how = w.wait_for(("phase1", "final", "lane"), left, unless=handled)
        if not msg or msg["kind"] != "lane":
            break
        seen = msg["n"]
        if msg.get("want") == "release":
            held.release()
        elif msg.get("want") == "step_aside":       # between draws, the worker's GPU work done
            held.step_aside()
            w.open_gate(True)
        else:
            held.acquire()
            w.open_gate(True)
    rec.stages_s["worker_phase1"] = round(time.perf_counter() - t0, 3)
    if seen:
        rec.stages_s["compile_lane_wait"] = round(held.waited, 3)
    return msg, how


def _judge_phase1(rec: VerificationRecord, judge: Any, job: dict[str, Any], msg: dict[str, Any], out: Path,
                  between: Callable[[], float] = lambda: 0.0) -> bool:
    """Correctness of the 5 draws and the DSL-dependence draw; False (status set) when they fail.
    ``between`` runs between checks (the lane's step aside; its seconds are not judging time)."""
    rec.stages_s.update(import_s=round(msg["import_s"], 3), first_call_s=round(msg["first_call_s"], 3),
                        correctness_draws_s=round(msg["correctness_s"], 3))
    t0 = time.perf_counter()
    for d in msg["draws"]:
        t0 += between()
        bad = judge.check(job["correctness_seeds"][d["draw"]], out / f"corr_{d['draw']}.pt", d["input_digests"])
        if bad:
            reused = " (inputs refilled in the previous draw's buffers)" if d["draw"] in REUSE_DRAWS else ""
            rec.status, rec.stage = "incorrect", "correctness"
            rec.message = f"correctness draw {d['draw'] + 1} of {CORRECTNESS_DRAWS}{reused}: {bad}"
            rec.correctness.update(draws_passed=d["draw"], max_error=bad.max_error, allowance=bad.allowance)
            return False
    addrs = [tuple(d["addresses"]) for d in msg["draws"]]
    rec.correctness.update(draws_passed=CORRECTNESS_DRAWS, launches=[d["launches"] for d in msg["draws"]],
                           distinct_input_addresses=len(set(addrs)))
    t0 += between()
    if msg["nodsl"] == "returned" and judge.check(job["nodsl_seed"], out / "nodsl.pt") is None:
        rec.status, rec.stage = "no_dsl_kernel", "dsl_dependence"
        rec.message = ("the output is still correct with every DSL launch suppressed and free memory poisoned: "
                       "the DSL kernel does not compute the result")
        return False
    rec.correctness["dsl_dependence"] = f"fails without the DSL ({msg['nodsl']})"
    rec.stages_s["judge_correctness"] = round(time.perf_counter() - t0, 3)
    return True
