"""Sign test and problem-level bootstrap."""

from __future__ import annotations

import json

import pytest
from mkb_hand_records import hand_records, rec

from mkb_eval.metrics import bootstrap_cis, build_units, read_attempts, score, score_unit, sign_test


@pytest.mark.parametrize(
    ("helped", "harmed", "p"),
    [
        (0, 0, None),
        (1, 0, 1.0),
        (5, 0, 2 / 32),  # 0.0625
        (0, 5, 2 / 32),
        (9, 1, 2 * (1 + 10) / 1024),  # 0.021484375
        (3, 2, 1.0),
        (10, 10, 1.0),
        (15, 5, 2 * sum((1, 20, 190, 1140, 4845, 15504)) / 2**20),  # 0.04138946533203125
    ],
)
def test_sign_test_exact(helped: int, harmed: int, p: float | None) -> None:
    assert sign_test(helped, harmed) == p


def test_sign_test_symmetric_and_tiny() -> None:
    assert sign_test(30, 2) == sign_test(2, 30)
    assert 0.0 < sign_test(1000, 0) < 1e-300  # exact arithmetic, no underflow to a wrong 0 before the end


def scores_of(records: list[dict]) -> list:
    return [score_unit(u) for u in build_units(read_attempts(records).outcomes) if u.resolved]


def test_single_problem_interval_is_degenerate() -> None:
    recs = [r for r in hand_records() if r["problem_id"] == 36]
    cis = bootstrap_cis(scores_of(recs), n_resamples=50)
    # resampling the only problem always gives the same units: lift S -50, T 0, H 1, ΔGM of u5, u6
    res = score(recs, n_resamples=50)["overall"]
    assert cis["lift_S"] == (res["lift"]["S"], res["lift"]["S"]) == (-50.0, -50.0)
    assert cis["help_rate"] == (0.0, 0.0) and cis["harm_rate"] == (1.0, 1.0)
    assert cis["delta_gm"][0] == pytest.approx(res["paired"]["delta_gm"])


def test_bootstrap_is_seeded_and_seed_matters() -> None:
    s = scores_of(hand_records())
    a = bootstrap_cis(s, n_resamples=300, seed=1)
    assert a == bootstrap_cis(s, n_resamples=300, seed=1)
    assert a != bootstrap_cis(s, n_resamples=300, seed=2)


def test_bootstrap_resamples_problems_not_units() -> None:
    # p40 has 10 replicate units all helped, p41 has 10 all harmed: the problem, not the unit, is the draw,
    # so with 2 problems each resample gives T in {0, 0.5, 1} and never, e.g., 0.45
    recs = []
    for pid, skill in ((40, 2.0), (41, 0.5)):
        for rep in range(1, 11):
            recs += [rec(pid, "solo_cutedsl", "ok", 1.0, rep=rep), rec(pid, "solo_tirx", "ok", 1.0, rep=rep),
                     rec(pid, "cutedsl2tirx_skill", "ok", skill, rep=rep),
                     rec(pid, "tirx2cutedsl_skill", "skipped", rep=rep)]
    cis = bootstrap_cis([s for s in scores_of(recs) if s.unit.direction == "cutedsl2tirx"], n_resamples=400)
    assert cis["help_rate"] == (0.0, 1.0)


def test_empty_and_bad_parameters() -> None:
    assert bootstrap_cis([]) == {"lift_S": None, "help_rate": None, "harm_rate": None, "delta_gm": None}
    s = scores_of(hand_records())
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_cis(s, n_resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_cis(s, confidence=1.0)


def test_rescoring_is_bit_identical(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hand_records()))
    first = json.dumps(score(read_attempts(run)), sort_keys=True)
    second = json.dumps(score(read_attempts(run)), sort_keys=True)
    from_list = json.dumps(score(list(reversed(hand_records()[1:]))), sort_keys=True)
    assert first == second
    # order of records does not matter once the superseded line is gone (record counts differ only)
    a, b = json.loads(first), json.loads(from_list)
    for k in ("n_records", "n_superseded"):
        a.pop(k), b.pop(k)
    assert a == b
