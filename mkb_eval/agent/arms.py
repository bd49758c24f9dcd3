"""Arms and trials: which DSL an arm runs in, which solo a skill arm takes its skill from.

The names are the vocabulary's (``mkb_eval.vocab``), which the metrics read too, so a run is scored as written.
For a direction a→b: source = ``solo_a``, base = ``solo_b``, skill = ``a2b_skill`` (in DSL b).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mkb_eval.vocab import ARM_DSL, ARMS, SKILL_ARMS, trial_name

SOURCE_ARM = {"cutedsl2tirx_skill": "solo_cutedsl", "tirx2cutedsl_skill": "solo_tirx"}
DIRECTION = {"cutedsl2tirx_skill": "cutedsl2tirx", "tirx2cutedsl_skill": "tirx2cutedsl"}
_TRIAL_RE = re.compile(r"^p(\d{2,})_r(\d+)_(" + "|".join(ARMS) + r")$")


class ArmError(ValueError):
    """An unknown arm or a malformed trial id."""


@dataclass(frozen=True, order=True)
class TrialKey:
    """One trial: problem, replicate, arm (``p<NN>_r<k>_<arm>``)."""

    problem_id: int
    replicate: int
    arm: str

    def __post_init__(self) -> None:
        if self.arm not in ARM_DSL:
            raise ArmError(f"unknown arm {self.arm!r}; arms: {', '.join(ARMS)}")
        if self.replicate < 1:
            raise ArmError(f"replicate must be >= 1, got {self.replicate}")

    @property
    def id(self) -> str:
        return trial_name(self.problem_id, self.replicate, self.arm)

    @property
    def dsl(self) -> str:
        return ARM_DSL[self.arm]

    @property
    def is_skill(self) -> bool:
        return self.arm in SKILL_ARMS

    @property
    def source(self) -> TrialKey | None:
        """The solo trial whose SKILL.md this (skill) trial receives."""
        return TrialKey(self.problem_id, self.replicate, SOURCE_ARM[self.arm]) if self.is_skill else None


def parse_trial(text: str) -> TrialKey:
    m = _TRIAL_RE.match(text)
    if not m:
        raise ArmError(f"trial id {text!r} is not p<NN>_r<k>_<arm>")
    return TrialKey(int(m.group(1)), int(m.group(2)), m.group(3))


def parse_arms(text: str) -> list[str]:
    """Comma-separated arms, or ``all``; keeps the canonical order."""
    if text.strip() == "all":
        return list(ARMS)
    want = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in want if a not in ARM_DSL]
    if bad or not want:
        raise ArmError(f"unknown arm(s) {', '.join(bad) or '(none given)'}; arms: {', '.join(ARMS)} or all")
    return [a for a in ARMS if a in want]
