"""The timing procedure's order of operations, with the CUDA primitives replaced by a recorder."""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch

from mkb_eval.harness import timing


class Recorder:
    """Stands in for the CUDA clock: logs calls; every event pair spans ``span`` ms."""

    def __init__(self, span: float = 0.5) -> None:
        self.log: list[tuple[str, Any]] = []
        self.span = span

    def clock(self) -> timing.Clock:
        return timing.Clock(event=lambda enable_timing: object(), elapsed=lambda a, b: self.span,
                            record=lambda ev: self.log.append(("record", ev)),
                            synchronize=lambda: self.log.append(("sync", None)),
                            sleep=lambda n: self.log.append(("sleep", n)))


def _no_flush(monkeypatch: Any) -> None:
    monkeypatch.setattr(timing, "l2_flusher", lambda device: lambda: None)


def test_collector_paused_nests_across_threads_and_restores() -> None:
    assert gc.isenabled()
    inner_done, outer_release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with timing.collector_paused():
            seen.append(gc.isenabled())
            inner_done.set()
            outer_release.wait(5)
        seen.append(gc.isenabled())       # the first holder has not finished yet

    with timing.collector_paused():
        t = threading.Thread(target=other)
        t.start()
        inner_done.wait(5)
        outer_release.set()
        t.join(5)
        assert not gc.isenabled()
    assert seen == [False, False]
    assert gc.isenabled()


def test_collector_paused_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with timing.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_time_draws_runs_every_call_with_the_collector_paused(monkeypatch: Any) -> None:
    _no_flush(monkeypatch)
    states: list[bool] = []

    def fn(x: Any) -> Any:
        states.append(gc.isenabled())
        return x

    res = timing.time_draws(fn, lambda s: [torch.zeros(1)], [1, 2], [3, 4, 5], Recorder().clock(), torch.device("cpu"))
    assert states == [False] * 5 and gc.isenabled()
    assert res.times_ms == [0.5, 0.5, 0.5]


def test_stream_time_queues_the_call_behind_a_sleep_that_outlasts_the_host_path(monkeypatch: Any) -> None:
    _no_flush(monkeypatch)
    rec = Recorder(span=0.5)                       # calibration: 1e6 cycles take 0.5 ms
    calls: list[int] = []

    def fn(x: Any) -> None:
        calls.append(len(rec.log))

    ms = timing.stream_time_ms(fn, lambda s: [s], [1, 2], rec.clock(), torch.device("cpu"), host_ms=0.1)
    assert ms == 0.5 and len(calls) == 2
    kinds = [k for k, _ in rec.log]
    first = kinds.index("sleep", 3)                 # after the calibration's own sleep
    # per draw: sync, sleep, start, (the call), end, sync: the clock starts after the sleep is queued
    assert kinds[first - 1:first + 4] == ["sync", "sleep", "record", "record", "sync"]
    assert calls[0] == first + 2                   # the call ran between the two records
    gate = rec.log[first][1]
    assert gate == int(1_000_000 / 0.5 * (0.2 + 3 * 0.1))   # 0.5 ms of sleep: cycles for 0.2 + 3 x host ms


def test_stream_time_gate_is_capped_for_a_slow_host_path(monkeypatch: Any) -> None:
    _no_flush(monkeypatch)
    rec = Recorder(span=0.5)
    timing.stream_time_ms(lambda x: None, lambda s: [s], [1], rec.clock(), torch.device("cpu"), host_ms=500.0)
    sleeps = [n for k, n in rec.log if k == "sleep"]
    assert sleeps[1] == int(1_000_000 / 0.5 * 10.0)       # 10 ms, not 1.5 s


def test_cpu_probe_times_the_same_work_each_call(monkeypatch: Any) -> None:
    ticks = iter(range(0, 100, 2))           # every piece of work takes 2 s on this fake clock
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    assert timing.cpu_probe_ms(reps=3) == 2000.0
    monkeypatch.undo()
    assert 0 < timing.cpu_probe_ms() < 1e4    # and on the real clock it finishes
