"""Property tests: symmetries and invariants that must hold for any set of units."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mkb_eval.metrics import LADDER_KEYS, RATE_KEYS, AttemptOutcome, Unit, direction_arms, score_units

SPEEDUPS = [0.005, 0.3, 0.5, 0.9, 1.0, 1.02, 1.04, 2.0, 3.9, 4.0, 7.5]  # ties, boundaries, below the floor
FAILS = ["incorrect", "timeout", "compile_error", "unverified"]
FAST = dict(n_resamples=20)


@st.composite
def outcomes(draw: st.DrawFn) -> tuple[str, float | None, bool]:
    if draw(st.booleans()):
        s = draw(st.sampled_from(SPEEDUPS))
        with_time = draw(st.booleans())
        return "ok", s, with_time
    return draw(st.sampled_from(FAILS)), None, False


def make(pid: int, arm: str, o: tuple[str, float | None, bool]) -> AttemptOutcome:
    status, s, with_time = o
    return AttemptOutcome(problem_id=pid, arm=arm, status=status, speedup=s,
                          kernel_ms=(1.0 / s) if s and with_time else None, family=f"f{pid % 2}")


@st.composite
def unit_sets(draw: st.DrawFn, allow_skip: bool = True) -> list[Unit]:
    n = draw(st.integers(min_value=1, max_value=14))
    units = []
    for rep in range(1, n + 1):
        pid = draw(st.integers(min_value=1, max_value=5))
        d = draw(st.sampled_from(["cutedsl2tirx", "tirx2cutedsl"]))
        src, base, skill = direction_arms(d)
        skipped = allow_skip and draw(st.integers(0, 5)) == 0
        sk = (AttemptOutcome(problem_id=pid, arm=skill, status="skipped") if skipped
              else make(pid, skill, draw(outcomes())))
        units.append(Unit(problem_id=pid, direction=d, replicate=rep, family=f"f{pid % 2}",
                          source=make(pid, src, draw(outcomes())), base=make(pid, base, draw(outcomes())), skill=sk))
    return units


def swapped(u: Unit) -> Unit:
    """The same unit with the base and skill attempts exchanged (arms kept consistent)."""
    assert u.base is not None and u.skill is not None
    return replace(u, base=replace(u.skill, arm=u.base.arm), skill=replace(u.base, arm=u.skill.arm))


SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(unit_sets(allow_skip=False))
def test_swapping_base_and_skill_negates_lift_and_swaps_help_harm(units: list[Unit]) -> None:
    a = score_units(units, **FAST)["overall"]
    b = score_units([swapped(u) for u in units], **FAST)["overall"]
    for k in LADDER_KEYS:
        assert b["lift"][k] == -a["lift"][k]
    assert b["paired"]["helped"] == a["paired"]["harmed"] and b["paired"]["harmed"] == a["paired"]["helped"]
    assert b["paired"]["help_rate"] == a["paired"]["harm_rate"]
    assert b["paired"]["harm_rate"] == a["paired"]["help_rate"]
    assert b["paired"]["sign_test_p"] == a["paired"]["sign_test_p"]
    la, lb = math.log1p(a["paired"]["delta_gm"] / 100), math.log1p(b["paired"]["delta_gm"] / 100)
    assert math.isclose(la, -lb, rel_tol=1e-9, abs_tol=1e-9)


@SETTINGS
@given(unit_sets())
def test_invariants(units: list[Unit]) -> None:
    res = score_units(units, **FAST)
    o = res["overall"]
    p = o["paired"]
    assert p["helped"] + p["harmed"] + p["neutral"] == p["n"] == o["n_resolved"] == len(units)
    assert 0 <= p["help_rate"] <= 1 and 0 <= p["harm_rate"] <= 1
    assert sum(v["n"] for v in o["standing"].values()) == p["n"]
    for side in ("source", "base", "skill"):
        rates = [o[side][k] for k in RATE_KEYS]
        assert all(x >= y for x, y in zip(rates, rates[1:], strict=False))  # R@t cannot grow with t
        assert 0.0 <= o[side]["S"] <= 100.0
    assert o["lift"]["S"] == o["skill"]["S"] - o["base"]["S"]
    for lo, hi in o["ci"].values():
        assert lo <= hi
    # the direction split partitions the units
    assert sum(g["n_resolved"] for g in res["by_direction"].values()) == len(units)
    assert sum(g["paired"]["helped"] for g in res["by_family"].values()) == p["helped"]


@SETTINGS
@given(unit_sets(), st.randoms(use_true_random=False))
def test_order_does_not_matter(units: list[Unit], rnd: random.Random) -> None:
    shuffled = list(units)
    rnd.shuffle(shuffled)
    a = json.dumps(score_units(units, **FAST), sort_keys=True)
    b = json.dumps(score_units(shuffled, **FAST), sort_keys=True)
    assert a == b


@SETTINGS
@given(unit_sets(allow_skip=False))
def test_skill_equal_to_base_is_no_effect(units: list[Unit]) -> None:
    same = [replace(u, skill=replace(u.base, arm=u.skill.arm)) for u in units]  # type: ignore[union-attr,arg-type]
    o = score_units(same, **FAST)["overall"]
    assert all(v == 0.0 for v in o["lift"].values())
    assert (o["paired"]["helped"], o["paired"]["harmed"]) == (0, 0)
    assert o["paired"]["delta_gm"] == 0.0 and o["paired"]["sign_test_p"] is None


@SETTINGS
@given(unit_sets())
def test_skipped_skills_count_as_base_and_neutral(units: list[Unit]) -> None:
    skipped = [replace(u, skill=AttemptOutcome(problem_id=u.problem_id, arm=u.skill.arm, status="skipped"))  # type: ignore[union-attr]
               for u in units]
    o = score_units(skipped, **FAST)["overall"]
    assert o["skill"] == o["base"]
    assert all(v == 0.0 for v in o["lift"].values())
    assert o["paired"]["neutral"] == len(units) and o["paired"]["delta_gm"] == 0.0
    assert o["skill_coverage"] == 0.0 and o["with_skill"]["n"] == 0 and o["with_skill"]["lift"]["S"] is None
