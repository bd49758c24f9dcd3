"""Training exports of skills: SFT and DPO JSONL in the formats TRL's trainers read.

SFT has two kinds of record (column ``task``):

- ``apply_skill``: a skill with its evidence. The prompt is the skill arm's first message (the
  target-DSL task followed by the skill under ``## Skill from a prior attempt``), the completion
  the shipped solution in the target DSL, in the answer format the attempt loop parses
  (``<kernel.py>`` block). Only a skill whose target-DSL solution has a GPU record in the curated
  verification set that verified that exact file (``ok``) qualifies; the record's numbers are the
  ``evidence_*`` columns. This is how the maintainers' skills export: they have no paired
  measurement, but each led to a verified kernel in the other DSL. A corpus skill's
  ``## What transferred`` section reports on the target attempt, so it is cut from the prompt.
- ``write_skill``: a skill whose paired outcome is resolved; the prompt asks for a skill for the
  problem and direction (``templates/skill_prompt.md``), the completion is the skill.

Two styles: ``sft`` writes TRL's standard prompt-completion columns (``prompt``, ``completion``),
``sft-messages`` the conversational language-modeling column ``messages`` (user, assistant). DPO
(``dpo``): for each problem and direction, every (helped, harmed) pair of skills with the same
prompt, in TRL's standard preference columns (``prompt``, ``chosen``, ``rejected``).

Every column is typed: no record carries a null (an absent string is "", an absent time or a
failed attempt's speedup is 0.0, leak flags are one comma-separated string), so ``datasets``
infers no null-typed column. Records are validated against their schema before anything is
written, and an export that would be empty is an error that says why.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from mkb_eval.problems import Problem
from mkb_eval.skills.corpus import schema_errors
from mkb_eval.skills.leak import check_text
from mkb_eval.skills.model import DSL_DISPLAY, Skill, SkillError

TEMPLATE = Path(__file__).resolve().parent / "templates" / "skill_prompt.md"
FORMATS = ("sft", "sft-messages", "dpo")
SCHEMAS = {"sft": "sft", "sft-messages": "sft_messages", "dpo": "dpo"}
TASKS = ("apply_skill", "write_skill")
_REPORT_SECTION = re.compile(r"^## What transferred\b.*", re.S | re.M)

TaskPrompt = Callable[[Problem, str, str], str]
"""(problem, target DSL, skill body) -> the skill arm's first message (agent.prompts renders it)."""
Evidence = Mapping[tuple[int, str], Mapping[str, Any]]
"""(problem id, DSL) -> the curated GPU record that verified the shipped solution."""


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


def transferred_body(skill: Skill) -> str:
    """The part of a skill that was handed to the target attempt (a corpus report on that attempt cut off)."""
    return _REPORT_SECTION.sub("", skill.text).rstrip() + "\n"


def answer(kernel_source: str) -> str:
    """A kernel as the attempt loop expects it in a model's answer."""
    return f"<kernel.py>\n{kernel_source.rstrip()}\n</kernel.py>\n"


def _problem(skill: Skill, problems: Mapping[int, Problem]) -> Problem:
    p = problems.get(skill.problem_id)
    if p is None:
        raise SkillError(f"{skill.origin}: problem {skill.problem_id} is not in the problem set")
    return p


def _count(left_out: dict[str, int], why: str, n: int = 1) -> None:
    left_out[why] = left_out.get(why, 0) + n


def _num(x: Any) -> float:
    return float(x) if x is not None else 0.0


def _skill_columns(s: Skill, p: Problem, flags: list[str]) -> dict[str, Any]:
    o = s.outcome
    return {
        "verdict": s.verdict, "skill_status": (o.skill_status if o else None) or "",
        "skill_speedup": _num(o.skill_speedup if o else None), "base_status": (o.base_status if o else None) or "",
        "base_speedup": _num(o.base_speedup if o else None),
        "origin": s.origin, "model": s.model, "problem_id": s.problem_id, "problem": p.name, "direction": s.direction,
        "source_dsl": s.source_dsl, "target_dsl": s.target_dsl, "source_verdict": s.source_verdict,
        "skill_sha256": s.sha256, "leak_flags": ",".join(flags), "released_in": s.released_in or "",
    }


def _evidence_columns(rec: Mapping[str, Any] | None, gpu: str) -> dict[str, Any]:
    t = (rec or {}).get("timing") or {}
    return {
        "evidence_gpu": gpu if rec else "", "evidence_status": str((rec or {}).get("status") or ""),
        "evidence_kernel_sha256": str((rec or {}).get("kernel_sha256") or ""),
        "evidence_kernel_ms": _num(t.get("kernel_ms")), "evidence_device_ms": _num(t.get("kernel_device_ms")),
        "evidence_speedup": _num(t.get("speedup")),
    }


def _flagged(s: Skill, include_flagged: bool, left_out: dict[str, int]) -> list[str] | None:
    flags = [f.tag for f in check_text(s.text)]
    if flags and not include_flagged:
        _count(left_out, "flagged by the leak check")
        return None
    return flags


def sft_records(skills: Sequence[Skill], problems: Mapping[int, Problem], include_flagged: bool = False, *,
                evidence: Evidence | None = None, task_prompt: TaskPrompt | None = None, gpu: str = "h200",
                tasks: Sequence[str] = TASKS) -> ExportResult:
    """SFT records in input order: per skill an ``apply_skill`` record where its evidence is verified
    (needs ``evidence`` and ``task_prompt``), and a ``write_skill`` record where its outcome is resolved."""
    left_out: dict[str, int] = {}
    records = []
    for s in skills:
        p = _problem(s, problems)
        flags = _flagged(s, include_flagged, left_out)
        if flags is None:
            continue
        wrote = False
        if "apply_skill" in tasks and evidence is not None and task_prompt is not None:
            rec = evidence.get((s.problem_id, s.target_dsl))
            path = p.solution_path(s.target_dsl)
            if rec is not None and rec.get("status") == "ok" and path.is_file():
                records.append({
                    "id": f"{s.skill_id}-apply", "task": "apply_skill",
                    "prompt": task_prompt(p, s.target_dsl, transferred_body(s)),
                    "completion": answer(path.read_text(encoding="utf-8")),
                    **_skill_columns(s, p, flags), **_evidence_columns(rec, gpu)})
                wrote = True
            elif s.verdict == "unresolved":
                _count(left_out, f"outcome unresolved and no verified {s.target_dsl} solution in the {gpu} set")
                continue
        if "write_skill" in tasks and s.verdict != "unresolved":
            records.append({"id": f"{s.skill_id}-write", "task": "write_skill", "prompt": prompt_for(s, p),
                            "completion": s.text, **_skill_columns(s, p, flags), **_evidence_columns(None, gpu)})
            wrote = True
        if not wrote:
            _count(left_out, "outcome unresolved" if s.verdict == "unresolved" else f"no {'/'.join(tasks)} record")
    return ExportResult(tuple(records), left_out)


def as_messages(records: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The conversational form of SFT records: ``messages`` (user prompt, assistant completion)."""
    out = []
    for r in records:
        rest = {k: v for k, v in r.items() if k not in ("prompt", "completion")}
        out.append({"id": r["id"], "messages": [{"role": "user", "content": r["prompt"]},
                                                {"role": "assistant", "content": r["completion"]}],
                    **{k: v for k, v in rest.items() if k != "id"}})
    return tuple(out)


def dpo_records(skills: Sequence[Skill], problems: Mapping[int, Problem], include_flagged: bool = False) -> ExportResult:
    """Every (helped, harmed) pair of skills of the same problem and direction, ordered by problem."""
    left_out: dict[str, int] = {}
    groups: dict[tuple[int, str], list[tuple[Skill, list[str]]]] = {}
    for s in skills:
        if s.verdict == "unresolved":
            _count(left_out, "outcome unresolved (no paired skill and base attempts)")
            continue
        flags = _flagged(s, include_flagged, left_out)
        if flags is not None:
            groups.setdefault((s.problem_id, s.direction), []).append((s, flags))
    records = []
    for (pid, direction), members in sorted(groups.items()):
        chosen = [m for m in members if m[0].verdict == "helped"]
        rejected = [m for m in members if m[0].verdict == "harmed"]
        if not chosen or not rejected:
            _count(left_out, "no helped/harmed counterpart", len(members))
            continue
        neutral = len(members) - len(chosen) - len(rejected)
        if neutral:
            _count(left_out, "neutral (no preference)", neutral)
        p = _problem(members[0][0], problems)
        for c, cf in chosen:
            for r, rf in rejected:
                records.append({
                    "id": f"{c.skill_id}__{r.skill_id}", "prompt": prompt_for(c, p), "chosen": c.text,
                    "rejected": r.text, "problem_id": pid, "problem": p.name, "direction": direction,
                    **{f"{side}_{k}": v for side, (sk, fl) in (("chosen", (c, cf)), ("rejected", (r, rf)))
                       for k, v in _side(sk, fl).items()},
                })
    return ExportResult(tuple(records), left_out)


def _side(s: Skill, flags: list[str]) -> dict[str, Any]:
    o = s.outcome
    return {"origin": s.origin, "model": s.model, "skill_sha256": s.sha256, "verdict": s.verdict,
            "skill_status": (o.skill_status if o else None) or "", "skill_speedup": _num(o.skill_speedup if o else None),
            "base_status": (o.base_status if o else None) or "", "base_speedup": _num(o.base_speedup if o else None),
            "leak_flags": ",".join(flags)}


def _nulls(value: Any, where: str = "") -> list[str]:
    if value is None:
        return [where or "(top level)"]
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in _nulls(v, f"{where}/{k}" if where else k)]
    if isinstance(value, list):
        if not value:
            return [f"{where} (empty list: no element type)"]
        return [w for i, v in enumerate(value) for w in _nulls(v, f"{where}/{i}")]
    return []


def validate(records: Iterable[dict[str, Any]], fmt: str) -> None:
    """Raise SkillError at the first record that violates the format's schema or carries a null."""
    for i, rec in enumerate(records):
        errors = schema_errors(rec, SCHEMAS.get(fmt, fmt)) or [f"{w}: null (columns must be typed)" for w in _nulls(rec)]
        if errors:
            raise SkillError(f"{fmt} record {i} ({rec.get('id')}): {errors[0]}")


def _empty_reason(fmt: str, n_skills: int, left_out: Mapping[str, int]) -> str:
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(left_out.items())) or "no skills were given"
    hint = ("pass --runs RUN with run folders whose skill and base attempts are paired (helped and harmed skills of "
            "one problem and direction)" if fmt == "dpo" else
            "give run folders with resolved outcomes (--runs), or a curated verification set that verifies the "
            "solutions the skills led to (--verification)")
    return f"the {fmt} export would be empty: of {n_skills} skill(s), {why}; {hint}"


def export(skills: Sequence[Skill], problems: Mapping[int, Problem], fmt: str, out: Path,
           include_flagged: bool = False, *, evidence: Evidence | None = None, task_prompt: TaskPrompt | None = None,
           gpu: str = "h200", tasks: Sequence[str] = TASKS) -> ExportResult:
    """Build, validate and write the JSONL export (atomically: a failed or empty export leaves no file)."""
    if fmt not in FORMATS:
        raise SkillError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise SkillError(f"unknown SFT task(s) {bad}; expected {', '.join(TASKS)}")
    if fmt == "dpo":
        result = dpo_records(skills, problems, include_flagged)
    else:
        result = sft_records(skills, problems, include_flagged, evidence=evidence, task_prompt=task_prompt, gpu=gpu,
                             tasks=tasks)
        if fmt == "sft-messages":
            result = ExportResult(as_messages(result.records), result.left_out)
    if not result.records:
        raise SkillError(_empty_reason(fmt, len(skills), result.left_out))
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
