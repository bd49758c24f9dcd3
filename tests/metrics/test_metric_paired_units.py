"""Per-attempt and per-unit definitions, each against a value worked out by hand."""

from __future__ import annotations

import math

import pytest

from mkb_eval.metrics import (
    FLOOR,
    AttemptOutcome,
    Unit,
    build_units,
    direction_arms,
    effective_speedup,
    fast_p,
    geomean_speedup,
    ladder,
    lift,
    log_ratio,
    paired_outcome,
    score_attempts,
    standing,
    tier,
    tier_label,
)


def ok(speedup: float, kernel_ms: float | None = None, arm: str = "solo_tirx") -> AttemptOutcome:
    return AttemptOutcome(problem_id=1, arm=arm, status="ok", speedup=speedup, kernel_ms=kernel_ms)


def bad(status: str = "incorrect", arm: str = "solo_tirx") -> AttemptOutcome:
    return AttemptOutcome(problem_id=1, arm=arm, status=status)


SKIP = AttemptOutcome(problem_id=1, arm="cutedsl2tirx_skill", status="skipped")


def test_ladder_by_hand() -> None:
    # speedups 0.4, 0.5, 1.0, 3.0, 4.0 and two failures: 7 attempts
    xs = [ok(0.4), ok(0.5), ok(1.0), ok(3.0), ok(4.0), bad(), bad("timeout")]
    lad = ladder(xs)
    assert lad == {"R@0": 5 / 7, "R@0.5": 4 / 7, "R@1": 3 / 7, "R@2": 2 / 7, "R@4": 1 / 7,
                   "S": pytest.approx(100 * (15 / 7) / 5)}
    assert lad["S"] == pytest.approx(42.857142857)


def test_empty_is_none_not_zero() -> None:
    assert ladder([]) == dict.fromkeys(["R@0", "R@0.5", "R@1", "R@2", "R@4", "S"])
    assert fast_p([], 1.0) is None and geomean_speedup([]) is None
    assert geomean_speedup([bad()]) is None  # nothing passed: no geomean, not 0
    assert lift(ladder([]), ladder([ok(1.0)]))["S"] is None


def test_fast_p_is_strict_and_geomean_over_passed() -> None:
    xs = [ok(1.0), ok(2.0), ok(0.5), bad()]
    assert fast_p(xs, 1.0) == 0.25  # 1.0 is not > 1
    assert fast_p(xs, 0.0) == 0.75
    assert fast_p(xs, 2.0) == 0.0
    assert geomean_speedup(xs) == pytest.approx(1.0)  # (1 * 2 * 0.5) ** (1/3)


def test_score_attempts_leaves_out_skipped_and_errors() -> None:
    err = AttemptOutcome(problem_id=1, arm="solo_tirx", status="crashed", error="judge died")
    s = score_attempts([ok(2.0), bad(), SKIP, err, bad("unverified")])
    assert (s["n_attempts"], s["n_passed"], s["n_skipped"], s["n_errors"], s["n_unverified"]) == (3, 1, 1, 1, 1)
    assert s["pass_rate"] == 1 / 3 and s["R@2"] == 1 / 3 and s["fast_1"] == 1 / 3 and s["geomean_speedup"] == 2.0


@pytest.mark.parametrize(
    ("o", "label"),
    [(bad(), "fail"), (ok(0.1), "0"), (ok(0.5), "0.5"), (ok(0.99), "0.5"), (ok(1.0), "1"), (ok(2.0), "2"),
     (ok(3.9), "2"), (ok(4.0), "4"), (ok(100.0), "4"), (SKIP, "fail")],
)
def test_tiers(o: AttemptOutcome, label: str) -> None:
    assert tier_label(tier(o)) == label


@pytest.mark.parametrize(
    ("base", "skill", "expected"),
    [
        (bad(), ok(0.2), "helped"),  # fail -> tier 0
        (ok(1.0), bad(), "harmed"),
        (bad(), bad("timeout"), "neutral"),  # both failed
        (ok(1.0, 1.0), ok(1.5, 0.6667), "helped"),  # tier 1 both, 33% faster
        (ok(1.0, 1.0), ok(1.02, 0.98), "neutral"),  # 2% faster: inside the 5% margin
        (ok(1.0, 1.0), ok(1.0, 1.04), "neutral"),  # 4% slower: inside
        (ok(1.9, 1.0), ok(1.2, 1.06), "harmed"),  # tier 1 both, 6% slower
        (ok(1.0, 1.0), ok(1.9, 0.95), "helped"),  # 0.95 * 1.05 = 0.9975 < 1.0: just outside the margin
        (ok(1.0), ok(1.06), "helped"),  # no kernel times: speedups 1.06 > 1.0 * 1.05
        (ok(1.0), ok(1.04), "neutral"),
        (ok(1.0, 1.0), SKIP, "neutral"),  # skipped skill
        (bad(), SKIP, "neutral"),
    ],
)
def test_paired_outcomes(base: AttemptOutcome, skill: AttemptOutcome, expected: str) -> None:
    assert paired_outcome(base, skill) == expected


def test_margin_boundary_is_a_tie() -> None:
    # 1.0 * (1 + 0.25) == 1.25 exactly in binary: not strictly faster, so neutral both ways
    assert paired_outcome(ok(1.0, 1.25), ok(1.2, 1.0), margin=0.25) == "neutral"
    assert paired_outcome(ok(1.2, 1.0), ok(1.0, 1.25), margin=0.25) == "neutral"


def test_margin_is_a_parameter() -> None:
    assert paired_outcome(ok(1.0, 1.0), ok(1.02, 0.98), margin=0.0) == "helped"
    assert paired_outcome(ok(1.0, 1.0), ok(1.5, 0.6667), margin=0.6) == "neutral"


def test_log_ratio_floors_failures() -> None:
    assert effective_speedup(bad()) == FLOOR == 0.01
    assert effective_speedup(ok(0.001)) == 0.01  # a pass is never below a failure
    assert log_ratio(bad(), ok(2.0)) == pytest.approx(math.log(200.0))
    assert log_ratio(ok(4.0), bad()) == pytest.approx(math.log(0.0025))
    assert log_ratio(bad(), bad()) == 0.0
    assert log_ratio(ok(4.0), SKIP) == 0.0
    assert log_ratio(bad(), ok(2.0), floor=0.1) == pytest.approx(math.log(20.0))


def test_standing() -> None:
    assert standing(ok(2.0, arm="solo_cutedsl"), ok(1.0)) == "above"
    assert standing(ok(1.5, arm="solo_cutedsl"), ok(1.0)) == "same"  # both tier 1
    assert standing(bad(arm="solo_cutedsl"), bad()) == "same"
    assert standing(bad(arm="solo_cutedsl"), ok(0.1)) == "below"


def test_direction_arms() -> None:
    assert direction_arms("cutedsl2tirx") == ("solo_cutedsl", "solo_tirx", "cutedsl2tirx_skill")
    assert direction_arms("tirx2cutedsl") == ("solo_tirx", "solo_cutedsl", "tirx2cutedsl_skill")
    with pytest.raises(ValueError, match="unknown direction"):
        direction_arms("cuda2tirx")


def test_units_share_solos_and_resolve() -> None:
    c = AttemptOutcome(problem_id=7, arm="solo_cutedsl", status="ok", speedup=1.0)
    t = AttemptOutcome(problem_id=7, arm="solo_tirx", status="incorrect")
    s = AttemptOutcome(problem_id=7, arm="cutedsl2tirx_skill", status="skipped")
    units = build_units([s, t, c])
    assert [(u.direction, u.resolved, u.unresolved_reason) for u in units] == [
        ("cutedsl2tirx", True, None),
        ("tirx2cutedsl", False, "missing"),
    ]
    u = units[0]
    assert u.source is c and u.base is t and u.skill is s and u.skill_outcome is t and not u.has_skill
    assert units[1].source is t and units[1].base is c and units[1].skill is None
    err = Unit(problem_id=7, direction="cutedsl2tirx", source=c, base=t,
               skill=AttemptOutcome(problem_id=7, arm="cutedsl2tirx_skill", status="crashed", error="oom"))
    assert err.unresolved_reason == "error"
