"""Group metrics and the full results dict: overall, by direction, family, model and source verdict.

Every number is a pure function of the units, which are sorted before scoring, so re-scoring the
same records gives a bit-identical (JSON-equal) result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mkb_eval.metrics.definitions import LEGEND
from mkb_eval.metrics.inputs import ARMS, DIRECTIONS, AttemptOutcome, LoadResult, read_attempts
from mkb_eval.metrics.ladder import ladder, lift, score_attempts, share
from mkb_eval.metrics.paired import (FLOOR, NEUTRAL_BAND, NOISE_MARGIN, OUTCOMES, STANDINGS, VERDICTS, UnitScore,
                                     paired_verdict, score_unit, tier_label)
from mkb_eval.metrics.stats import CONFIDENCE, N_RESAMPLES, SEED, bootstrap_cis, sign_test
from mkb_eval.metrics.units import Unit, build_units

RESULTS_VERSION = 1

Group = dict[str, Any]


def delta_gm(scores: Sequence[UnitScore]) -> float | None:
    """ΔGM in percent: exp(mean ln(speedup_skill / speedup_base)) - 1 (None when empty)."""
    if not scores:
        return None
    return 100.0 * math.expm1(math.fsum(s.log_ratio for s in scores) / len(scores))


def paired_counts(scores: Sequence[UnitScore]) -> Group:
    """helped / harmed / neutral counts, T, H, ΔGM and the sign test of a group of units."""
    counts = {k: sum(s.outcome == k for s in scores) for k in OUTCOMES}
    return {
        "n": len(scores),
        **counts,
        "help_rate": share(counts["helped"], len(scores)),
        "harm_rate": share(counts["harmed"], len(scores)),
        "delta_gm": delta_gm(scores),
        "sign_test_p": sign_test(counts["helped"], counts["harmed"]),
    }


def standing_table(scores: Sequence[UnitScore]) -> Group:
    """Helped / harmed / neutral within each source standing (above / same / below the base)."""
    out: Group = {}
    for st in STANDINGS:
        group = [s for s in scores if s.standing == st]
        counts = {k: sum(s.outcome == k for s in group) for k in OUTCOMES}
        out[st] = {
            "n": len(group),
            **counts,
            "help_rate": share(counts["helped"], len(group)),
            "harm_rate": share(counts["harmed"], len(group)),
        }
    return out


def contrast(scores: Sequence[UnitScore]) -> Group:
    """source, base, skill and lift ladders (R@t and S) over resolved units; skipped skill = base."""
    assert all(s.unit.base is not None and s.unit.skill_outcome is not None for s in scores)
    base = ladder([s.unit.base for s in scores])  # type: ignore[misc]
    skill = ladder([s.unit.skill_outcome for s in scores])  # type: ignore[misc]
    source = ladder([s.unit.source for s in scores])  # type: ignore[misc]
    return {"n": len(scores), "source": source, "base": base, "skill": skill, "lift": lift(base, skill)}


def _reason(u: Unit, reasons: Mapping[Unit, str | None] | None) -> str | None:
    return reasons.get(u, u.unresolved_reason) if reasons is not None else u.unresolved_reason


def core(units: Sequence[Unit], scores: Sequence[UnitScore],
         reasons: Mapping[Unit, str | None] | None = None) -> Group:
    """All metrics of one group: counts, coverage, ladders, paired outcomes, standing."""
    c = contrast(scores)
    why = [_reason(u, reasons) for u in units]
    paired = {} if reasons is None else {"n_unresolved_unverified": why.count("unverified"),
                                         "n_unresolved_not_retimed": why.count("not_retimed")}
    return {
        "n_units": len(units),
        "n_resolved": len(scores),
        "n_unresolved_missing": why.count("missing"),
        "n_unresolved_error": why.count("error"),
        **paired,
        "n_problems": len({s.unit.problem_id for s in scores}),
        "source_coverage": share(sum(s.source_passed for s in scores), len(scores)),
        "skill_coverage": share(sum(s.unit.has_skill for s in scores), len(scores)),
        "source": c["source"],
        "base": c["base"],
        "skill": c["skill"],
        "lift": c["lift"],
        "paired": paired_counts(scores),
        "standing": standing_table(scores),
    }


def group(
    units: Sequence[Unit], scores: Sequence[UnitScore], n_resamples: int, seed: int, confidence: float,
    reasons: Mapping[Unit, str | None] | None = None,
) -> Group:
    """core metrics plus the with_skill and by_source_verdict contrasts and bootstrap intervals."""
    out = core(units, scores, reasons)
    with_skill = [s for s in scores if s.unit.has_skill]
    out["with_skill"] = {**contrast(with_skill), "paired": paired_counts(with_skill)}
    out["by_source_verdict"] = {
        verdict: {**contrast(sub), "paired": paired_counts(sub)}
        for verdict, sub in (
            ("passed", [s for s in scores if s.source_passed]),
            ("failed", [s for s in scores if not s.source_passed]),
        )
    }
    cis = bootstrap_cis(scores, n_resamples=n_resamples, seed=seed, confidence=confidence)
    out["ci"] = {k: (None if v is None else [v[0], v[1]]) for k, v in cis.items()}
    return out


def unit_row(u: Unit, s: UnitScore | None, reason: str | None = None, timing: Any = None,
             paired: bool = False) -> Group:
    """One line per unit: where it stands and how it came out (for tables and debugging)."""
    iv = timing.interval() if timing is not None else None
    row = {
        "model": u.model,
        "problem_id": u.problem_id,
        "family": u.family,
        "direction": u.direction,
        "replicate": u.replicate,
        "resolved": s is not None,
        "unresolved_reason": (reason if paired else u.unresolved_reason) if s is None else None,
        "skipped": None if u.skill is None else u.skill.skipped,
        "source_tier": None if s is None else tier_label(s.source_tier),
        "base_tier": None if s is None else tier_label(s.base_tier),
        "skill_tier": None if s is None else tier_label(s.skill_tier),
        "standing": None if s is None else s.standing,
        "outcome": None if s is None else s.outcome,
        "log_ratio": None if s is None else s.log_ratio,
    }
    if paired:
        row.update(paired_ratio=None if timing is None else timing.ratio,
                   paired_interval=None if iv is None else [iv[0], iv[1]],
                   paired_rounds=0 if timing is None else timing.n,
                   paired_other_ratio=None if timing is None else timing.other_ratio)
    return row


def problem_rows(units: Sequence[Unit], scores: Sequence[UnitScore]) -> list[Group]:
    """Per (problem, direction): resolved count, S of base and skill, lift of S, ΔGM, outcomes."""
    rows = []
    keys = sorted({(u.problem_id, u.direction) for u in units})
    for pid, d in keys:
        us = [u for u in units if (u.problem_id, u.direction) == (pid, d)]
        ss = [s for s in scores if (s.unit.problem_id, s.unit.direction) == (pid, d)]
        c = contrast(ss)
        rows.append(
            {
                "problem_id": pid,
                "family": us[0].family,
                "direction": d,
                "n_units": len(us),
                "n_resolved": len(ss),
                "base_S": c["base"]["S"],
                "skill_S": c["skill"]["S"],
                "lift_S": c["lift"]["S"],
                **{k: sum(s.outcome == k for s in ss) for k in OUTCOMES},
                "delta_gm": delta_gm(ss),
            }
        )
    return rows


def _split(
    units: Sequence[Unit], scores: Sequence[UnitScore], key: Callable[[Unit], str], names: Iterable[str]
) -> dict[str, tuple[list[Unit], list[UnitScore]]]:
    return {n: ([u for u in units if key(u) == n], [s for s in scores if key(s.unit) == n]) for n in names}


def score_units(
    units: Sequence[Unit],
    *,
    margin: float = NOISE_MARGIN,
    floor: float = FLOOR,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
    verdict: str = "original",
    timings: Mapping[Any, Any] | None = None,
    band: float = NEUTRAL_BAND,
    timer: str = "kernel_ms",
    noise_floor: Mapping[str, Any] | None = None,
) -> Group:
    """Overall, by direction, by family and by model group metrics for a list of units.

    ``verdict="paired"`` scores with the re-timed pairs ``timings`` (unit key -> PairedTiming, see
    :mod:`mkb_eval.metrics.retimed`) and the neutral ``band``; ``"original"`` is the benchmark's
    definition on the submission-time numbers (``margin``)."""
    if margin < 0:
        raise ValueError("margin must be >= 0")
    if floor <= 0:
        raise ValueError("floor must be > 0")
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, not {verdict!r}")
    if band < 0:
        raise ValueError("band must be >= 0")
    from mkb_eval.metrics.retimed import retimed_unit

    timings = timings or {}
    units = sorted(units, key=lambda u: (u.model, u.problem_id, u.direction, u.replicate))

    def timing_of(u: Unit) -> Any:
        return timings.get((u.model, u.problem_id, u.direction, u.replicate))

    if verdict == "paired":        # lift, tiers and standing from the re-timed times too
        units = [retimed_unit(u, timing_of(u)) for u in units]
    reasons: dict[Unit, str | None] = {}
    pairs: list[tuple[Unit, UnitScore | None]] = []
    for u in units:
        why = u.unresolved_reason
        if why is None and verdict == "paired":
            assert u.base is not None and u.skill is not None
            why = paired_verdict(u.base, u.skill, timing_of(u), band, floor)[2]
        reasons[u] = why
        pairs.append((u, None if why else score_unit(u, margin, floor, verdict=verdict, timing=timing_of(u),
                                                      band=band)))
    scores = [s for _, s in pairs if s is not None]

    def grp(us: Sequence[Unit], ss: Sequence[UnitScore]) -> Group:
        return group(us, ss, n_resamples, seed, confidence, reasons if verdict == "paired" else None)

    families = sorted({u.family for u in units})
    models = sorted({u.model for u in units})
    return {
        "params": {
            "margin": margin,
            "floor": floor,
            "n_resamples": n_resamples,
            "seed": seed,
            "confidence": confidence,
            **({"verdict": verdict, "band": band, "timer": timer,
                "rounds": sorted({t.rounds for t in timings.values()}),
                "noise_floor": dict(noise_floor) if noise_floor else None} if verdict == "paired" else {}),
        },
        "overall": grp(units, scores),
        "by_direction": {k: grp(*v) for k, v in _split(units, scores, lambda u: u.direction, DIRECTIONS).items()},
        "by_family": {k: grp(*v) for k, v in _split(units, scores, lambda u: u.family, families).items()},
        "by_model": {k: grp(*v) for k, v in _split(units, scores, lambda u: u.model, models).items()},
        "problems": problem_rows(units, scores),
        "units": [unit_row(u, s, reasons[u], timing_of(u), verdict == "paired") for u, s in pairs],
    }


def score(
    records: LoadResult | Iterable[AttemptOutcome] | Iterable[Mapping[str, Any]],
    *,
    margin: float = NOISE_MARGIN,
    floor: float = FLOOR,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
    verdict: str | None = None,
    timings: Mapping[Any, Any] | None = None,
    band: float = NEUTRAL_BAND,
    timer: str = "kernel_ms",
    noise_floor: Mapping[str, Any] | None = None,
) -> Group:
    """Score a run: attempt-level rates per arm, and the paired metrics of every group.

    Accepts the result of ``read_attempts``, AttemptOutcomes, or raw record dicts (read with the
    same rules as a run dir: later records of a trial supersede earlier ones). ``verdict`` defaults
    to "paired" when ``timings`` (re-timed pairs) are given, else "original".
    """
    verdict = verdict or ("paired" if timings is not None else "original")
    if isinstance(records, LoadResult):
        loaded = records
    else:
        items = list(records)
        if all(isinstance(o, AttemptOutcome) for o in items):
            loaded = LoadResult(outcomes=tuple(items), n_records=len(items))  # type: ignore[arg-type]
        else:
            loaded = read_attempts(items)  # type: ignore[arg-type]
    outcomes = loaded.outcomes
    result: Group = {
        "results_version": RESULTS_VERSION,
        "n_records": loaded.n_records,
        "n_superseded": loaded.n_superseded,
        "warnings": list(loaded.warnings),
        "models": sorted({o.model for o in outcomes}),
        "arms": {arm: score_attempts([o for o in outcomes if o.arm == arm]) for arm in ARMS},
    }
    result.update(
        score_units(
            build_units(outcomes),
            margin=margin,
            floor=floor,
            n_resamples=n_resamples,
            seed=seed,
            confidence=confidence,
            verdict=verdict,
            timings=timings,
            band=band,
            timer=timer,
            noise_floor=noise_floor,
        )
    )
    result["legend"] = dict(LEGEND)
    return result
