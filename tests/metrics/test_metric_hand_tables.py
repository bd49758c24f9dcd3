"""The full scorer on the hand set of mkb_hand_records.py, against tables worked out on paper.

Resolved units (9; p25 is unresolved in both directions by solo_tirx's infrastructure error, p62
tirx2cutedsl by its missing skill record). Attains lists are for t = 0, 0.5, 1, 2, 4.

    unit          source        base               skill (effective)       outcome  standing  ln ratio
    u1 p01 c2t    2.0  tier 2   1.0  11100  tier 1  1.02 11100 tier 1     neutral  above     ln 1.02
    u2 p01 t2c    1.0  tier 1   2.0  11110  tier 2  2.5  11110 tier 2     helped   below     ln 1.25
    u3 p28 c2t    fail          0.6  11000  tier .5 1.5  11100 tier 1     helped   below     ln 2.5
    u4 p28 t2c    0.6  tier .5  fail 00000          skipped -> base fail  neutral  above     0
    u5 p36 c2t    4.0  tier 4   3.0  11110  tier 2  2.8  11110 (7% slower) harmed  above     ln(2.8/3)
    u6 p36 t2c    3.0  tier 2   4.0  11111  tier 4  fail 00000            harmed   below     ln(0.01/4)
    u7 p52 c2t    fail          fail                fail                  neutral  same      0
    u8 p52 t2c    fail          fail                fail                  neutral  same      0
    u9 p62 c2t    1.2  tier 1   0.8  11000  tier .5 0.9  11000 (10% faster) helped above     ln 1.125
"""

from __future__ import annotations

import math

import pytest
from mkb_hand_records import hand_records

from mkb_eval.metrics import score

LN = {"u1": math.log(1.02), "u2": math.log(1.25), "u3": math.log(2.5), "u5": math.log(2.8 / 3.0),
      "u6": math.log(0.0025), "u9": math.log(1.125)}


def gm(*logs: float) -> float:
    """ΔGM (%) over units with these log ratios (zeros for the neutral-ratio units included by caller)."""
    return 100.0 * (math.exp(math.fsum(logs) / len(logs)) - 1.0)


@pytest.fixture(scope="module")
def results() -> dict:
    return score(hand_records(), n_resamples=200)


def approx_ladder(*vals: float) -> dict:
    keys = ["R@0", "R@0.5", "R@1", "R@2", "R@4", "S"]
    return {k: pytest.approx(v, abs=1e-12) for k, v in zip(keys, vals, strict=True)}


def test_overall_counts(results: dict) -> None:
    o = results["overall"]
    assert (o["n_units"], o["n_resolved"], o["n_unresolved_missing"], o["n_unresolved_error"]) == (12, 9, 1, 2)
    assert o["n_problems"] == 5
    assert o["source_coverage"] == pytest.approx(6 / 9)  # sources of u3, u7, u8 failed
    assert o["skill_coverage"] == pytest.approx(8 / 9)  # u4 skipped


def test_overall_ladders_and_lift(results: dict) -> None:
    o = results["overall"]
    # base attains per t: 6, 6, 4, 3, 1 of 9; skill: 5, 5, 4, 2, 0 of 9
    assert o["base"] == approx_ladder(6 / 9, 6 / 9, 4 / 9, 3 / 9, 1 / 9, 100 * (20 / 9) / 5)
    assert o["skill"] == approx_ladder(5 / 9, 5 / 9, 4 / 9, 2 / 9, 0.0, 100 * (16 / 9) / 5)
    assert o["lift"] == approx_ladder(-1 / 9, -1 / 9, 0.0, -1 / 9, -1 / 9, -100 * (4 / 9) / 5)
    assert o["base"]["S"] == pytest.approx(44.444444444) and o["lift"]["S"] == pytest.approx(-8.888888889)
    # the source ladder: sources 2.0, 1.0, fail, 0.6, 4.0, 3.0, fail, fail, 1.2
    assert o["source"] == approx_ladder(6 / 9, 6 / 9, 5 / 9, 3 / 9, 1 / 9, 100 * (21 / 9) / 5)


def test_overall_paired(results: dict) -> None:
    p = results["overall"]["paired"]
    assert (p["n"], p["helped"], p["harmed"], p["neutral"]) == (9, 3, 2, 4)
    assert p["help_rate"] == pytest.approx(1 / 3) and p["harm_rate"] == pytest.approx(2 / 9)
    assert p["delta_gm"] == pytest.approx(gm(*LN.values(), 0.0, 0.0, 0.0))
    assert p["delta_gm"] == pytest.approx(-41.2282, abs=1e-3)  # 100 * (0.0083671875 ** (1/9) - 1)
    assert p["sign_test_p"] == 1.0  # 3 vs 2: 2 * (1 + 5 + 10) / 32 = 1


def test_overall_standing(results: dict) -> None:
    st = results["overall"]["standing"]
    assert {k: (v["n"], v["helped"], v["harmed"], v["neutral"]) for k, v in st.items()} == {
        "above": (4, 1, 1, 2),  # u1 neutral, u4 neutral, u5 harmed, u9 helped
        "same": (2, 0, 0, 2),  # u7, u8 all-fail
        "below": (3, 2, 1, 0),  # u2, u3 helped, u6 harmed
    }
    assert st["above"]["help_rate"] == 0.25 and st["below"]["harm_rate"] == pytest.approx(1 / 3)
    assert st["same"]["help_rate"] == 0.0  # a real zero: two units, neither helped


def test_cutedsl2tirx(results: dict) -> None:
    d = results["by_direction"]["cutedsl2tirx"]  # u1 u3 u5 u7 u9
    assert (d["n_units"], d["n_resolved"], d["n_unresolved_error"], d["n_unresolved_missing"]) == (6, 5, 1, 0)
    assert d["base"] == approx_ladder(0.8, 0.8, 0.4, 0.2, 0.0, 44.0)
    assert d["skill"] == approx_ladder(0.8, 0.8, 0.6, 0.2, 0.0, 48.0)
    assert d["lift"]["S"] == pytest.approx(4.0) and d["lift"]["R@1"] == pytest.approx(0.2)
    p = d["paired"]
    assert (p["helped"], p["harmed"], p["neutral"]) == (2, 1, 2)
    assert (p["help_rate"], p["harm_rate"]) == (0.4, 0.2)
    assert p["delta_gm"] == pytest.approx(gm(LN["u1"], LN["u3"], LN["u5"], 0.0, LN["u9"]))
    assert p["delta_gm"] == pytest.approx(21.771, abs=1e-3)  # 2.6775 ** (1/5) - 1
    assert d["source_coverage"] == pytest.approx(3 / 5)
    assert {k: v["n"] for k, v in d["standing"].items()} == {"above": 3, "same": 1, "below": 1}


def test_tirx2cutedsl(results: dict) -> None:
    d = results["by_direction"]["tirx2cutedsl"]  # u2 u4 u6 u8
    assert (d["n_units"], d["n_resolved"], d["n_unresolved_error"], d["n_unresolved_missing"]) == (6, 4, 1, 1)
    assert d["base"] == approx_ladder(0.5, 0.5, 0.5, 0.5, 0.25, 45.0)
    assert d["skill"] == approx_ladder(0.25, 0.25, 0.25, 0.25, 0.0, 20.0)  # u4 skipped = base (fail)
    assert d["lift"]["S"] == pytest.approx(-25.0)
    p = d["paired"]
    assert (p["helped"], p["harmed"], p["neutral"], p["help_rate"], p["harm_rate"]) == (1, 1, 2, 0.25, 0.25)
    assert p["delta_gm"] == pytest.approx(gm(LN["u2"], 0.0, LN["u6"], 0.0))
    assert p["delta_gm"] == pytest.approx(-76.356, abs=1e-3)  # 0.003125 ** (1/4) - 1
    assert p["sign_test_p"] == 1.0  # 1 vs 1: 2 * 3 / 4 capped at 1
    ws = d["with_skill"]  # drops u4
    assert ws["n"] == 3 and ws["base"]["S"] == pytest.approx(100 * (2 + 2 + 2 + 2 + 1) / 3 / 5)


def test_source_verdict_and_with_skill(results: dict) -> None:
    o = results["overall"]
    failed = o["by_source_verdict"]["failed"]  # u3 (helped), u7, u8
    assert failed["n"] == 3
    assert failed["base"] == approx_ladder(1 / 3, 1 / 3, 0.0, 0.0, 0.0, 100 * (2 / 3) / 5)
    assert failed["skill"] == approx_ladder(1 / 3, 1 / 3, 1 / 3, 0.0, 0.0, 20.0)
    assert failed["lift"]["S"] == pytest.approx(20.0 - 40 / 3)
    assert (failed["paired"]["help_rate"], failed["paired"]["harm_rate"]) == (pytest.approx(1 / 3), 0.0)
    passed = o["by_source_verdict"]["passed"]
    assert passed["n"] == 6 and (passed["paired"]["helped"], passed["paired"]["harmed"]) == (2, 2)
    assert o["with_skill"]["n"] == 8 and o["with_skill"]["paired"]["neutral"] == 3


def test_families_including_empty_and_all_fail(results: dict) -> None:
    fam = results["by_family"]
    assert list(fam) == ["attention", "kv_cache", "linear_attention", "mlp_norm", "quantization"]
    kv = fam["kv_cache"]  # p25: both units unresolved -> every rate is None, never 0
    assert (kv["n_units"], kv["n_resolved"], kv["n_unresolved_error"]) == (2, 0, 2)
    assert kv["lift"]["S"] is None and kv["base"]["R@0"] is None
    assert kv["paired"]["help_rate"] is None and kv["paired"]["delta_gm"] is None
    assert kv["source_coverage"] is None and all(v is None for v in kv["ci"].values())
    q = fam["quantization"]  # p52: everything failed -> real zeros
    assert q["n_resolved"] == 2 and q["base"]["S"] == 0.0 and q["skill"]["S"] == 0.0 and q["lift"]["S"] == 0.0
    assert q["paired"]["help_rate"] == 0.0 and q["paired"]["delta_gm"] == 0.0
    assert q["paired"]["sign_test_p"] is None  # nothing to test
    mlp = fam["mlp_norm"]  # u3, u4, u5, u6
    assert (mlp["paired"]["helped"], mlp["paired"]["harmed"], mlp["paired"]["neutral"]) == (1, 2, 1)


def test_arms_attempt_level(results: dict) -> None:
    a = results["arms"]["solo_cutedsl"]  # 2.0, 1.0, fail, 4.0, fail, 1.2
    assert (a["n_attempts"], a["n_passed"], a["n_errors"], a["n_skipped"]) == (6, 4, 0, 0)
    assert a["pass_rate"] == pytest.approx(4 / 6)
    assert [a[k] for k in ("R@0", "R@0.5", "R@1", "R@2", "R@4")] == pytest.approx([4 / 6, 4 / 6, 4 / 6, 2 / 6, 1 / 6])
    assert a["S"] == pytest.approx(50.0)
    assert (a["fast_0"], a["fast_1"], a["fast_2"]) == pytest.approx((4 / 6, 3 / 6, 1 / 6))  # strict: 1.0, 2.0 out
    assert a["geomean_speedup"] == pytest.approx(9.6 ** 0.25)
    t = results["arms"]["solo_tirx"]  # p25 has an infrastructure error
    assert (t["n_attempts"], t["n_passed"], t["n_errors"]) == (5, 4, 1)
    s = results["arms"]["tirx2cutedsl_skill"]  # 2.5, 0.9, skipped, compile_error, incorrect
    assert (s["n_attempts"], s["n_passed"], s["n_skipped"]) == (4, 2, 1)


def test_problem_rows(results: dict) -> None:
    rows = {(r["problem_id"], r["direction"]): r for r in results["problems"]}
    assert len(rows) == 12
    r = rows[(36, "tirx2cutedsl")]
    assert (r["n_resolved"], r["base_S"], r["skill_S"], r["lift_S"], r["harmed"]) == (1, 100.0, 0.0, -100.0, 1)
    assert r["delta_gm"] == pytest.approx(-99.75)
    r = rows[(25, "cutedsl2tirx")]
    assert (r["n_resolved"], r["lift_S"], r["delta_gm"]) == (0, None, None)


def test_unit_rows(results: dict) -> None:
    u = {(r["problem_id"], r["direction"]): r for r in results["units"]}
    assert u[(28, "tirx2cutedsl")] | {} == {
        "model": "m", "problem_id": 28, "family": "mlp_norm", "direction": "tirx2cutedsl", "replicate": 1,
        "resolved": True, "unresolved_reason": None, "skipped": True, "source_tier": "0.5", "base_tier": "fail",
        "skill_tier": "fail", "standing": "above", "outcome": "neutral", "log_ratio": 0.0,
    }
    assert u[(62, "tirx2cutedsl")]["unresolved_reason"] == "missing"
    assert u[(25, "tirx2cutedsl")]["unresolved_reason"] == "error"


def test_bootstrap_intervals_bracket_point_estimates(results: dict) -> None:
    o = results["overall"]
    ci = o["ci"]
    for key, point in (("lift_S", o["lift"]["S"]), ("help_rate", o["paired"]["help_rate"]),
                       ("harm_rate", o["paired"]["harm_rate"]), ("delta_gm", o["paired"]["delta_gm"])):
        lo, hi = ci[key]
        assert lo <= hi
        assert lo - 1e-9 <= point <= hi + 1e-9, key
    assert results["params"]["n_resamples"] == 200


def test_two_models_pool_and_split() -> None:
    # the same records under a second model name: same trials, but no superseding across models
    recs = hand_records() + [r | {"model": "m2"} for r in hand_records()]
    res = score(recs, n_resamples=50)
    assert res["models"] == ["m", "m2"] and res["n_superseded"] == 2
    assert res["overall"]["n_resolved"] == 18 and res["overall"]["n_problems"] == 5
    one = score(hand_records(), n_resamples=50)["overall"]
    for model in ("m", "m2"):
        g = res["by_model"][model]
        assert (g["lift"], g["paired"]) == (one["lift"], one["paired"])
    assert res["overall"]["paired"]["help_rate"] == pytest.approx(1 / 3)
    assert res["overall"]["paired"]["delta_gm"] == pytest.approx(one["paired"]["delta_gm"])
    assert res["overall"]["paired"]["sign_test_p"] == pytest.approx(2 * (1 + 10 + 45 + 120 + 210) / 1024)  # 6 vs 4
