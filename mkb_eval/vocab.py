"""The benchmark's closed vocabularies, in one leaf module every layer may import.

Statuses, DSLs, families, tiers, sizes, arms and directions used to be spelled in the problem loader, the record
module and the metrics' reader, and the agent took the attempt schema's constants from the metrics;
they live here now (as ``Literal`` types for the typed records, and as tuples) and those modules
re-export them.
"""

from __future__ import annotations

from typing import Literal, get_args

Dsl = Literal["cutedsl", "tirx"]
Family = Literal["attention", "kv_cache", "mlp_norm", "moe", "quantization", "linear_attention"]
Tier = Literal["gpu", "cpu"]
Size = Literal["full", "smoke"]     # a problem's input sizes: full (timed), smoke (the CPU tier's, and quick checks)
# one verification's outcome; implausible_time: a time below the problem's speed-of-light bound (beyond the
# SOL model's margin) that stood a re-time under the parent's clock
Status = Literal["ok", "incorrect", "compile_error", "runtime_error", "timeout", "crashed", "policy_violation",
                 "no_dsl_kernel", "implausible_time", "unverified"]
# one attempt's outcome: a verification status, or "skipped" (a skill arm whose source wrote no skill)
AttemptStatus = Literal[Status, "skipped"]
Direction = Literal["cutedsl2tirx", "tirx2cutedsl"]
Arm = Literal["solo_cutedsl", "solo_tirx", "cutedsl2tirx_skill", "tirx2cutedsl_skill"]

DSLS: tuple[str, ...] = get_args(Dsl)
FAMILIES: tuple[str, ...] = get_args(Family)
TIERS: tuple[str, ...] = get_args(Tier)
SIZES: tuple[str, ...] = get_args(Size)
STATUSES: tuple[str, ...] = get_args(Status)
ATTEMPT_STATUSES: tuple[str, ...] = get_args(AttemptStatus)
DIRECTIONS: tuple[str, ...] = get_args(Direction)
ARMS: tuple[str, ...] = get_args(Arm)
ARM_DSL = {
    "solo_cutedsl": "cutedsl",
    "solo_tirx": "tirx",
    "cutedsl2tirx_skill": "tirx",
    "tirx2cutedsl_skill": "cutedsl",
}
SKILL_ARMS = ("cutedsl2tirx_skill", "tirx2cutedsl_skill")


def trial_name(problem_id: int, replicate: int, arm: str) -> str:
    """The trial coordinate ``p<NN>_r<k>_<arm>`` used by the run store and every attempt record."""
    return f"p{problem_id:02d}_r{replicate}_{arm}"
