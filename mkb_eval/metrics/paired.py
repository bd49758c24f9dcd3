"""Paired outcomes of one unit: tiers, helped / harmed / neutral, the paired speedup ratio, standing.

These are the paper's metrics that the original code does not implement (spec §5.6); the
definitions here are ours and are written out in the metric cards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mkb_eval.metrics.inputs import AttemptOutcome
from mkb_eval.metrics.ladder import THRESHOLDS
from mkb_eval.metrics.units import Unit

FAIL_TIER = -1
TIER_LABELS: tuple[str, ...] = ("fail", *(f"{t:g}" for t in THRESHOLDS))
NOISE_MARGIN = 0.05
"""Relative runtime difference below which two passing attempts of the same tier are a tie."""
FLOOR = 0.01
"""Speedup given to a failed attempt in paired speedup ratios (a 100x slowdown vs eager)."""
NEUTRAL_BAND = 0.03
"""Paired verdict: a unit is helped (harmed) only when the 95% interval of its re-timed speedup ratio
lies above 1 + band (below 1 / (1 + band)); the band sits above the A/A noise floor of the H200."""
VERDICTS = ("paired", "original")
OUTCOMES = ("helped", "harmed", "neutral")
STANDINGS = ("above", "same", "below")


def tier(o: AttemptOutcome) -> int:
    """Index into THRESHOLDS of the highest t attained, or FAIL_TIER (-1) if not passed."""
    if not o.passed:
        return FAIL_TIER
    return max(i for i, t in enumerate(THRESHOLDS) if o.attains(t))


def tier_label(t: int) -> str:
    """"fail", "0", "0.5", "1", "2" or "4"."""
    return TIER_LABELS[t + 1]


def _faster(a: AttemptOutcome, b: AttemptOutcome, margin: float) -> bool:
    """a beat b by more than the margin: kernel times when both have them, else speedups."""
    if a.kernel_ms is not None and b.kernel_ms is not None:
        return a.kernel_ms * (1.0 + margin) < b.kernel_ms
    assert a.speedup is not None and b.speedup is not None
    return a.speedup > b.speedup * (1.0 + margin)


def paired_outcome(base: AttemptOutcome, skill: AttemptOutcome, margin: float = NOISE_MARGIN) -> str:
    """helped / harmed / neutral of the skill attempt against the base attempt.

    A higher tier helps, a lower one harms; within a tier two passing attempts are compared by
    kernel time (speedup when a time is missing) with a relative noise margin; two failures, and
    a skipped skill, are neutral.
    """
    if skill.skipped:
        return "neutral"
    tb, ts = tier(base), tier(skill)
    if ts != tb:
        return "helped" if ts > tb else "harmed"
    if tb == FAIL_TIER:
        return "neutral"
    if _faster(skill, base, margin):
        return "helped"
    if _faster(base, skill, margin):
        return "harmed"
    return "neutral"


def effective_speedup(o: AttemptOutcome, floor: float = FLOOR) -> float:
    """Speedup for ratios: a passed attempt's speedup (never below the floor), a failure's floor."""
    if o.passed and o.speedup is not None:
        return max(o.speedup, floor)
    return floor


def log_ratio(base: AttemptOutcome, skill: AttemptOutcome, floor: float = FLOOR) -> float:
    """ln(speedup_skill / speedup_base) with failures floored; 0 for a skipped skill."""
    if skill.skipped:
        return 0.0
    return math.log(effective_speedup(skill, floor)) - math.log(effective_speedup(base, floor))


def standing(source: AttemptOutcome, base: AttemptOutcome) -> str:
    """Where the source stood against the base: "above", "same" or "below" (by tier)."""
    ts, tb = tier(source), tier(base)
    return "above" if ts > tb else "below" if ts < tb else "same"


@dataclass(frozen=True)
class UnitScore:
    """Everything the aggregate metrics need from one resolved unit."""

    unit: Unit
    base_attains: tuple[bool, ...]
    skill_attains: tuple[bool, ...]
    source_tier: int
    base_tier: int
    skill_tier: int
    outcome: str
    log_ratio: float
    standing: str
    ratio_interval: tuple[float, float] | None = None    # paired verdict: 95% interval of the re-timed ratio
    rounds: int = 0                                       # usable re-timing rounds behind it

    @property
    def source_passed(self) -> bool:
        return self.source_tier != FAIL_TIER


def paired_verdict(base: AttemptOutcome, skill: AttemptOutcome, timing: Any,
                   band: float = NEUTRAL_BAND, floor: float = FLOOR) -> tuple[str | None, float, str | None]:
    """(outcome, ln ratio, unresolved reason) of the noise-aware verdict.

    Skipped skill: neutral. An ``unverified`` attempt (CPU tier): unresolved. One passed, the other
    not: helped / harmed (correctness is no noise). Both passed: by the re-timed pair (``timing``, a
    :class:`~mkb_eval.metrics.retimed.PairedTiming`): helped iff its interval's low end is above
    1 + band, harmed iff its high end is below 1 / (1 + band), else neutral; without a re-timing
    with 2+ usable rounds the unit is unresolved ("not_retimed"). Both failed: neutral.
    """
    if skill.skipped:
        return "neutral", 0.0, None
    if "unverified" in (base.status, skill.status):
        return None, 0.0, "unverified"
    if base.passed and skill.passed:
        iv = timing.interval() if timing is not None else None
        if iv is None:
            return None, 0.0, ("unverified" if timing is not None and timing.status == "unverified"
                               else "not_retimed")
        lo, hi = iv
        outcome = "helped" if lo > 1 + band else "harmed" if hi < 1 / (1 + band) else "neutral"
        return outcome, float(timing.mean_log), None
    if base.passed != skill.passed:
        return ("helped" if skill.passed else "harmed"), log_ratio(base, skill, floor), None
    return "neutral", log_ratio(base, skill, floor), None


def score_unit(unit: Unit, margin: float = NOISE_MARGIN, floor: float = FLOOR, *, verdict: str = "original",
               timing: Any = None, band: float = NEUTRAL_BAND) -> UnitScore:
    """Score a resolved unit (the skill side is the base when the skill was skipped).

    ``verdict="original"``: the benchmark's definition (tiers, then submission-time kernel times with
    ``margin``); ``"paired"``: :func:`paired_verdict` on the re-timed pair ``timing`` (raises
    ValueError for a unit that verdict leaves unresolved: check it first).
    """
    if not unit.resolved:
        raise ValueError(f"unit p{unit.problem_id:02d} {unit.direction} r{unit.replicate} is not resolved")
    assert unit.source is not None and unit.base is not None and unit.skill is not None
    eff = unit.skill_outcome
    assert eff is not None
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, not {verdict!r}")
    if verdict == "paired":
        outcome, lr, why = paired_verdict(unit.base, unit.skill, timing, band, floor)
        if why is not None or outcome is None:
            raise ValueError(f"unit p{unit.problem_id:02d} {unit.direction} r{unit.replicate} is unresolved "
                             f"under the paired verdict ({why})")
        both = unit.base.passed and eff.passed and not unit.skill.skipped
        return UnitScore(
            unit=unit,
            base_attains=tuple(unit.base.attains(t) for t in THRESHOLDS),
            skill_attains=tuple(eff.attains(t) for t in THRESHOLDS),
            source_tier=tier(unit.source), base_tier=tier(unit.base), skill_tier=tier(eff),
            outcome=outcome, log_ratio=lr, standing=standing(unit.source, unit.base),
            ratio_interval=timing.interval() if both else None, rounds=timing.n if both else 0,
        )
    return UnitScore(
        unit=unit,
        base_attains=tuple(unit.base.attains(t) for t in THRESHOLDS),
        skill_attains=tuple(eff.attains(t) for t in THRESHOLDS),
        source_tier=tier(unit.source),
        base_tier=tier(unit.base),
        skill_tier=tier(eff),
        outcome=paired_outcome(unit.base, unit.skill, margin),
        log_ratio=log_ratio(unit.base, unit.skill, floor),
        standing=standing(unit.source, unit.base),
    )
