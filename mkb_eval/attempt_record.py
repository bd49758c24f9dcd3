"""The attempt record, the benchmark's main output, as a typed model with an exported JSON Schema.

The run loop writes one per trial to ``attempts.jsonl`` (and ``trials/<trial>/attempt.json``). It was
a ~35-key dict literal; now the loop builds an :class:`AttemptRecord`, so a missing, misspelt or
mistyped field fails where it is written, not in a user's analysis. ``schemas/attempt.schema.json``
is generated from the model (``python -m mkb_eval.schemas``; a test keeps it current) for
readers outside Python. The metrics read a small subset of it, leniently and across versions
(:mod:`mkb_eval.metrics.inputs`); :func:`parse` is the strict reader of a full record.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mkb_eval.records import SCHEMAS, validation_errors
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


def parse(d: Any, where: str = "record") -> AttemptRecord:
    """A full attempt record from its JSON object; ValueError naming ``where`` and every bad field."""
    try:
        return AttemptRecord.model_validate(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid attempt record (schema_version {SCHEMA_VERSION}): "
                         f"{validation_errors(e)}") from None


def json_schema() -> dict[str, Any]:
    return AttemptRecord.model_json_schema()


def schema_text() -> str:
    return json.dumps(json_schema(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":          # the older command: regenerates every schema (python -m mkb_eval.schemas)
    import runpy

    runpy.run_module("mkb_eval.schemas", run_name="__main__")
