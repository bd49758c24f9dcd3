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
from mkb_eval.metrics.retimed import TIMERS, PairedTiming, pairs_from_entry, read_retimes, t95
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
