"""The paired verdict on re-timed pairs: intervals, the neutral band, interleaving against a drifting fake clock,
the CPU tier (unresolved), and the original definition kept as a named variant."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from mkb_eval import problems as P
from mkb_eval.agent.retiming import RetimeGroup, RetimeKernel, RetimeSettings, result_entry
from mkb_eval.metrics import score
from mkb_eval.metrics.retimed import TIMERS, PairedTiming, aa_check, noise_floor, pairs_from_entry, read_retimes, t95
from tests.agent.fake_retime import FakeRetime

ARMS = ("cutedsl2tirx_skill", "solo_cutedsl", "solo_tirx", "tirx2cutedsl_skill")
SHA = "5" * 64          # the kernels' hash (the pairing reads it only to match the attempt records)


def _records(pid: int, model: str = "m", status: str = "ok") -> list[dict[str, Any]]:
    return [{"schema_version": 1, "kind": "attempt", "trial": f"p{pid:02d}_r1_{a}", "model": model, "status": status,
             "kernel_ms": 1.0, "eager_ms": 2.0, "speedup": 2.0 if status == "ok" else None} for a in ARMS]


def _entry(tmp: Path, pid: int, speed: dict[str, float], model: str = "m", **fake: Any) -> dict[str, Any]:
    kernels = []
    for a in ARMS:
        p = tmp / f"{pid}_{a}.py"
        p.write_text(f"# {a}\n")
        kernels.append(RetimeKernel(a, f"p{pid:02d}_r1_{a}", "tirx", p, SHA))
    group = RetimeGroup(pid, 1, tuple(kernels))
    rt = FakeRetime(speed=lambda label, sha: speed.get(label, 1.0), **fake)
    res = rt(P.find(pid), {k.label: (k.dsl, k.path) for k in kernels}, rounds=6, seed=pid)
    return result_entry(group, res, RetimeSettings(rounds=6), res.tier, model, 0.0)


def test_t_interval_by_hand() -> None:
    t = PairedTiming(1, "cutedsl2tirx", 1, "m", "gpu", 3, (0.1, 0.2, 0.3), (), "kernel_ms", {})
    lo, hi = t.interval()
    half = 4.303 * 0.1 / math.sqrt(3)
    assert t95(2) == 4.303 and t.status == "ok"
    assert lo == pytest.approx(math.exp(0.2 - half)) and hi == pytest.approx(math.exp(0.2 + half))
    one = PairedTiming(1, "cutedsl2tirx", 1, "m", "gpu", 3, (0.1,), (), "kernel_ms", {})
    assert one.interval() is None and one.status == "insufficient"


@pytest.mark.parametrize("slow_arm, expect", [(None, "neutral"), ("cutedsl2tirx_skill", "harmed"),
                                              ("solo_tirx", "helped")])
def test_aa_and_ab_against_a_drifting_clock(tmp_path: Path, slow_arm: str | None, expect: str) -> None:
    """Identical kernels come out neutral although the clock slows 1% per window (order alternated);
    a kernel 10% slower on either side of cutedsl2tirx is detected."""
    entries, recs = [], []
    for pid in (28, 36, 1, 20):
        entries.append(_entry(tmp_path, pid, {slow_arm: 1.10} if slow_arm else {}))
        recs += _records(pid)
    res = score(recs, timings=read_retimes(entries))
    rows = [r for r in res["units"] if r["direction"] == "cutedsl2tirx"]
    assert [r["outcome"] for r in rows] == [expect] * 4
    other = [r for r in res["units"] if r["direction"] == "tirx2cutedsl"]
    assert [r["outcome"] for r in other] == ["neutral"] * 4            # its pair holds identical kernels
    if slow_arm is None:
        assert abs(res["overall"]["paired"]["delta_gm"]) < 1.0
        assert all(abs(r["paired_ratio"] - 1) < 0.01 for r in res["units"])
    assert res["params"]["verdict"] == "paired" and res["params"]["band"] == 0.03 and res["params"]["rounds"] == [6]


def test_without_alternation_the_drift_leaks_into_the_ratio(tmp_path: Path) -> None:
    """The same order every round turns a 3%-per-window drift into a false verdict: why rounds alternate."""
    e = _entry(tmp_path, 28, {}, alternate=False, drift_per_window=0.03)
    pairs = {p.direction: p for p in pairs_from_entry(e)}
    assert pairs["cutedsl2tirx"].interval()[0] > 1.03                # base timed after the skill every round
    e2 = _entry(tmp_path, 28, {}, alternate=True, drift_per_window=0.03)
    assert all(p.interval()[0] <= 1.03 and p.interval()[1] >= 1 / 1.03 for p in pairs_from_entry(e2))


def test_cpu_tier_windows_leave_units_unresolved(tmp_path: Path) -> None:
    res = score(_records(28, status="unverified"), timings=read_retimes([_entry(tmp_path, 28, {}, tier="cpu")]))
    o = res["overall"]
    assert o["n_resolved"] == 0 and o["n_unresolved_unverified"] == 2 and o["paired"]["helped"] == 0
    # passed attempts whose re-timing is the CPU tier's (or missing) are not guessed at either
    res = score(_records(28), timings={})
    assert res["overall"]["n_resolved"] == 0 and res["overall"]["n_unresolved_not_retimed"] == 2


def test_original_verdict_is_kept_and_a_stale_retiming_is_ignored(tmp_path: Path) -> None:
    recs = _records(28)
    recs[0]["kernel_ms"] = 0.9                       # the skill's submission-time time: 10% faster
    e = _entry(tmp_path, 28, {})
    original = score(recs, timings=read_retimes([e]), verdict="original")
    assert original == score(recs)                   # the paper's definition, on submission-time numbers
    assert [r["outcome"] for r in original["units"]][0] == "helped"
    paired = score(recs, timings=read_retimes([e]))
    assert [r["outcome"] for r in paired["units"]][0] == "neutral"
    kernels = {t: ("other" if t.endswith("solo_tirx") else SHA) for t in (r["trial"] for r in recs)}
    assert read_retimes([e], kernels=kernels) == {}   # a trial run again since: its old re-timing is not used


@pytest.mark.parametrize("timer", TIMERS)
def test_every_timer_gives_the_verdict_and_keeps_a_second_one_beside_it(tmp_path: Path, timer: str) -> None:
    """End-to-end, parent-attested or device time: a 10% slower skill arm is harmed by each, and the ratios by a
    second timer (device time, or end-to-end for a device-time verdict) stay beside it."""
    entries, recs = [], []
    for pid in (28, 36):
        entries.append(_entry(tmp_path, pid, {"cutedsl2tirx_skill": 1.10}))
        recs += _records(pid)
    timings = read_retimes(entries, timer)
    res = score(recs, timings=timings, timer=timer)
    assert [r["outcome"] for r in res["units"] if r["direction"] == "cutedsl2tirx"] == ["harmed"] * 2
    assert res["params"]["timer"] == timer and all(t.timer == timer and t.other_log_ratios for t in timings.values())
    with pytest.raises(ValueError, match="timer must be one of"):
        read_retimes(entries, "wall_ms")


def _summary(**over: Any) -> dict[str, Any]:
    """An aa_ab.py summary that meets every criterion by each timer, with ``over`` replaced."""
    good = {"units": 46, "units_total": 46, "false_help": 0.0, "false_harm": 0.0217, "gm_ratio_bias": -0.004,
            "ratio_p95_abs_dev": 0.025, "ab_slow_detected": 1.0, "ab_fast_detected": 0.92}
    s: dict[str, Any] = {"gpu": "NVIDIA H200", "rounds": 5}
    for sfx in ("", "_attested", "_device"):
        s.update({k + sfx: v for k, v in good.items()})
    return {**s, **over}


def test_aa_check_passes_only_on_every_criterion() -> None:
    assert aa_check(_summary())["passed"] and aa_check(_summary(), "device_ms")["failures"] == []
    bad = aa_check(_summary(false_help=0.06, gm_ratio_bias=-0.035, ratio_p95_abs_dev=float("nan")))
    assert not bad["passed"] and bad["failures"] == ["false_help +0.0600 (limit ±0.05)",
                                                     "gm_ratio_bias -0.0350 (limit ±0.01)",
                                                     "ratio_p95_abs_dev +nan (limit ±0.03)"]
    assert aa_check(_summary(false_help=0.06))["passed"] is False
    assert aa_check(_summary(false_help=0.06), "device_ms")["passed"] is True      # each timer on its own keys
    # a partial run (the 2026-12-01 one: 17 of 46 units) and a missing A/B do not vouch for a GPU
    partial = aa_check(_summary(units=17, ab_slow_detected=None, ab_fast_detected=0.85))
    assert partial["failures"] == ["17 of 46 units resolved (needs 24+ and 90%)", "ab_slow_detected: A/B not run",
                                   "ab_fast_detected 0.85 (needs 0.9)"]
    assert "24 of 30" in aa_check(_summary(units=24, units_total=30))["failures"][0]
    with pytest.raises(ValueError, match="timer must be one of"):
        aa_check(_summary(), "wall_ms")


def test_the_noise_floor_is_read_for_the_verdicts_timer_and_says_whether_it_passed(tmp_path: Path) -> None:
    import json

    from mkb_eval.report.build import noise_floor_line

    results = tmp_path / "results"
    (results / "h200" / "2026-12-01_aa").mkdir(parents=True)
    (results / "h200" / "2026-12-01_aa" / "summary.json").write_text(json.dumps(_summary(units=17)))
    (results / "h200" / "2026-12-03_aa").mkdir(parents=True)
    (results / "h200" / "2026-12-03_aa" / "summary.json").write_text(
        json.dumps(_summary(ratio_p95_abs_dev=0.49, ratio_p95_abs_dev_device=0.021)))
    assert noise_floor("NVIDIA B200", results) is None and noise_floor(None, results) is None
    e2e = noise_floor("NVIDIA H200", results)                    # the newest summary of this GPU
    assert e2e is not None and e2e["source"] == "results/h200/2026-12-03_aa/summary.json"
    assert e2e["ratio_p95_abs_dev"] == 0.49 and not e2e["passed"]
    dev = noise_floor("NVIDIA H200", results, timer="device_ms")
    assert dev is not None and dev["ratio_p95_abs_dev"] == 0.021 and dev["passed"] and dev["timer"] == "device_ms"
    line = noise_floor_line(e2e)
    assert "within ±49.00% over 46 of 46 units" in line and "; the A/A and A/B tests do not pass (" in line
    assert "ratio_p95_abs_dev +0.4900" in line
    assert noise_floor_line(dev).endswith("; the A/A and A/B tests pass")
    assert noise_floor_line(None) == "A/A noise floor on this GPU: not measured (run scripts/aa_ab.py)"


def test_the_committed_partial_aa_run_does_not_pass() -> None:
    """The H200's partial A/A (2026-12-01: 17 of 46 units, no A/B) fails by every timer."""
    import json

    s = json.loads((Path(__file__).resolve().parents[2] / "results/h200/2026-12-01_aa/summary.json").read_text())
    for timer in TIMERS:
        assert not aa_check(s, timer)["passed"]
    assert "17 of 46 units resolved" in aa_check(s, "device_ms")["failures"][0]
