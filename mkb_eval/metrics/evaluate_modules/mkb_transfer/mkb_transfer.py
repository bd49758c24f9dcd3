"""MetaKernelBench skill transfer (base vs skill, with source standing) as an HF `evaluate` Comparison.

A thin wrapper over ``mkb_eval.metrics``. No ``import a, b`` lines: evaluate parses imports with a regex.
"""

from typing import Any

import datasets
import evaluate

from mkb_eval.metrics.inputs import DIRECTIONS, InputError, outcome_from_dict
from mkb_eval.metrics.paired import FLOOR, NOISE_MARGIN
from mkb_eval.metrics.stats import CONFIDENCE, N_RESAMPLES, SEED
from mkb_eval.metrics.summary import score_units
from mkb_eval.metrics.units import Unit, direction_arms

_CITATION = """\
@article{metakernelbench2026,
  title   = {MetaKernelBench: Measuring GPU Kernel Knowledge Transfer Beyond Code},
  journal = {arXiv preprint arXiv:2610.05014},
  year    = {2026}
}
"""

_DESCRIPTION = """\
Paired comparison of a no-skill base attempt (predictions1) and a skill attempt (predictions2) at
the same problem in the same DSL, the skill attempt having received the SKILL.md written by a
source attempt in the other DSL (source). One row per unit (problem, direction, replicate).
Returns the R@t / S ladders of base and skill and their lift (as in the original MetaKernelBench),
the paired outcomes (helped / harmed / neutral, help rate T, harm rate H, ΔGM), the outcomes split
by the source's tier relative to the base's (above / same / below), an exact sign test, and
percentile bootstrap intervals over problems. A skipped skill (predictions2.skipped = true: the
source wrote no usable SKILL.md) counts as the base's outcome and as neutral. Empty groups give
None, never 0. Every definition is in the module card.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions1 (`list` of `dict`): base attempts (solo in the target DSL), each
        {"status": str, "speedup": float | None, "kernel_ms": float | None, "skipped": bool}.
    predictions2 (`list` of `dict`): skill attempts, same keys; "skipped": true if nothing was transferred.
    source (`list` of `dict`): source attempts (solo in the other DSL), same keys, "skipped" false.
    problem_id (`list` of `int`): problem of each unit (the bootstrap resamples problems).
    direction (`list` of `str`): "cutedsl2tirx" or "tirx2cutedsl".
    family (`list` of `str`): problem family, for the per-family breakdown.
    margin (`float`, default 0.05): relative runtime margin within which same-tier passes tie.
    floor (`float`, default 0.01): speedup given to failed attempts in ΔGM.
    n_resamples (`int`, default 2000), seed (`int`, default 0), confidence (`float`, default 0.95):
        the problem-level bootstrap.
Returns:
    lift_S, help_rate, harm_rate, delta_gm (%), sign_test_p: headline numbers (`float` or None);
    n_units, n_resolved, base, skill, lift (R@0 ... R@4, S), paired, standing (above/same/below:
    n, helped, harmed, neutral, help_rate, harm_rate), with_skill, by_source_verdict, ci
    ([low, high] per headline key), by_direction, by_family, params.
Examples:

    >>> import evaluate
    >>> transfer = evaluate.load("mkb_eval/metrics/evaluate_modules/mkb_transfer")
    >>> def ok(speedup, ms):
    ...     return {"status": "ok", "speedup": speedup, "kernel_ms": ms, "skipped": False}
    >>> fail = {"status": "incorrect", "speedup": None, "kernel_ms": None, "skipped": False}
    >>> r = transfer.compute(
    ...     predictions1=[fail, ok(1.0, 2.0)],
    ...     predictions2=[ok(2.0, 1.0), ok(1.0, 2.0)],
    ...     source=[ok(1.5, 1.0), fail],
    ...     problem_id=[28, 36],
    ...     direction=["cutedsl2tirx", "cutedsl2tirx"],
    ...     family=["mlp_norm", "mlp_norm"],
    ... )
    >>> r["base"]["S"], r["skill"]["S"], r["lift_S"]
    (30.0, 70.0, 40.0)
    >>> r["help_rate"], r["harm_rate"], round(r["delta_gm"], 2)
    (0.5, 0.0, 1314.21)
    >>> r["standing"]["above"]["help_rate"], r["standing"]["below"]["help_rate"]
    (1.0, 0.0)
    >>> r["by_direction"]["tirx2cutedsl"]["lift"]["S"] is None
    True
"""

_OUTCOME = {
    "status": datasets.Value("string"),
    "speedup": datasets.Value("float64"),
    "kernel_ms": datasets.Value("float64"),
    "skipped": datasets.Value("bool"),
}


def _units(
    predictions1: list[dict[str, Any]],
    predictions2: list[dict[str, Any]],
    source: list[dict[str, Any]],
    problem_id: list[int],
    direction: list[str],
    family: list[str],
) -> list[Unit]:
    """Units from the row-wise inputs, with errors that name the row."""
    units: list[Unit] = []
    rows = zip(predictions1, predictions2, source, problem_id, direction, family, strict=True)
    for i, (base, skill, src, pid, d, fam) in enumerate(rows):
        if d not in DIRECTIONS:
            raise ValueError(f"direction[{i}]: expected one of {', '.join(DIRECTIONS)}, got {d!r}")
        arms = direction_arms(d)
        made = []
        roles = (("source", src, arms[0]), ("predictions1", base, arms[1]), ("predictions2", skill, arms[2]))
        for name, rec, arm in roles:
            try:
                made.append(outcome_from_dict({**rec, "problem_id": pid, "arm": arm, "family": fam}, f"{name}[{i}]"))
            except InputError as e:
                raise ValueError(str(e)) from None
        source_o, base_o, skill_o = made
        units.append(Unit(problem_id=pid, direction=d, family=fam, source=source_o, base=base_o, skill=skill_o))
    return units


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MkbTransfer(evaluate.Comparison):
    """Skill vs base: lift, help/harm rates, ΔGM, relative standing, sign test, bootstrap intervals."""

    def _info(self) -> evaluate.ComparisonInfo:
        return evaluate.ComparisonInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions1": _OUTCOME,
                    "predictions2": _OUTCOME,
                    "source": _OUTCOME,
                    "problem_id": datasets.Value("int64"),
                    "direction": datasets.Value("string"),
                    "family": datasets.Value("string"),
                }
            ),
            homepage="https://arxiv.org/abs/2610.05014",
        )

    def _compute(
        self,
        predictions1: list[dict[str, Any]],
        predictions2: list[dict[str, Any]],
        source: list[dict[str, Any]],
        problem_id: list[int],
        direction: list[str],
        family: list[str],
        margin: float = NOISE_MARGIN,
        floor: float = FLOOR,
        n_resamples: int = N_RESAMPLES,
        seed: int = SEED,
        confidence: float = CONFIDENCE,
    ) -> dict[str, Any]:
        units = _units(predictions1, predictions2, source, problem_id, direction, family)
        res = score_units(
            units, margin=margin, floor=floor, n_resamples=n_resamples, seed=seed, confidence=confidence
        )
        overall = res["overall"]
        return {
            "lift_S": overall["lift"]["S"],
            "help_rate": overall["paired"]["help_rate"],
            "harm_rate": overall["paired"]["harm_rate"],
            "delta_gm": overall["paired"]["delta_gm"],
            "sign_test_p": overall["paired"]["sign_test_p"],
            **overall,
            "by_direction": res["by_direction"],
            "by_family": res["by_family"],
            "params": res["params"],
        }
