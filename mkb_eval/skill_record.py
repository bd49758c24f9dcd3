"""Skill records as strict typed models: a released skill's front matter, its outcome, the dataset's skill row.

The front matter of a released ``SKILL.md`` was a dict checked against a hand-written JSON Schema and
the dataset's ``skills`` rows were dict literals typed only by the parquet writer. Now the release
builds a :class:`SkillFrontMatter`, the dataset builder a :class:`SkillRow` (unknown fields refused,
no coercion, frozen), and every reader of a skill file goes through :func:`parse_front_matter`, whose
error names the file and each bad field. The schemas ``mkb_eval/schemas/skill.schema.json`` (copied to
``skills_corpus/schema/skill.schema.json`` for the corpus's readers) and ``skill_row.schema.json`` are
generated from the models (``python -m mkb_eval.schemas``), and the dataset's ``skills`` features are
derived from the row's schema.

The front matter has no version field: every file released so far has the one form this model
describes (the corpus schema has not changed since the corpus began, and the committed corpus is
checked against the model by the tests). The first change that old files do not meet adds a
``schema_version`` key and a migration (``mkb_eval.record_migrations.migrate`` shows the form) here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mkb_eval.records import SCHEMAS, validation_errors
from mkb_eval.vocab import AttemptStatus, Direction, Dsl, Status

Verdict = Literal["helped", "harmed", "neutral", "unresolved"]
SHA256 = r"^[0-9a-f]{64}$"
FRONT_MATTER_SCHEMA = SCHEMAS / "skill.schema.json"
ROW_SCHEMA = SCHEMAS / "skill_row.schema.json"


def _no_nulls(schema: dict[str, Any]) -> None:
    """The schema of an optional key as the files have it: absent or a value, never null."""
    for prop in schema.get("properties", {}).values():
        alts = prop.get("anyOf")
        if alts and {"type": "null"} in alts:
            rest = [a for a in alts if a != {"type": "null"}]
            prop.pop("anyOf")
            prop.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
        if prop.get("default", 0) is None:
            prop.pop("default")


class _Optional(BaseModel):
    """Optional keys are left out of a file, not written as null (:func:`parse_front_matter` refuses a null;
    built in Python, None means "leave it out")."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra=_no_nulls)

    def to_json(self) -> dict[str, Any]:
        """The keys that are set, in field order (what the file holds)."""
        return self.model_dump(mode="json", exclude_none=True)


class SkillOutcome(_Optional):
    """The skill-conditioned attempt against the base attempt (``metrics.paired.paired_outcome``)."""

    verdict: Verdict
    skill_trial: str | None = Field(None, pattern=r"^p[0-9]+_r[0-9]+_(cutedsl2tirx|tirx2cutedsl)_skill$")
    skill_status: AttemptStatus | None = None
    skill_speedup: float | None = Field(None, gt=0)
    base_status: AttemptStatus | None = None
    base_speedup: float | None = Field(None, gt=0)


class SkillFrontMatter(_Optional):
    """YAML front matter of a released SKILL.md in skills_corpus/. The text after the front matter is the
    skill exactly as the source attempt wrote it; sha256 is over that text (UTF-8)."""

    model_config = ConfigDict(title="MetaKernelBench released skill: front matter")

    model: str = Field(min_length=1, description="model id that wrote the skill")
    problem: int = Field(ge=1, le=99, description="problem number")
    direction: Direction
    source_verdict: Status = Field(description="final status of the source (solo) attempt")
    sha256: str = Field(pattern=SHA256)
    dataset_version: str = Field(pattern=r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
    replicate: int | None = Field(None, ge=1)
    source_trial: str | None = Field(None, pattern=r"^p[0-9]+_r[0-9]+_solo_(cutedsl|tirx)$")
    source_speedup: float | None = Field(None, gt=0)
    provenance: str | None = Field(None, description="where the skill came from, e.g. run:<run>/<model>/<trial>")
    outcome: SkillOutcome | None = None
    date: str | None = Field(None, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
                             description="when the skill was written (maintainers' skills)")
    verification: str | None = Field(None, min_length=1, description="the source solution's verification "
                                     "result: GPU, versions, status and times (maintainers' skills)")


def parse_front_matter(meta: Any, where: str = "front matter") -> SkillFrontMatter:
    """A released skill's front matter from its YAML mapping; ValueError naming ``where`` and every bad field.

    YAML reads an unquoted ``2026-11-29`` as a date: it is taken as the ISO string it was written as."""
    if isinstance(meta, dict) and hasattr(meta.get("date"), "isoformat"):
        meta = {**meta, "date": meta["date"].isoformat()}
    nulls = [f"{k}: null (leave an unknown key out)" for k in _null_keys(meta)]
    try:
        fm = SkillFrontMatter.model_validate(meta)
    except ValidationError as e:
        raise ValueError(f"{where}: front matter: {'; '.join(nulls + [validation_errors(e)])}") from None
    if nulls:
        raise ValueError(f"{where}: front matter: {'; '.join(nulls)}")
    return fm


def _null_keys(d: Any, prefix: str = "") -> list[str]:
    if not isinstance(d, dict):
        return []
    return [k for key, v in d.items() for k in ([prefix + str(key)] if v is None else _null_keys(v, f"{prefix}{key}."))]


class SkillRow(BaseModel):
    """One row of the dataset's ``skills`` config (without ``dataset_version``, which the build adds to
    every config): a corpus or run skill, its provenance and its outcome, flattened."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    skill_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    origin: str
    model: str
    problem_id: int = Field(ge=1)
    problem: str | None
    direction: Direction
    source_dsl: Dsl
    target_dsl: Dsl
    replicate: int | None
    source_trial: str | None
    source_verdict: Status
    source_speedup: float | None
    text: str
    sha256: str = Field(pattern=SHA256)
    verdict: Verdict
    skill_trial: str | None
    skill_status: AttemptStatus | None
    skill_speedup: float | None
    base_status: AttemptStatus | None
    base_speedup: float | None
    leak_flags: list[str]
    released_in: str | None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_row(d: Any, where: str = "skills row") -> SkillRow:
    try:
        return SkillRow.model_validate(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid skills row: {validation_errors(e)}") from None


def front_matter_schema() -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "skill.schema.json",
            **SkillFrontMatter.model_json_schema()}


def row_schema() -> dict[str, Any]:
    return SkillRow.model_json_schema()


def _text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def schema_files() -> dict[Path, str]:
    """The exported schemas of the skill records: path -> text."""
    return {FRONT_MATTER_SCHEMA: _text(front_matter_schema()), ROW_SCHEMA: _text(row_schema())}
