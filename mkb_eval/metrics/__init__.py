"""MetaKernelBench metrics: pure functions over attempt outcomes, plus thin `evaluate` modules.

Typical use::

    from mkb_eval.metrics import read_attempts, score
    results = score(read_attempts("runs/my_run"))   # dict, JSON-serializable
    results["overall"]["lift"]["S"], results["overall"]["paired"]["help_rate"]

Definitions are in ``LEGEND`` and in the cards of ``evaluate_modules/``.
"""

from mkb_eval.metrics.definitions import LEGEND
from mkb_eval.metrics.inputs import (
    ARM_DSL,
    ARMS,
    DIRECTIONS,
    SCHEMA_VERSION,
    STATUSES,
    AttemptOutcome,
    InputError,
    LoadResult,
    SchemaVersionError,
    outcome_from_dict,
    read_attempts,
)
from mkb_eval.metrics.ladder import (
    FAST_P_THRESHOLDS,
    LADDER_KEYS,
    RATE_KEYS,
    THRESHOLDS,
    fast_p,
    geomean_speedup,
    ladder,
    lift,
    score_attempts,
)
from mkb_eval.metrics.paired import (
    FLOOR,
    NOISE_MARGIN,
    TIER_LABELS,
    UnitScore,
    effective_speedup,
    log_ratio,
    paired_outcome,
    score_unit,
    standing,
    tier,
    tier_label,
)
from mkb_eval.metrics.stats import bootstrap_cis, sign_test
from mkb_eval.metrics.summary import (
    RESULTS_VERSION,
    delta_gm,
    paired_counts,
    score,
    score_units,
    standing_table,
)
from mkb_eval.metrics.units import Unit, build_units, direction_arms

__all__ = [
    "ARMS",
    "ARM_DSL",
    "DIRECTIONS",
    "FAST_P_THRESHOLDS",
    "FLOOR",
    "LADDER_KEYS",
    "LEGEND",
    "NOISE_MARGIN",
    "RATE_KEYS",
    "RESULTS_VERSION",
    "SCHEMA_VERSION",
    "STATUSES",
    "THRESHOLDS",
    "TIER_LABELS",
    "AttemptOutcome",
    "InputError",
    "LoadResult",
    "SchemaVersionError",
    "Unit",
    "UnitScore",
    "bootstrap_cis",
    "build_units",
    "delta_gm",
    "direction_arms",
    "effective_speedup",
    "fast_p",
    "geomean_speedup",
    "ladder",
    "lift",
    "log_ratio",
    "outcome_from_dict",
    "paired_counts",
    "paired_outcome",
    "read_attempts",
    "score",
    "score_attempts",
    "score_unit",
    "score_units",
    "sign_test",
    "standing",
    "standing_table",
    "tier",
    "tier_label",
]
