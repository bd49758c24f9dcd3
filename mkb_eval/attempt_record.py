"""The attempt record, the benchmark's main output, as a typed model with an exported JSON Schema.

The run loop writes one per trial to ``attempts.jsonl`` (and ``trials/<trial>/attempt.json``). It was
a ~35-key dict literal; now the loop builds an :class:`AttemptRecord`, so a missing, misspelt or
mistyped field fails where it is written, not in a user's analysis. ``schemas/attempt.schema.json``
is generated from the model (``python -m mkb_eval.schemas``; a test keeps it current) for
readers outside Python. :func:`parse` is the strict reader of a full record and :func:`read_attempts`
the reader of a run folder's ``attempts.jsonl`` (the store's resume, the skills' release, a replay).
The metrics read a small subset, leniently (:mod:`mkb_eval.metrics.inputs`): they also take predictions
and dataset rows that never were full records.

Older shapes are migrated before validation (:data:`MIGRATIONS`, applied by
``mkb_eval.record_migrations.migrate``). There are none yet: every record the run loop wrote, from its first
commit (442651f, a dict literal) through the typed model, is version 1 with these fields, and the
committed ones validate as they are (a test reads every ``attempts.jsonl`` under ``results/``). A line
without ``schema_version`` was never written by the toolkit and is refused, not guessed at.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mkb_eval.records import SCHEMAS, validation_errors
from mkb_eval.record_migrations import Step, migrate
from mkb_eval.vocab import Arm, AttemptStatus, Direction, Dsl, Family, Tier

SCHEMA_VERSION = 1
SCHEMA_PATH = SCHEMAS / "attempt.schema.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SubmissionSummary(_Strict):
    """One graded submission of a trial, as the record keeps it."""

    k: int = Field(ge=1)
    kernel_sha256: str
    status: str
    message: str = Field(max_length=500)
    speedup: float | None
    kernel_ms: float | None
    eager_ms: float | None
    eval_s: float | None


class Usage(_Strict):
    turns: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    submissions: int = Field(ge=0)
    corrections: int = Field(ge=0)
    wall_s: float = Field(ge=0)


class PromptFile(_Strict):
    version: int
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class AttemptRecord(_Strict):
    """One trial's outcome: the metrics' fields first, then what reproduces and explains it."""

    schema_version: Literal[1] = 1              # SCHEMA_VERSION
    kind: Literal["attempt"] = "attempt"
    trial: str = Field(pattern=r"^p\d{2,}_r\d+_[a-z0-9_]+$")
    problem_id: int = Field(ge=1)
    problem: str
    family: Family
    arm: Arm
    dsl: Dsl
    replicate: int = Field(ge=1)
    status: AttemptStatus
    speedup: float | None
    kernel_ms: float | None
    eager_ms: float | None
    skipped: bool
    error: str | None
    skill_sha256: str | None
    model: str
    message: str = Field(max_length=2000)
    tier: Tier
    created_at: str
    direction: Direction | None
    source_trial: str | None
    problem_hash: str
    prompt_set_sha256: str
    protocol_sha256: str
    prompt_version: str
    prompts: dict[str, PromptFile]
    task_prompt_sha256: str | None
    first_message_sha256: str | None
    backend: dict[str, Any]                 # the backend's identity: its keys differ by backend kind
    sampling: dict[str, Any]
    budget: dict[str, Any]
    stop_reason: str
    usage: Usage | None
    final: SubmissionSummary | None
    best: SubmissionSummary | None
    submissions: list[SubmissionSummary]
    skill_md_sha256: str | None
    skill_md_written: bool
    final_kernel_sha256: str | None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


MIGRATIONS: dict[int, Step] = {}        # from_version -> step; none: see the module docstring


def parse(d: Any, where: str = "record") -> AttemptRecord:
    """A full attempt record from its JSON object, migrated first; ValueError naming ``where`` and every bad field."""
    d = migrate(d, "schema_version", SCHEMA_VERSION, MIGRATIONS, "attempt record", where)
    try:
        return AttemptRecord.model_validate(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid attempt record (schema_version {SCHEMA_VERSION}): "
                         f"{validation_errors(e)}") from None


class Line(NamedTuple):
    """One line of an ``attempts.jsonl``: its record, or why it has none (``error``, naming file:line and field)."""

    where: str                      # "<file>:<line>"
    raw: Any                        # the line's JSON value (None when it is not JSON)
    record: AttemptRecord | None
    error: str | None

    @property
    def trial(self) -> str | None:
        """The trial the line is about, when it says (a malformed line may still name one)."""
        if self.record is not None:
            return self.record.trial
        t = self.raw.get("trial") if isinstance(self.raw, dict) else None
        return t if isinstance(t, str) else None


def read_attempts(path: Path) -> list[Line]:
    """Every non-blank line of an ``attempts.jsonl`` in order, each parsed or with the reason it is not a
    record (malformed JSON, a version no migration reads, a bad field); the caller decides whether a bad
    line is an error or a warning, never to use it."""
    out = []
    for n, text in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not text.strip():
            continue
        where = f"{path}:{n}"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            out.append(Line(where, None, None, f"{where}: malformed JSON ({e.msg})"))
            continue
        try:
            out.append(Line(where, raw, parse(raw, where), None))
        except ValueError as e:
            out.append(Line(where, raw, None, str(e)))
    return out


def json_schema() -> dict[str, Any]:
    return AttemptRecord.model_json_schema()


def schema_text() -> str:
    return json.dumps(json_schema(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":          # the older command: regenerates every schema (python -m mkb_eval.schemas)
    import runpy

    runpy.run_module("mkb_eval.schemas", run_name="__main__")
