"""A stand-in for ``mkb_eval.harness.retime.retime`` (same signature and result shape) with a fake clock.

``FakeRetime(speed)`` times each kernel as ``speed(label, sha256) * drift(t)`` with a seeded noise,
where t counts the windows timed so far: a clock whose machine slows down over the run, which
interleaved rounds with the order alternated must cancel out of a paired ratio. ``tier="cpu"``
gives what the CPU tier gives: every window ``unverified``, no times.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RetimeWindow:
    label: str
    round: int
    position: int
    kernel_ms: float | None
    attested_ms: float | None
    worker_event_ms: float | None
    device_ms: float | None
    status: str
    message: str = ""
    span_per_call_ms: float | None = None
    commit_ms: float | None = None


@dataclass
class RetimeResult:
    problem_id: int
    labels: list[str]
    windows: list[RetimeWindow]
    env: dict
    stages_s: dict[str, float]
    tier: str


@dataclass
class FakeRetime:
    """Callable like ``retime``; records every call."""

    speed: Callable[[str, str], float] = lambda label, sha: 1.0
    tier: str = "gpu"
    noise: float = 0.005                  # relative sd of a window's time
    drift_per_window: float = 0.01        # the clock slows by 1% per window timed
    alternate: bool = True
    fail_on: set[int] = field(default_factory=set)   # problem ids whose re-timing raises (harness failure)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, problem: Any, kernels: dict[str, tuple[str, Path]], *, rounds: int = 5, warmup: int = 5,
                 draws: int = 20, gpu: int = 0, lane: Any = None, limits: Any = None, pool: Any = None,
                 seed: int | None = None, quiet: Any = None) -> RetimeResult:
        alone = None
        if quiet is not None:                  # the harness's sections: start and check busy, the rounds quiet
            with quiet.busy():
                pass
            with quiet.quiet():
                alone = quiet.busy_now == 0
        with self._lock:
            self.calls.append({"problem_id": problem.id, "labels": sorted(kernels), "rounds": rounds, "gpu": gpu,
                               "lane": lane, "seed": seed, "quiet_alone": alone})
        if problem.id in self.fail_on:
            raise RuntimeError(f"fake harness failure re-timing problem {problem.id}")
        rng = random.Random(seed)
        labels = sorted(kernels)
        windows: list[RetimeWindow] = []
        t = 0
        for r in range(rounds):
            order = labels if (not self.alternate or r % 2 == 0) else labels[::-1]
            for pos, label in enumerate(order):
                dsl, path = kernels[label]
                sha = hashlib.sha256(Path(path).read_text().encode()).hexdigest()
                if self.tier == "cpu":
                    windows.append(RetimeWindow(label, r, pos, None, None, None, None, "unverified",
                                                "CPU tier: nothing timed"))
                    continue
                base = self.speed(label, sha) * (1 + self.drift_per_window * t)
                ms = base * (1 + rng.gauss(0, self.noise))
                dev = base * 0.8 * (1 + rng.gauss(0, self.noise / 5))
                windows.append(RetimeWindow(label, r, pos, ms, ms, ms, dev, "ok"))
                t += 1
        return RetimeResult(problem.id, labels, windows, {"fake": True}, {"total": 0.01}, self.tier)
