"""Paired units: (problem, direction a2b, replicate) with its source, base and skill attempts.

Every solo attempt serves twice (source of one direction, base of the other), so units are built
from the attempts rather than stored. A unit is resolved when all three attempts exist and none
has an infrastructure error; only resolved units enter the metrics (as in the original).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mkb_eval.metrics.inputs import DIRECTIONS, AttemptOutcome


def direction_arms(direction: str) -> tuple[str, str, str]:
    """(source, base, skill) arms of a direction ``a2b``: solo_a, solo_b, a2b_skill."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {', '.join(DIRECTIONS)}")
    a, b = direction.split("2")
    return f"solo_{a}", f"solo_{b}", f"{direction}_skill"


@dataclass(frozen=True)
class Unit:
    """One paired comparison; any of the three attempts may be missing (None)."""

    problem_id: int
    direction: str
    replicate: int = 1
    family: str = "unknown"
    model: str = "unknown"
    source: AttemptOutcome | None = None
    base: AttemptOutcome | None = None
    skill: AttemptOutcome | None = None

    @property
    def unresolved_reason(self) -> str | None:
        """"missing" (an attempt is absent), "error" (an infrastructure error), or None."""
        trio = (self.source, self.base, self.skill)
        if any(o is None for o in trio):
            return "missing"
        if any(o is not None and o.error is not None for o in trio):
            return "error"
        return None

    @property
    def resolved(self) -> bool:
        return self.unresolved_reason is None

    @property
    def has_skill(self) -> bool:
        """The source wrote a usable SKILL.md, so the skill attempt really ran with it."""
        return self.skill is not None and not self.skill.skipped

    @property
    def skill_outcome(self) -> AttemptOutcome | None:
        """The skill attempt, or the base attempt when the skill was skipped (nothing transferred)."""
        if self.skill is not None and self.skill.skipped:
            return self.base
        return self.skill


def build_units(outcomes: Iterable[AttemptOutcome]) -> list[Unit]:
    """Both directions' units for every (model, problem, replicate) that has any attempt.

    Sorted by (model, problem, direction, replicate), so scoring is order-independent.
    """
    by_key: dict[tuple[str, int, int], dict[str, AttemptOutcome]] = {}
    family: dict[int, str] = {}
    for o in outcomes:
        by_key.setdefault((o.model, o.problem_id, o.replicate), {})[o.arm] = o
        if o.family != "unknown" or o.problem_id not in family:
            family[o.problem_id] = o.family
    units = []
    for (model, pid, rep), arms in by_key.items():
        for direction in DIRECTIONS:
            src, base, skill = direction_arms(direction)
            units.append(
                Unit(
                    problem_id=pid,
                    direction=direction,
                    replicate=rep,
                    family=family[pid],
                    model=model,
                    source=arms.get(src),
                    base=arms.get(base),
                    skill=arms.get(skill),
                )
            )
    return sorted(units, key=lambda u: (u.model, u.problem_id, u.direction, u.replicate))
