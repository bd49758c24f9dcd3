"""One timing procedure for candidates and baselines.

For each timed draw: fresh inputs (made outside the timed region, the previous draw's inputs
still alive so addresses differ), L2 flushed, then ``sync; start; fn(*inputs); device-wide sync;
end; sync``. The device-wide sync inside the event pair counts work on every stream. Result:
the median of the timed draws in milliseconds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Clock:
    """Timing primitives captured before any candidate code is imported."""

    event: Any = field(default_factory=lambda: torch.cuda.Event)
    elapsed: Any = field(default_factory=lambda: torch.cuda.Event.elapsed_time)
    record: Any = field(default_factory=lambda: torch.cuda.Event.record)
    synchronize: Any = field(default_factory=lambda: torch.cuda.synchronize)
    manual_seed: Any = field(default_factory=lambda: torch.manual_seed)

    def tampered(self) -> list[str]:
        """Names of captured primitives that are no longer what torch exposes."""
        now = {"torch.cuda.Event": torch.cuda.Event, "Event.elapsed_time": torch.cuda.Event.elapsed_time,
               "Event.record": torch.cuda.Event.record, "torch.cuda.synchronize": torch.cuda.synchronize,
               "torch.manual_seed": torch.manual_seed}
        mine = {"torch.cuda.Event": self.event, "Event.elapsed_time": self.elapsed, "Event.record": self.record,
                "torch.cuda.synchronize": self.synchronize, "torch.manual_seed": self.manual_seed}
        return [k for k in now if now[k] is not mine[k]]


def l2_flusher(device: torch.device) -> Callable[[], None]:
    size = 2 * max(int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)), 64 << 20)
    buf = torch.empty(size, dtype=torch.uint8, device=device)

    def flush() -> None:
        buf.zero_()

    return flush


@dataclass
class TimingResult:
    times_ms: list[float]
    rechecked: dict[int, Any]

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.times_ms))

    @property
    def cv(self) -> float:
        m = statistics.mean(self.times_ms)
        return float(statistics.pstdev(self.times_ms) / m) if m > 0 else 0.0


def time_draws(fn: Callable[..., Any], make: Callable[[int], list[Any]], warmup_seeds: Sequence[int],
               timing_seeds: Sequence[int], clock: Clock, device: torch.device,
               keep: Callable[[int, Any], Any] | None = None,
               on_draw: Callable[[str, int], None] | None = None) -> TimingResult:
    """Time ``fn`` over fresh draws; ``keep(i, out)`` may snapshot outputs of chosen draws."""
    flush = l2_flusher(device)
    prev: list[Any] | None = None
    for k, seed in enumerate(warmup_seeds):
        if on_draw:
            on_draw("warmup", k)
        inputs = make(seed)
        fn(*inputs)
        prev = inputs
    clock.synchronize()
    times: list[float] = []
    kept: dict[int, Any] = {}
    for i, seed in enumerate(timing_seeds):
        if on_draw:
            on_draw("timing", i)
        inputs = make(seed)          # previous draw's inputs still referenced: distinct addresses
        prev = None
        flush()
        start, end = clock.event(enable_timing=True), clock.event(enable_timing=True)
        clock.synchronize()
        clock.record(start)
        out = fn(*inputs)
        clock.synchronize()
        clock.record(end)
        clock.synchronize()
        times.append(float(clock.elapsed(start, end)))
        if keep is not None:
            snap = keep(i, out)
            if snap is not None:
                kept[i] = snap
        prev = inputs
        del out
    del prev
    return TimingResult(times, kept)


def device_time_ms(fn: Callable[..., Any], inputs_list: list[list[Any]]) -> tuple[float | None, list[str]]:
    """GPU time of the kernels one call launches (CUPTI via torch.profiler), mean over the calls.

    Separates kernel quality from host call-path overhead. One profiler session covers all
    calls: starting and stopping the profiler costs far more than the kernels. Returns
    (ms or None, kernel names).
    """
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None, []
    if not inputs_list:
        return None, []
    names: dict[str, None] = {}
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for inputs in inputs_list:
                fn(*inputs)
                torch.cuda.synchronize()
        total_us = 0.0
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                dur = float(ev.time_range.elapsed_us())
                if dur > 0:
                    total_us += dur
                    names.setdefault(ev.name, None)
    except Exception:
        return None, []
    return total_us / 1e3 / len(inputs_list), list(names)
