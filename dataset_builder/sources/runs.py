"""Rows of ``attempts`` and ``skills``: run folders (``--runs``) and the released skills corpus.

Run folders are read strictly: a record the metrics would skip fails the build instead, so the
released attempts are exactly the run's latest records (see ``mkb_eval.skills.runs`` for the
folder layout).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from mkb_eval.problems import Problem
from mkb_eval.skill_record import parse_row
from mkb_eval.skills.leak import check_text
from mkb_eval.skills.model import Skill, SkillError
from mkb_eval.skills.runs import Run, read_run, run_skills


def read_runs(paths: Sequence[Path]) -> list[Run]:
    """Read every run folder strictly; run names (folder names) must be unique."""
    runs = []
    for path in paths:
        try:
            runs.append(read_run(path, strict=True))
        except (SkillError, ValueError) as e:
            raise BuildError(str(e)) from None
    names = [r.name for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BuildError(f"two run folders are both named '{dupes[0]}'; run names must be unique")
    return sorted(runs, key=lambda r: r.name)


def _text(path: Path | None) -> str | None:
    return path.read_bytes().decode("utf-8") if path is not None else None


def attempt_rows(runs: Sequence[Run], problems: Sequence[Problem]) -> list[dict[str, Any]]:
    """One row per run and latest (model, trial) record, ordered by run, model, problem, replicate, arm."""
    names = {p.id: p.name for p in problems}
    rows = []
    for run in runs:
        for a in run.attempts:
            o = a.outcome
            kernel = _text(a.kernel)
            rows.append({
                "run": run.name, "model": o.model, "trial": o.trial, "problem_id": o.problem_id,
                "problem": names.get(o.problem_id), "family": o.family, "replicate": o.replicate, "arm": o.arm,
                "dsl": o.dsl, "direction": o.arm.removesuffix("_skill") if o.arm.endswith("_skill") else None,
                "status": o.status, "passed": o.passed, "skipped": o.skipped, "speedup": o.speedup,
                "kernel_ms": o.kernel_ms, "eager_ms": o.eager_ms, "error": o.error,
                "skill_sha256": o.skill_sha256, "schema_version": o.schema_version,
                "kernel_source": kernel,
                "kernel_sha256": hashlib.sha256(kernel.encode()).hexdigest() if kernel is not None else None,
                "skill_md": _text(a.skill), "record_json": json.dumps(a.raw, sort_keys=True),
            })
    return rows


def skill_rows(corpus_skills: Sequence[Skill], runs: Sequence[Run],
               problems: Sequence[Problem]) -> list[dict[str, Any]]:
    """Corpus skills (by path) then run skills (by run, model, problem, replicate)."""
    names = {p.id: p.name for p in problems}
    skills = list(corpus_skills)
    for run in runs:
        try:
            skills.extend(run_skills(run))
        except SkillError as e:
            raise BuildError(str(e)) from None
    ids = [s.skill_id for s in skills]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise BuildError(f"two skills share the id {dupes[0]}")
    rows = []
    for s in skills:
        o = s.outcome
        rows.append(_row(s, {
            "skill_id": s.skill_id, "origin": s.origin, "model": s.model, "problem_id": s.problem_id,
            "problem": names.get(s.problem_id), "direction": s.direction, "source_dsl": s.source_dsl,
            "target_dsl": s.target_dsl, "replicate": s.replicate, "source_trial": s.source_trial,
            "source_verdict": s.source_verdict, "source_speedup": s.source_speedup, "text": s.text,
            "sha256": s.sha256, "verdict": s.verdict,
            "skill_trial": o.skill_trial if o else None, "skill_status": o.skill_status if o else None,
            "skill_speedup": o.skill_speedup if o else None, "base_status": o.base_status if o else None,
            "base_speedup": o.base_speedup if o else None,
            "leak_flags": [f.tag for f in check_text(s.text)], "released_in": s.released_in,
        }))
    return rows


def _row(skill: Skill, row: dict[str, Any]) -> dict[str, Any]:
    """The row as a :class:`mkb_eval.skill_record.SkillRow` (a missing, unknown or mistyped column fails the
    build here, naming the skill)."""
    try:
        return parse_row(row, f"skill {skill.origin}").to_json()
    except ValueError as e:
        raise BuildError(str(e)) from None
