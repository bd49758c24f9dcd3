"""What a skill is: the text a solo attempt distilled, where it came from, and what it did.

A skill is written by a solo attempt in DSL a (the source) and transferred to an attempt at the
same problem in DSL b; its outcome compares that skill-conditioned attempt with the base (solo b)
attempt of the same replicate. The same record describes a released corpus file and a SKILL.md
found in a run folder. The outcome is the typed :class:`mkb_eval.skill_record.SkillOutcome`
(re-exported as ``Outcome``); a skill's released front matter and its dataset row are the
records of :mod:`mkb_eval.skill_record`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from mkb_eval.dsl import SPECS
from mkb_eval.metrics.inputs import DIRECTIONS, DSLS
from mkb_eval.skill_record import SkillOutcome as Outcome
from mkb_eval.skill_record import Verdict

VERDICTS: tuple[str, ...] = get_args(Verdict)
DSL_DISPLAY = {name: s.display for name, s in SPECS.items()}


class SkillError(ValueError):
    """A skill file, corpus or run folder cannot be read; the message names the file and the fault."""


def split_direction(direction: str) -> tuple[str, str]:
    """``cutedsl2tirx`` -> ("cutedsl", "tirx"); SkillError for anything else."""
    if direction not in DIRECTIONS:
        raise SkillError(f"unknown direction {direction!r}; expected one of {', '.join(DIRECTIONS)}")
    src, tgt = direction.split("2")
    return src, tgt


def direction_from(source_dsl: str) -> str:
    """The direction a solo attempt in ``source_dsl`` is the source of."""
    if source_dsl not in DSLS:
        raise SkillError(f"unknown DSL {source_dsl!r}")
    target = next(d for d in DSLS if d != source_dsl)
    return f"{source_dsl}2{target}"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Skill:
    """One skill. ``origin`` is ``corpus:<path>`` or ``run:<run>/<model>/<trial>``."""

    origin: str
    model: str
    problem_id: int
    direction: str
    source_verdict: str
    text: str
    replicate: int | None = None
    source_trial: str | None = None
    source_speedup: float | None = None
    outcome: Outcome | None = None
    released_in: str | None = None
    path: Path | None = None

    def __post_init__(self) -> None:
        split_direction(self.direction)

    @property
    def sha256(self) -> str:
        """sha256 of the skill text exactly as stored (UTF-8)."""
        return sha256_text(self.text)

    @property
    def source_dsl(self) -> str:
        return split_direction(self.direction)[0]

    @property
    def target_dsl(self) -> str:
        return split_direction(self.direction)[1]

    @property
    def skill_id(self) -> str:
        """Stable short id derived from the origin."""
        return sha256_text(self.origin)[:16]

    @property
    def verdict(self) -> str:
        return self.outcome.verdict if self.outcome else "unresolved"
