"""Uncertainty: a problem-level (cluster) bootstrap for the paired metrics, and an exact sign test.

Units of the same problem share the problem's difficulty, so they are not independent; the
bootstrap therefore resamples whole problems (with all their directions, replicates and models).
Sums are over integer counts or use numpy's deterministic pairwise summation, so the same seed
and the same units give bit-identical intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from mkb_eval.metrics.ladder import THRESHOLDS
from mkb_eval.metrics.paired import UnitScore

N_RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 0
CI_KEYS = ("lift_S", "help_rate", "harm_rate", "delta_gm")

Interval = tuple[float, float]


def sign_test(helped: int, harmed: int) -> float | None:
    """Two-sided exact binomial p-value of helped vs harmed under p = 1/2 (neutral excluded).

    None when there is nothing to test (no helped and no harmed units).
    """
    n = helped + harmed
    if n == 0:
        return None
    k = min(helped, harmed)
    tail = Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))


def bootstrap_cis(
    scores: Sequence[UnitScore],
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> dict[str, Interval | None]:
    """Percentile intervals for lift of S, help rate T, harm rate H and ΔGM (%).

    Problems are drawn with replacement (as many as there are), ``n_resamples`` times from a
    numpy PCG64 generator seeded with ``seed``; each statistic is recomputed on the pooled
    units of the drawn problems. No units gives None for every interval.
    """
    if not scores:
        return {k: None for k in CI_KEYS}
    if n_resamples < 1:
        raise ValueError("n_resamples must be at least 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must lie strictly between 0 and 1")
    problems = sorted({s.unit.problem_id for s in scores})
    index = {p: i for i, p in enumerate(problems)}
    P = len(problems)
    n = np.zeros(P, dtype=np.int64)
    attain_diff = np.zeros(P, dtype=np.int64)  # sum over units and t of (skill attains - base attains)
    helped = np.zeros(P, dtype=np.int64)
    harmed = np.zeros(P, dtype=np.int64)
    logs: list[list[float]] = [[] for _ in problems]
    for s in scores:
        i = index[s.unit.problem_id]
        n[i] += 1
        attain_diff[i] += sum(s.skill_attains) - sum(s.base_attains)
        helped[i] += s.outcome == "helped"
        harmed[i] += s.outcome == "harmed"
        logs[i].append(s.log_ratio)
    log_sum = np.array([math.fsum(v) for v in logs], dtype=np.float64)

    rng = np.random.default_rng(seed)
    draws = rng.integers(0, P, size=(n_resamples, P))
    counts = np.zeros((n_resamples, P), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(n_resamples), P), draws.ravel()), 1)
    N = (counts * n).sum(axis=1)  # int64: exact
    stats = {
        "lift_S": 100.0 * (counts * attain_diff).sum(axis=1) / (len(THRESHOLDS) * N),
        "help_rate": (counts * helped).sum(axis=1) / N,
        "harm_rate": (counts * harmed).sum(axis=1) / N,
        "delta_gm": 100.0 * np.expm1((counts * log_sum).sum(axis=1) / N),
    }
    alpha = (1.0 - confidence) / 2.0
    out: dict[str, Interval | None] = {}
    for key, values in stats.items():
        lo, hi = np.percentile(values, [100.0 * alpha, 100.0 * (1.0 - alpha)])
        out[key] = (float(lo), float(hi))
    return out
