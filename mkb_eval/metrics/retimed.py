"""Re-timed pairs: a unit's paired speedup ratio from interleaved re-timing rounds, with its interval.

A run's ``retime.jsonl`` holds, per (problem, replicate), timing windows of every final kernel in
interleaved rounds (see ``mkb_eval.agent.retiming``). For a unit (problem, direction a2b,
replicate) the ratio of round r is ``base_ms_r / skill_ms_r`` (the speedup ratio skill / base: both
share the run's eager baseline, so it cancels); the unit's ratio is exp(mean of ln ratios over the
usable rounds) and its interval a Student t interval on the ln ratios. A round is usable when both
windows are ``ok`` with a time. The verdict uses one timer, stated in every result: the end-to-end
time (``kernel_ms``, the benchmark's time), the parent-attested per-call time (``attested_ms``: the
calls back to back under the parent's clock, the host path overlapped) or the device time
(``device_ms``, the GPU's work alone, as the worker reports it); the ratios by a second timer are
kept beside it (the device time, or the end-to-end time when the verdict is on the device time).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval.metrics.inputs import DIRECTIONS, InputError

TIMERS = ("kernel_ms", "attested_ms", "device_ms")
DEFAULT_TIMER = "kernel_ms"
# two-sided 95% Student t quantiles by degrees of freedom (1..30); above 30 the normal 1.96 is within 4%
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042)


def t95(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("a t interval needs at least 2 rounds")
    return _T95[df - 1] if df <= len(_T95) else 1.96


@dataclass(frozen=True)
class PairedTiming:
    """The re-timed pair of one unit; ratios are speedup ratios skill / base (> 1: the skill is faster)."""

    problem_id: int
    direction: str
    replicate: int
    model: str
    tier: str
    rounds: int                               # rounds asked for
    log_ratios: tuple[float, ...]             # ln(base_ms / skill_ms) per usable round, by the verdict's timer
    other_log_ratios: tuple[float, ...]       # the same by the other timer (empty where it was not recorded)
    timer: str
    median_ms: Mapping[str, float]            # re-timed median per arm (source, base, skill) by the timer

    @property
    def n(self) -> int:
        return len(self.log_ratios)

    @property
    def status(self) -> str:
        """``ok`` (an interval exists), ``unverified`` (CPU tier: nothing timed) or ``insufficient``."""
        if self.n >= 2:
            return "ok"
        return "unverified" if self.tier == "cpu" else "insufficient"

    @property
    def mean_log(self) -> float | None:
        return math.fsum(self.log_ratios) / self.n if self.n else None

    @property
    def ratio(self) -> float | None:
        m = self.mean_log
        return None if m is None else math.exp(m)

    def interval(self) -> tuple[float, float] | None:
        """95% t interval of the speedup ratio (exp of the interval of the mean ln ratio)."""
        if self.n < 2:
            return None
        m = self.mean_log
        assert m is not None
        half = t95(self.n - 1) * statistics.stdev(self.log_ratios) / math.sqrt(self.n)
        return math.exp(m - half), math.exp(m + half)

    @property
    def other_ratio(self) -> float | None:
        xs = self.other_log_ratios
        return math.exp(math.fsum(xs) / len(xs)) if xs else None


def _windows(entry: Mapping[str, Any], timer: str) -> dict[int, dict[str, float]]:
    """{round: {label: time}} of the usable windows."""
    out: dict[int, dict[str, float]] = {}
    for w in entry.get("windows") or []:
        if not isinstance(w, Mapping) or w.get("status") != "ok":
            continue
        v = w.get(timer)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            out.setdefault(int(w.get("round", 0)), {})[str(w.get("label"))] = float(v)
    return out


def _log_ratios(rounds: Mapping[int, Mapping[str, float]], base: str, skill: str) -> tuple[float, ...]:
    return tuple(math.log(r[base] / r[skill]) for _, r in sorted(rounds.items()) if base in r and skill in r)


def pairs_from_entry(entry: Mapping[str, Any], timer: str = DEFAULT_TIMER) -> list[PairedTiming]:
    """The units' pairs one re-timing gives (both directions where both arms were re-timed)."""
    from mkb_eval.metrics.units import direction_arms

    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {', '.join(TIMERS)}, not {timer!r}")
    other = "kernel_ms" if timer == "device_ms" else "device_ms"
    labels = set(entry.get("kernels") or {}) | set(entry.get("labels") or [])
    main, alt = _windows(entry, timer), _windows(entry, other)
    out = []
    for d in DIRECTIONS:
        source, base, skill = direction_arms(d)
        if base not in labels or skill not in labels:
            continue
        medians = {}
        for role, arm in (("source", source), ("base", base), ("skill", skill)):
            xs = [r[arm] for r in main.values() if arm in r]
            if xs:
                medians[role] = statistics.median(xs)
        settings = entry.get("settings") or {}
        out.append(PairedTiming(
            problem_id=int(entry["problem_id"]), direction=d, replicate=int(entry.get("replicate", 1)),
            model=str(entry.get("model") or "unknown"), tier=str(entry.get("tier", "gpu")),
            rounds=int(settings.get("rounds", 0)), log_ratios=_log_ratios(main, base, skill),
            other_log_ratios=_log_ratios(alt, base, skill), timer=timer, median_ms=medians))
    return out


UnitKey = tuple[str, int, str, int]
"""(model, problem, direction, replicate)."""


def read_retimes(source: str | Path | Iterable[Mapping[str, Any]], timer: str = DEFAULT_TIMER,
                 kernels: Mapping[str, str | None] | None = None) -> dict[UnitKey, PairedTiming]:
    """The latest re-timed pair per unit from a run folder, a ``retime.jsonl`` file or entries.

    A file is read strictly (:func:`mkb_eval.run_record.read_retimes`: older versions migrated, a bad
    line an error naming it; a torn last line of a killed run is skipped, that group is re-timed by the
    next run). Entries given directly are read as mappings, only the fields a pair needs.
    ``kernels`` (trial -> final kernel sha256, from the attempt records) keeps only re-timings of the
    kernels the records now hold: a trial run again after its re-timing is not paired with old times.
    """
    entries: list[Any]
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            path = path / "retime.jsonl"
        from mkb_eval.run_record import read_retimes as read_file      # pydantic: only where a file is read

        entries = [r.to_json() for r in read_file(path)]
    else:
        entries = list(source)
    out: dict[UnitKey, PairedTiming] = {}
    for e in entries:
        if not isinstance(e, Mapping) or e.get("kind") != "retime":
            continue
        if "problem_id" not in e:
            raise InputError("a retime entry lacks problem_id")
        if kernels is not None:
            ks = e.get("kernels") or {}
            if any(kernels.get(v.get("trial")) not in (None, v.get("sha256")) for v in ks.values()):
                continue
        for p in pairs_from_entry(e, timer):
            out[(p.model, p.problem_id, p.direction, p.replicate)] = p
    return out


def retimed_unit(unit: Any, timing: PairedTiming | None) -> Any:
    """The unit with each passed attempt's time and speedup replaced by its re-timed median (same eager)."""
    import dataclasses

    if timing is None:
        return unit
    repl = {}
    for role in ("source", "base", "skill"):
        o = getattr(unit, role)
        ms = timing.median_ms.get(role)
        if o is None or ms is None or not o.passed or o.eager_ms is None:
            continue
        repl[role] = dataclasses.replace(o, kernel_ms=ms, speedup=o.eager_ms / ms)
    return dataclasses.replace(unit, **repl) if repl else unit


def run_timings(run_dir: str | Path, timer: str = DEFAULT_TIMER) -> dict[UnitKey, PairedTiming] | None:
    """A run folder's re-timed pairs (None when it holds no ``retime.jsonl``), paired only with the final
    kernels its attempt records hold now."""
    run = Path(run_dir)
    if not (run / "retime.jsonl").is_file():
        return None
    kernels: dict[str, str | None] = {}
    if (run / "attempts.jsonl").is_file():
        for line in (run / "attempts.jsonl").read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("trial"), str):
                kernels[rec["trial"]] = rec.get("final_kernel_sha256")
    return read_retimes(run, timer, kernels)


def run_gpu(run_dir: str | Path) -> str | None:
    """The GPU model the run's re-timings ran on (from their environment), if any."""
    from mkb_eval.run_record import read_retimes as read_file

    for r in read_file(Path(run_dir) / "retime.jsonl"):
        if r.env.get("gpu"):
            return str(r.env["gpu"])
    return None


# What an A/A run (the same kernel on both sides) must show before a GPU's paired verdicts are trusted, and an
# A/B run (one side made ~10% slower) must detect: issue 26's criteria, applied to every summary the toolkit reads.
AA_LIMITS = {"false_help": 0.05, "false_harm": 0.05, "gm_ratio_bias": 0.01, "ratio_p95_abs_dev": 0.03}
AA_MIN_UNITS, AA_MIN_RESOLVED_SHARE, AB_MIN_DETECTED = 24, 0.9, 0.9
# the suffix of each timer's keys in an aa_ab.py summary (the verdict's default timer has none)
TIMER_SUFFIX = {"kernel_ms": "", "attested_ms": "_attested", "device_ms": "_device"}


def aa_check(summary: Mapping[str, Any], timer: str = DEFAULT_TIMER) -> dict[str, Any]:
    """One timer's A/A (and, where run, A/B) figures of an ``aa_ab.py`` summary, with ``passed`` and the
    criteria it missed (``failures``): a floor measured on too few resolved units, or missing, does not pass."""
    if timer not in TIMER_SUFFIX:
        raise ValueError(f"timer must be one of {', '.join(TIMERS)}, not {timer!r}")
    sfx = TIMER_SUFFIX[timer]
    got = {k: summary.get(k + sfx) for k in ("units", "units_total", *AA_LIMITS, "ab_slow_detected", "ab_fast_detected")}
    failures = []
    units, total = got["units"] or 0, got["units_total"] or 0
    if units < AA_MIN_UNITS or units < AA_MIN_RESOLVED_SHARE * total:
        failures.append(f"{units} of {total} units resolved (needs {AA_MIN_UNITS}+ and {AA_MIN_RESOLVED_SHARE:.0%})")
    for k, limit in AA_LIMITS.items():
        v = got[k]
        if not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > limit:
            failures.append(f"{k} {'missing' if v is None else f'{v:+.4f}'} (limit ±{limit:g})")
    for k in ("ab_slow_detected", "ab_fast_detected"):
        v = got[k]
        if v is None:
            failures.append(f"{k}: A/B not run")
        elif v < AB_MIN_DETECTED:
            failures.append(f"{k} {v:.2f} (needs {AB_MIN_DETECTED:g})")
    return {**got, "timer": timer, "rounds": summary.get("rounds"), "passed": not failures, "failures": failures}


def noise_floor(gpu: str | None, results: str | Path | None = None,
                timer: str = DEFAULT_TIMER) -> dict[str, Any] | None:
    """The A/A noise floor measured on this GPU model by the verdict's ``timer``: the newest
    ``results/<gpu>/<date>_aa/summary.json`` whose ``gpu`` is this one, as :func:`aa_check` reads it (units,
    false help/harm, bias, 95th percentile of |ratio - 1|, whether the A/A and A/B criteria are met), or None."""
    if not gpu:
        return None
    root = Path(results) if results else Path(__file__).resolve().parents[2] / "results"
    for path in sorted(root.glob("*/*_aa/summary.json"), reverse=True):
        try:
            s = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(s, dict) and s.get("gpu") == gpu:
            return {**aa_check(s, timer), "source": str(path.relative_to(root.parent))}
    return None
