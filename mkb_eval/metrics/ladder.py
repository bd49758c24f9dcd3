"""Rates over attempts: R@t ladders and S (as in the original), fast_p and geomean speedup (KernelBench).

All rates are shares of a list of outcomes; an empty list gives None, never 0, so a missing arm
can be told apart from an arm that failed everything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from mkb_eval.metrics.inputs import AttemptOutcome

THRESHOLDS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0)
"""Speedup thresholds t of R@t (the original's SPEED_THRESHOLDS)."""
RATE_KEYS: tuple[str, ...] = tuple(f"R@{t:g}" for t in THRESHOLDS)
LADDER_KEYS: tuple[str, ...] = (*RATE_KEYS, "S")
FAST_P_THRESHOLDS: tuple[float, ...] = (0.0, 1.0, 2.0)

Ladder = dict[str, float | None]


def share(count: int, n: int) -> float | None:
    """count / n, or None for an empty group."""
    return count / n if n else None


def ladder(outcomes: Sequence[AttemptOutcome]) -> Ladder:
    """R@t for every threshold and S = 100 * mean of the five R@t (None when empty)."""
    n = len(outcomes)
    out: Ladder = {key: share(sum(o.attains(t) for o in outcomes), n) for key, t in zip(RATE_KEYS, THRESHOLDS, strict=True)}
    rates = [out[k] for k in RATE_KEYS]
    out["S"] = None if n == 0 else 100.0 * math.fsum(r for r in rates if r is not None) / len(THRESHOLDS)
    return out


def lift(base: Mapping[str, float | None], skill: Mapping[str, float | None]) -> Ladder:
    """skill - base for every ladder key; None where either side is None."""
    return {
        k: (None if base.get(k) is None or skill.get(k) is None else skill[k] - base[k])  # type: ignore[operator]
        for k in LADDER_KEYS
    }


def fast_p(outcomes: Sequence[AttemptOutcome], p: float) -> float | None:
    """KernelBench fast_p: share of attempts that passed with speedup strictly above p."""
    n = len(outcomes)
    return share(sum(o.passed and o.speedup is not None and o.speedup > p for o in outcomes), n)


def geomean_speedup(outcomes: Sequence[AttemptOutcome]) -> float | None:
    """Geometric mean of the speedups of the passed attempts (None when none passed)."""
    logs = [math.log(o.speedup) for o in outcomes if o.passed and o.speedup is not None]
    return math.exp(math.fsum(logs) / len(logs)) if logs else None


def score_attempts(outcomes: Sequence[AttemptOutcome]) -> dict[str, float | int | None]:
    """Attempt-level scores of one set of attempts (one arm, or any list).

    Attempts with an infrastructure ``error`` and skipped skill attempts are not attempts at the
    problem, so they are counted (``n_errors``, ``n_skipped``) and left out of every rate.
    """
    scored = [o for o in outcomes if o.error is None and not o.skipped]
    out: dict[str, float | int | None] = {
        "n_attempts": len(scored),
        "n_passed": sum(o.passed for o in scored),
        "n_skipped": sum(o.error is None and o.skipped for o in outcomes),
        "n_errors": sum(o.error is not None for o in outcomes),
        "n_unverified": sum(o.status == "unverified" for o in scored),
        "pass_rate": share(sum(o.passed for o in scored), len(scored)),
    }
    out.update(ladder(scored))
    for p in FAST_P_THRESHOLDS:
        out[f"fast_{p:g}"] = fast_p(scored, p)
    out["geomean_speedup"] = geomean_speedup(scored)
    return out
