"""Phase 2 in the worker: the parent's timing operations on the gate socket, served one after another
(event-timed draws, holding a window's memory, attested windows, saving the outputs the parent chose).
The harness functions it calls come bound before the candidate was imported (:class:`Tools`)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval.harness import protocol
from mkb_eval.harness.job import Job
from mkb_eval.harness.worker_stop import Stop, classify, format_exc


def read_op(fd: int) -> protocol.Op | None:
    """The parent's next operation on the gate socket (one packet of JSON); None: stop, end, or the parent left."""
    from mkb_eval.harness.gate import MAX_PACKET

    return protocol.decode_op(os.read(fd, MAX_PACKET))


@dataclass
class Tools:
    """Harness functions phase 2 calls, bound before the candidate is imported."""

    time_draws: Any
    stream_time_ms: Any
    cpu_probe_ms: Any
    worker_window: Any
    warm_allocator: Any
    save: Any
    walk: Any


def serve_windows(job: Job, op: protocol.Op | None, solve: Any, make: Any, clock: Any, device: Any,
                  log: Any, progress: Any, check_tamper: Any, tools: Tools) -> dict[str, Any]:
    """Phase 2: the parent's timing operations, one after another, until it says ``end``:
    ``events`` (the event-timed draws on the seeds it brings), ``prep`` (hold the window's memory once),
    ``window`` (an attested window: :func:`attest.worker_window`), ``save`` (the window outputs it chose)."""
    fd, out_dir = job.gate_fd, Path(job.out_dir)
    sizes: list[int] = []
    outs: list[Any] = []
    n_events = 0
    while op is not None:
        if isinstance(op, protocol.EventsOp):
            n_events += 1
            res, sizes = _event_draws(op, solve, make, clock, device, log, progress, check_tamper, tools)
            progress("events", n=n_events, **res)
        elif isinstance(op, protocol.PrepOp):
            outs = []
            try:
                tools.warm_allocator(sizes, int(op.calls) + 1, device)
            except BaseException as e:  # noqa: BLE001 - too little memory for the window: the parent decides
                os.write(fd, protocol.error_reply("holding the window's memory: " + format_exc(e, 1500)))
            else:
                os.write(fd, protocol.PREPPED)
        elif isinstance(op, protocol.WindowOp):
            outs = []
            try:
                outs, _ = tools.worker_window(fd, op, make, solve, clock.synchronize)
            except BaseException as e:  # noqa: BLE001
                raise Stop(classify(e, True), "timed window: " + format_exc(e)) from None
            check_tamper("after a timed window")
        elif isinstance(op, protocol.SaveOp):
            for i in op.which:
                tools.save(outs[int(i)], out_dir / f"{op.tag}_{int(i)}.pt")
            outs = []
            os.write(fd, protocol.SAVED)
        op = read_op(fd)
    progress("report")
    return {"status": "timed", "windows_served": n_events}


def _event_draws(op: protocol.EventsOp, solve: Any, make: Any, clock: Any, device: Any, log: Any, progress: Any,
                 check_tamper: Any, tools: Tools) -> tuple[dict[str, Any], list[int]]:
    """The event-timed draws of one ``events`` op (the worker's report: evidence beside the attested
    window) and the byte sizes of one input and output set (for ``prep``)."""
    time_draws, stream_time_ms, cpu_probe_ms = tools.time_draws, tools.stream_time_ms, tools.cpu_probe_ms

    launch_counts: list[int] = []
    host_s: list[float] = []
    last: list[Any] = []
    in_sizes: list[int] = []

    def make_sized(seed: int) -> list[Any]:             # outside the timed region: one set's input bytes, once
        inputs = make(seed)
        if not in_sizes:
            in_sizes.extend(t.numel() * t.element_size() for t in tools.walk(inputs))
        return inputs

    def timed(*inputs: Any) -> Any:
        before = log.total()
        t = time.perf_counter()
        out = solve(*inputs)
        host_s.append(time.perf_counter() - t)        # until solve returns: the host call path
        launch_counts.append(log.total() - before)
        return out

    def keep(i: int, out: Any) -> Any:
        if not last:
            last.append([t.numel() * t.element_size() for t in tools.walk(out)])
        return None

    warmup, timing = [int(x) for x in op.warmup_seeds], [int(x) for x in op.timing_seeds]
    probe = [cpu_probe_ms()]
    t_time = time.perf_counter()
    try:
        res = time_draws(timed, make_sized, warmup, timing, clock, device, keep=keep,
                         on_draw=lambda phase, k: progress(phase, draw=k) if k % 10 == 0 else None)
    except BaseException as e:  # noqa: BLE001
        check_tamper("in timing")
        raise Stop(classify(e, True), "timing: " + format_exc(e)) from None
    timing_s = time.perf_counter() - t_time
    probe.append(cpu_probe_ms())
    check_tamper("after timing")
    if not launch_counts or min(launch_counts) == 0:
        raise Stop("no_dsl_kernel", "a timed call launched no DSL kernel (results were served without the DSL)")
    timed_host = host_s[len(warmup):]
    host_ms = 1e3 * statistics.median(timed_host) if timed_host else None
    dev_ms = None
    if op.device:
        progress("device_time")
        try:                                  # informative: a failure here leaves the verdict as it is
            dev_ms = stream_time_ms(solve, make, timing[:10], clock, device, host_ms or 0.0)
        except BaseException:  # noqa: BLE001
            dev_ms = None
    check_tamper("before the report")
    return ({"times_ms": res.times_ms, "device_ms": dev_ms, "launches_per_call": sorted(set(launch_counts)),
             "timing_s": timing_s, "host_call_ms": host_ms, "cpu_probe_ms": max(probe)},
            in_sizes + (last[0] if last else []))

