"""Training exports of skills: SFT (skill -> outcome) and DPO (helpful vs harmful skill) JSONL.

SFT: one record per skill whose outcome is resolved; ``prompt`` asks for a skill for the
problem and direction (template ``templates/skill_prompt.md``), ``completion`` is the skill,
``outcome`` what it did. DPO: for each problem and direction, every (helped, harmed) pair of
skills; the prompt is the same for both sides. Skills the leak check flags are left out
unless asked for, and every record is validated against its schema before anything is written.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from mkb_eval.problems import Problem
from mkb_eval.skills.corpus import schema_errors
from mkb_eval.skills.leak import check_text
from mkb_eval.skills.model import DSL_DISPLAY, Skill, SkillError

TEMPLATE = Path(__file__).resolve().parent / "templates" / "skill_prompt.md"
FORMATS = ("sft", "dpo")


@dataclass(frozen=True)
class ExportResult:
    """Records written and skills left out, with the reason for each group."""

    records: tuple[dict[str, Any], ...]
    left_out: dict[str, int]


def prompt_for(skill: Skill, problem: Problem) -> str:
    """The instruction a skill answers (same for every skill of a problem and direction)."""
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        problem=problem.name, docstring=problem.docstring, description=problem.description,
        source_display=DSL_DISPLAY[skill.source_dsl], target_display=DSL_DISPLAY[skill.target_dsl]).strip() + "\n"


def _problem(skill: Skill, problems: dict[int, Problem]) -> Problem:
    p = problems.get(skill.problem_id)
    if p is None:
        raise SkillError(f"{skill.origin}: problem {skill.problem_id} is not in the problem set")
    return p


def _flags(skill: Skill) -> list[str]:
    return [f.tag for f in check_text(skill.text)]


def _outcome(skill: Skill) -> dict[str, Any]:
    o = skill.outcome
    assert o is not None
    return {"verdict": o.verdict, "skill_status": o.skill_status, "skill_speedup": o.skill_speedup,
            "base_status": o.base_status, "base_speedup": o.base_speedup}


def _eligible(skills: Iterable[Skill], include_flagged: bool,
              left_out: dict[str, int]) -> list[tuple[Skill, list[str]]]:
    out = []
    for s in skills:
        flags = _flags(s)
        if s.verdict == "unresolved":
            left_out["outcome unresolved"] = left_out.get("outcome unresolved", 0) + 1
        elif flags and not include_flagged:
            left_out["flagged by the leak check"] = left_out.get("flagged by the leak check", 0) + 1
        else:
            out.append((s, flags))
    return out


def sft_records(skills: Sequence[Skill], problems: dict[int, Problem], include_flagged: bool = False) -> ExportResult:
    """One record per resolved skill, in input order."""
    left_out: dict[str, int] = {}
    records = []
    for s, flags in _eligible(skills, include_flagged, left_out):
        p = _problem(s, problems)
        records.append({
            "id": s.skill_id, "prompt": prompt_for(s, p), "completion": s.text, "outcome": _outcome(s),
            "meta": {"origin": s.origin, "model": s.model, "problem_id": s.problem_id, "problem": p.name,
                     "direction": s.direction, "source_verdict": s.source_verdict, "skill_sha256": s.sha256,
                     "leak_flags": flags, "released_in": s.released_in},
        })
    return ExportResult(tuple(records), left_out)


def dpo_records(skills: Sequence[Skill], problems: dict[int, Problem], include_flagged: bool = False) -> ExportResult:
    """Every (helped, harmed) pair of skills of the same problem and direction, ordered by problem."""
    left_out: dict[str, int] = {}
    groups: dict[tuple[int, str], list[tuple[Skill, list[str]]]] = {}
    for s, flags in _eligible(skills, include_flagged, left_out):
        groups.setdefault((s.problem_id, s.direction), []).append((s, flags))
    records = []
    for (pid, direction), members in sorted(groups.items()):
        chosen = [m for m in members if m[0].verdict == "helped"]
        rejected = [m for m in members if m[0].verdict == "harmed"]
        if not chosen or not rejected:
            n = len(members)
            left_out["no helped/harmed counterpart"] = left_out.get("no helped/harmed counterpart", 0) + n
            continue
        neutral = len(members) - len(chosen) - len(rejected)
        if neutral:
            left_out["neutral (no preference)"] = left_out.get("neutral (no preference)", 0) + neutral
        p = _problem(members[0][0], problems)
        for c, cf in chosen:
            for r, rf in rejected:
                records.append({
                    "id": f"{c.skill_id}__{r.skill_id}", "prompt": prompt_for(c, p), "chosen": c.text,
                    "rejected": r.text,
                    "meta": {"problem_id": pid, "problem": p.name, "direction": direction,
                             "chosen": _side(c, cf), "rejected": _side(r, rf)},
                })
    return ExportResult(tuple(records), left_out)


def _side(s: Skill, flags: list[str]) -> dict[str, Any]:
    return {"origin": s.origin, "model": s.model, "skill_sha256": s.sha256, **_outcome(s), "leak_flags": flags}


def validate(records: Iterable[dict[str, Any]], fmt: str) -> None:
    """Raise SkillError at the first record that violates the format's schema."""
    for i, rec in enumerate(records):
        errors = schema_errors(rec, fmt)
        if errors:
            raise SkillError(f"{fmt} record {i} ({rec.get('id')}): {errors[0]}")


def export(skills: Sequence[Skill], problems: dict[int, Problem], fmt: str, out: Path,
           include_flagged: bool = False) -> ExportResult:
    """Build, validate and write the JSONL export (atomically: a failed export leaves no file)."""
    if fmt not in FORMATS:
        raise SkillError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    result = (sft_records if fmt == "sft" else dpo_records)(skills, problems, include_flagged)
    validate(result.records, fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in result.records:
                f.write(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result
