"""The evaluation worker: runs one untrusted candidate in a fresh process.

It makes inputs from the seeds it is given, calls ``solve``, and hands outputs to the parent
through files; it never computes an expected output, so nothing in this process can find one.
Two gates: after start-up and imports the worker waits until its GPU's lane admits correctness
work; phase 1 (correctness draws + the DSL-dependence draw) then ends by waiting again while the
parent judges and waits for the GPU to be free for timing. The timing gate brings the timed draws'
seeds (they are in no job sent earlier); after the event-timed draws the worker serves the parent's
attested windows (:mod:`mkb_eval.harness.attest`) on the same gate socket (:mod:`.worker_phase2`).
Before every message the worker checks that its own harness functions are still the objects it
captured before the candidate was imported (evidence only: the verdict never rests on this process). Usage:
``python -m mkb_eval.harness.worker -`` with the job as JSON on stdin.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mkb_eval.harness import protocol
from mkb_eval.harness.channel import Channel
from mkb_eval.harness.job import Job
from mkb_eval.harness.worker_phase2 import Tools, read_op, serve_windows
from mkb_eval.harness.worker_stop import Stop, classify, format_exc, read_job


def _import_file(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _check_guard(watch: Any, where: str) -> None:
    """policy_violation when the candidate called into the task or removed the guard (``guard``)."""
    found = watch.check()
    if found:
        raise Stop("policy_violation", f"{'; '.join(found)} — detected {where}",
                   flags=["reference_call" if watch.violations else "guard_tamper"])


def _preload() -> None:
    """A warm-pool worker imports torch and every DSL's toolchain while it waits for a job."""
    import torch
    import torch._dynamo  # noqa: F401

    from mkb_eval.dsl import SPECS

    for dsl in SPECS:
        try:
            from mkb_eval.harness import observe

            observe.preload(dsl)
        except Exception:  # noqa: BLE001 - the job's own import reports a broken toolchain
            pass


def _pin(cpus: list[int] | None) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError:
            pass


class _Guard:
    """The harness functions this process relies on, captured before the candidate is imported: each
    object and its code. A replacement (module attribute, class attribute, or swapped ``__code__``) is
    reported as ``harness_patch``; the parent's verdict does not depend on this check."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any, str, Any, Any]] = []
        self.send_fn: Any = None
        self.send_code: Any = None
        self.encode_fn: Any = None
        self.encode_code: Any = None

    def capture(self) -> None:
        from mkb_eval.harness import attest, tensors, timing, worker_phase2

        me = sys.modules[__name__]
        plan = [(Channel, ("send", "__init__")),
                (me, ("run", "main", "_gpu_tier", "_correctness_draws", "serve_windows", "read_op", "_cpu_tier")),
                (worker_phase2, ("serve_windows", "_event_draws", "read_op")),
                (timing, ("time_draws", "_time_draws", "stream_time_ms", "l2_flusher", "cpu_probe_ms",
                          "collector_paused")),
                (tensors, ("save", "snapshot", "walk", "digests", "digest", "to_device")),
                (attest, ("worker_window", "commitments", "row_sums", "combine", "_weights", "_words", "warm_allocator", "warm_digest")),
                (protocol, ("encode", "progress", "decode_op", "digests_reply", "error_reply")),
                (os, ("write", "read", "_exit")), (json, ("dumps", "loads"))]
        for owner, names in plan:
            for name in names:
                fn = getattr(owner, name)
                self.items.append((f"{getattr(owner, '__name__', owner)}.{name}", owner, name, fn,
                                   getattr(fn, "__code__", None)))
        self.send_fn, self.send_code = Channel.send, Channel.send.__code__
        self.encode_fn, self.encode_code = protocol.encode, protocol.encode.__code__

    def replaced(self, chan: Channel | None = None) -> list[str]:
        bad = ["channel.send (on the instance)"] if chan is not None and "send" in vars(chan) else []
        for label, owner, name, fn, code in self.items:
            now = getattr(owner, name, None)
            if now is not fn or (code is not None and getattr(now, "__code__", None) is not code):
                bad.append(label)
        return bad

    def send(self, chan: Channel, msg: protocol.Message) -> None:
        """Send through the captured ``Channel.send`` and ``protocol.encode``, their code restored,
        whatever was done to them."""
        fn, enc = self.send_fn or Channel.send, self.encode_fn or protocol.encode
        for f, code in ((fn, self.send_code), (enc, self.encode_code)):
            if code is not None:
                f.__code__ = code
        chan.__dict__.pop("send", None)
        fn(chan, **enc(msg))


GUARD = _Guard()


def main(argv: list[str]) -> int:
    ready = os.environ.pop("MKB_WORKER_PRELOAD", None)
    if ready is not None:
        _preload()
        try:                                 # tell the pool: imports done (it starts spares after)
            os.write(int(ready), b"1")
            os.close(int(ready))
        except (OSError, ValueError):
            pass
    data = sys.stdin.read()                  # the seeds never touch the disk
    sys.stdin.close()
    if not data.strip():                     # a warm worker whose parent left without a job
        os._exit(0)
    job = read_job(data)                     # a malformed one ends the worker here, saying which field
    chan = Channel(job.channel, job.sentinel)
    stage: Any = "start"                     # a protocol.Stage

    def report(record: Any, **kw: Any) -> None:    # progress and final messages carry the worker's CPU seconds
        bad = GUARD.replaced(chan)
        if bad:                                    # evidence: say so through the captured send, then stop
            GUARD.send(chan, protocol.Final(status="policy_violation", stage=stage, flags=["harness_patch"],
                                            message=f"harness functions replaced in the worker ({', '.join(bad[:8])})",
                                            cpu=round(time.process_time(), 3)))
            os._exit(0)
        chan.send(**protocol.encode(record(cpu=round(time.process_time(), 3), **kw)))

    def progress(s: str, **kw: Any) -> None:
        nonlocal stage
        stage = s
        report(protocol.progress, stage=s, t=time.time(), **kw)

    _pin(job.work_cpus)                      # start-up and compilation stay off the timing cores
    from mkb_eval.harness.confine import outside_write
    from mkb_eval.harness.sandbox import network_isolated

    try:
        progress("setup", network="isolated" if network_isolated() else "shared",
                 outside_write=outside_write(Path(job.out_dir).parent))        # before the candidate exists
        result = run(job, chan, progress)
        report(protocol.Final, status=result.pop("status"), stage="done", **result)
    except Stop as s:
        report(protocol.Final, status=s.status, stage=stage, message=s.message, **s.extra)
    except BaseException as e:  # noqa: BLE001 - everything the candidate raises becomes a status
        report(protocol.Final, status="runtime_error", stage=stage, message=format_exc(e))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: candidate atexit hooks and destructors do not run


def run(job: Job, chan: Channel, progress: Any) -> dict[str, Any]:
    """The task, the DSL's observer and the guard's capture, then the candidate's import, then its tier."""
    import torch
    import torch._dynamo  # rewraps torch.manual_seed (lazily, e.g. on the first profiler use): before capturing

    from mkb_eval.harness import attest, observe, tensors
    from mkb_eval.harness.timing import Clock, cpu_probe_ms, stream_time_ms, time_draws

    tools = Tools(time_draws, stream_time_ms, cpu_probe_ms, attest.worker_window, attest.warm_allocator,
                  tensors.save, tensors.walk)                # captured before the candidate exists

    tier = job.tier
    device = torch.device(job.device)
    clock = Clock()                                     # captured before the candidate exists
    manual_seed = torch.manual_seed
    problem = _import_file(Path(job.problem_dir) / "reference.py", "mkb_task")
    make_inputs = problem.make_inputs
    size = job.size
    from mkb_eval.harness import guard

    watch = guard.install(problem)                      # before the candidate exists: calls into the task are caught

    from mkb_eval.harness.tolerance import reference_numerics

    def make(seed: int) -> list[Any]:
        manual_seed(seed)
        with reference_numerics(), watch.harness():  # the same numerics flags as the judge, whatever solve set
            return make_inputs(size, job.device)

    out_dir = Path(job.out_dir)
    progress("dsl_import")
    observe.install(job.dsl)
    log = observe.LOG
    if tier == "cpu":
        log.suppressed = True                             # a compiled kernel cannot run without a GPU

    GUARD.capture()
    progress("kernel_import")
    t0 = time.perf_counter()
    try:
        cand = _import_file(Path(job.kernel_path), "mkb_candidate")
    except BaseException as e:  # noqa: BLE001
        _check_guard(watch, "at import")
        raise Stop(classify(e, False), format_exc(e)) from None
    solve = getattr(cand, "solve", None)
    if not callable(solve):
        raise Stop("compile_error", "kernel.py defines no callable 'solve'")
    import_s = time.perf_counter() - t0

    def call(inputs: list[Any], what: str) -> tuple[Any, int]:
        before = log.total()
        try:
            out = solve(*inputs)
        except BaseException as e:  # noqa: BLE001
            check_tamper(what)
            raise Stop(classify(e, log.total() > before), f"{what}: " + format_exc(e)) from None
        return out, log.total() - before

    def check_tamper(where: str) -> None:
        _check_guard(watch, where)
        bad = clock.tampered()
        if torch.manual_seed is not manual_seed:
            bad.append("torch.manual_seed")
        if bad:
            raise Stop("policy_violation", f"timing/RNG primitives replaced ({', '.join(bad)}) — detected {where}",
                       flags=["timing_patch"])

    check_tamper("after import")
    if tier == "cpu":
        result = _cpu_tier(job, make, call, log, progress, import_s)
        check_tamper("before the report")
        return result

    return _gpu_tier(job, chan, progress, solve, make, call, check_tamper, clock, device, log, tensors, tools, import_s,
                     out_dir)


def _gpu_tier(job: Job, chan: Channel, progress: Any, solve: Any, make: Any, call: Any, check_tamper: Any,
              clock: Any, device: Any, log: Any, tensors: Any, tools: Tools, import_s: float, out_dir: Path) -> dict[str, Any]:
    """Gate 1, phase 1 and its report, the timing gate, phase 2. All but ``solve`` were bound before the
    candidate was imported (``run``)."""
    # ---- gate 1: start and imports overlap anything; GPU work waits for the GPU's lane ----------
    progress("ready")
    if os.read(job.gate_fd, 2) != protocol.GO:
        return {"status": "stopped", "message": "stopped by the parent before phase 1"}
    # the last draw's inputs stay allocated until the DSL-dependence draw's inputs replace them (re-timing: through phase 2)
    draws, first_call_s, corr_s, inputs = _correctness_draws(job, chan, progress, make, call, check_tamper, clock, log,
                                                             tensors, out_dir)

    # ---- the DSL-dependence draw: launches suppressed, free memory poisoned ------------------
    poisoned = 0
    nodsl: protocol.NoDsl = "skipped"
    if job.nodsl_seed is not None:                    # (a re-timing job skips it: verified before)
        progress("dsl_dependence")
        poisoned = tensors.poison_free_memory(device)
        inputs = make(job.nodsl_seed)
        log.suppressed = True
        try:
            out = solve(*inputs)
            snap = tensors.snapshot(out)
            clock.synchronize()
            tensors.save(snap, out_dir / "nodsl.pt")
            nodsl = "returned"
            del out, snap
        except BaseException:  # noqa: BLE001 - failing without the DSL is the expected outcome
            nodsl = "raised"
        finally:
            log.suppressed = False
        del inputs
    try:
        clock.synchronize()
    except BaseException as e:  # noqa: BLE001
        raise Stop("runtime_error", "the CUDA context failed after the DSL-dependence draw: " + format_exc(e)) from None

    log.on_compile = None                # compiles from here on (in timing) are the candidate's time
    check_tamper("before the phase-1 report")
    chan.send(**protocol.encode(protocol.Phase1Report(
        stage="correctness", draws=draws, nodsl=nodsl, poisoned_bytes=poisoned, import_s=import_s,
        first_call_s=first_call_s, correctness_s=corr_s)))
    # ---- gate: the parent judges phase 1; the timing gate brings the first timing op --------------
    op = read_op(job.gate_fd)
    if op is None:
        return {"status": "stopped", "message": "stopped by the parent after phase 1"}
    if job.timing_cpu is not None:
        _pin([job.timing_cpu])                # the timed host call path gets this GPU's reserved core
    return serve_windows(job, op, solve, make, clock, device, log, progress, check_tamper, tools)


def _correctness_draws(job: Job, chan: Channel, progress: Any, make: Any, call: Any, check_tamper: Any,
                       clock: Any, log: Any, tensors: Any, out_dir: Path
                       ) -> tuple[list[protocol.Draw], float | None, float, list[Any] | None]:
    """Phase 1's correctness draws, their outputs saved for the judge: (the draws' report, the first
    call's seconds, the draws' seconds, the last draw's inputs). The lane requests of compiles stay
    installed until the caller removes them after the DSL-dependence draw."""
    # a compile (CPU work) hands the GPU lane back, so timing elsewhere on this GPU need not wait
    # for it; after the compile the worker waits until the parent holds the lane for it again.
    # Between draws the worker offers the lane to a waiting timed phase (the parent decides).
    lane_events, lane_wait = 0, 0.0

    def lane(want: protocol.LaneWant) -> None:
        nonlocal lane_events, lane_wait
        lane_events += 1
        if want != "shared":
            clock.synchronize()                           # nothing of ours left queued on the GPU
        chan.send(**protocol.encode(protocol.Lane(n=lane_events, want=want)))
        if want != "release":
            t = time.perf_counter()
            if os.read(job.gate_fd, 2) != protocol.GO:
                os._exit(0)                               # the parent stopped this evaluation
            lane_wait += time.perf_counter() - t          # not the candidate's time

    def on_compile(event: str) -> None:
        lane("release" if event == "start" else "shared")

    log.on_compile = on_compile
    draws: list[protocol.Draw] = []
    inputs: list[Any] | None = None
    prev: list[Any] | None = None
    t_corr = time.perf_counter()
    first_call_s = None
    for i, seed in enumerate(job.correctness_seeds):
        progress("correctness", draw=i)
        inputs = make(seed)
        if i in job.reuse_draws and prev is not None:
            inputs = tensors.refill_(prev, inputs)        # same addresses, new content
        addrs = [t.data_ptr() for t in tensors.walk(inputs)]
        t1, waited = time.perf_counter(), lane_wait
        out, launched = call(inputs, f"correctness draw {i + 1}")
        snap = tensors.snapshot(out)                       # on the caller's stream, no sync first
        clock.synchronize()
        if first_call_s is None:
            first_call_s = time.perf_counter() - t1 - (lane_wait - waited)
        if launched == 0:
            raise Stop("no_dsl_kernel", f"correctness draw {i + 1}: solve launched no {job.dsl} kernel "
                                        f"(compiled functions created: {log.compiled[job.dsl]})")
        tensors.save(snap, out_dir / f"corr_{i}.pt")
        draws.append(protocol.Draw(draw=i, launches=launched, input_digests=tensors.digests(inputs), addresses=addrs))
        check_tamper(f"in correctness draw {i + 1}")
        prev = inputs
        del out, snap
        lane("step_aside")
    corr_s = time.perf_counter() - t_corr - lane_wait
    return draws, first_call_s, corr_s, inputs


def _cpu_tier(job: Job, make: Any, call: Any, log: Any, progress: Any, import_s: float) -> dict[str, Any]:
    """Compile-only: run solve on smoke CPU inputs with launches intercepted, then check artifacts."""
    progress("compile_only")
    inputs = make(job.correctness_seeds[0])
    t0 = time.perf_counter()
    err: str | None = None
    try:
        out, _ = call(inputs, "solve on CPU inputs")
        from mkb_eval.harness import tensors

        tensors.save(out, Path(job.out_dir) / "cpu_out.pt")        # structure is checkable, values are not
    except Stop as s:
        if log.total() == 0:
            raise
        err = s.message                           # it got past the launch; what follows needs a GPU
    compile_s = time.perf_counter() - t0
    if log.total() == 0:
        raise Stop("no_dsl_kernel", f"solve returned without calling a compiled {job.dsl} function")
    from mkb_eval.harness import compile_check

    progress("artifacts")
    arts = compile_check.check_artifacts(job.dsl, log, Path(job.dump_dir))
    if arts.get("error"):
        raise Stop("compile_error", arts["error"], artifacts=arts)
    return {"status": "unverified", "artifacts": arts, "launches": log.total(), "compile_s": compile_s,
            "import_s": import_s, "after_launch_error": err}


if __name__ == "__main__":
    main(sys.argv)
