"""The run folder's own records (``run.json``, ``invocations.jsonl``, ``retime.jsonl``) as strict typed models.

They were dict literals, so a misspelt key or a value of the wrong type was found by whoever read the
folder next (a resumed run, the report, the dataset builder). Now the store and the re-timing build a
model (unknown fields refused, types checked without coercion, frozen), every reader goes through
:func:`parse_run_meta`, :func:`read_invocations` or :func:`read_retimes`, whose errors name the file, the
line and the field, and ``mkb_eval/schemas/{run,invocation,retime}.schema.json`` are generated from the
models (``python -m mkb_eval.schemas``) for readers outside Python.

Folders written before a record's current version are read through explicit migrations, applied in
order before validation (:func:`mkb_eval.record_migrations.migrate`); a version without a migration is refused, never guessed.
The attempt records of a run folder have their own module (:mod:`mkb_eval.attempt_record`), and so do the
shared baselines under ``baselines/``, the verifier's cache files (:mod:`mkb_eval.baseline_record`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mkb_eval.record_migrations import Step, migrate
from mkb_eval.records import SCHEMAS, validation_errors
from mkb_eval.vocab import Arm, Dsl, Status, Tier

STORE_VERSION = 1            # run.json
INVOCATION_VERSION = 1       # invocations.jsonl (schema_version)
RETIME_VERSION = 2           # retime.jsonl (retime_version); 2: rounds with the host quiet (harness.quiet)
SHA256 = r"^[0-9a-f]{64}$"
TRIAL = r"^p\d{2,}_r\d+_[a-z0-9_]+$"


class _Strict(BaseModel):
    """No unknown fields, no coercion (a "3" is not an int), immutable once built."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# -- run.json ---------------------------------------------------------------------------------
class RunMeta(_Strict):
    """``run.json``: the model a run folder belongs to (written once, by the first invocation)."""

    store_version: Literal[1] = 1
    model: str = Field(min_length=1)
    backend: dict[str, Any]                  # the backend's identity: its keys differ by backend kind
    created_at: str


# -- invocations.jsonl ------------------------------------------------------------------------
class PlanCounts(_Strict):
    """Trials by what the plan does with them (``mkb_eval.agent.plan.counts``)."""

    run: int = Field(ge=0)
    rerun: int = Field(ge=0)
    stale: int = Field(ge=0)
    reuse: int = Field(ge=0)


class BudgetSettings(_Strict):
    """``mkb_eval.agent.loop.Budget`` as recorded."""

    submissions: int = Field(ge=1)
    max_tokens_per_turn: int = Field(ge=1)
    max_total_tokens: int = Field(ge=1)
    wall_s: float = Field(gt=0)
    max_corrections: int = Field(ge=1)


class SamplingSettings(_Strict):
    """``mkb_eval.agent.generation.Sampling`` as recorded."""

    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    max_tokens: int = Field(ge=1)
    seed: int | None


class Invocation(_Strict):
    """One line of ``invocations.jsonl``: one ``mkb run`` that ran trials in this folder."""

    schema_version: Literal[1] = 1
    kind: Literal["invocation"] = "invocation"
    started_at: str
    model: str = Field(min_length=1)
    backend: dict[str, Any]
    problems: list[int]
    arms: list[Arm]
    replicates: int = Field(ge=1)
    device: Literal["cpu", "cuda"]
    tier: Tier
    budget: BudgetSettings
    sampling: SamplingSettings
    rerun_stale: bool
    plan: PlanCounts
    commit: str | None = Field(pattern=r"^[0-9a-f]{40}$")     # None: no git and no MKB_GIT_COMMIT
    dirty: bool | None


# -- retime.jsonl -----------------------------------------------------------------------------
class RetimeParams(_Strict):
    """How the run re-timed (``mkb_eval.agent.retiming.RetimeSettings``)."""

    rounds: int = Field(ge=2)
    warmup: int = Field(ge=0)
    draws: int = Field(ge=1)


class RetimedKernel(_Strict):
    trial: str = Field(pattern=TRIAL)
    dsl: Dsl
    sha256: str = Field(pattern=SHA256)


class RetimeWindow(_Strict):
    """One timed window (``mkb_eval.harness.retime.RetimeWindow``); times None where it failed."""

    label: Arm
    round: int = Field(ge=0)
    position: int = Field(ge=0)
    kernel_ms: float | None
    attested_ms: float | None
    worker_event_ms: float | None
    device_ms: float | None
    status: Status
    message: str
    span_per_call_ms: float | None           # None in version-1 records (not kept then)
    commit_ms: float | None


class RetimeRecord(_Strict):
    """One line of ``retime.jsonl``: the interleaved re-timing of one (problem, replicate)'s final kernels."""

    kind: Literal["retime"] = "retime"
    retime_version: Literal[2] = 2
    key: str = Field(pattern=SHA256)
    group: str = Field(pattern=r"^p\d{2,}_r\d+$")
    problem_id: int = Field(ge=1)
    replicate: int = Field(ge=1)
    model: str = Field(min_length=1)
    tier: Tier
    settings: RetimeParams
    kernels: dict[Arm, RetimedKernel]
    labels: list[Arm]
    windows: list[RetimeWindow]
    env: dict[str, Any]                      # mkb_eval.env.describe(): keys differ by tier and machine
    stages_s: dict[str, float]
    wall_s: float = Field(ge=0)
    created_at: str


# -- migrations -------------------------------------------------------------------------------


def _invocation_0_to_1(d: dict[str, Any]) -> dict[str, Any]:
    """Lines before the typed record had no ``schema_version``, and no ``commit``/``dirty`` where git
    could not be asked (``env.git_commit`` returned nothing): unknown, so None."""
    return {"commit": None, "dirty": None, **d, "schema_version": 1}


def _retime_1_to_2(d: dict[str, Any]) -> dict[str, Any]:
    """Version 1 windows lack the span per call and the commitment cost (kept since commit ac9b3ef):
    not measured then, so None. Version 1 rounds ran beside the run's other work (before the quiet
    host); their times are kept as they were measured."""
    windows = [{"span_per_call_ms": None, "commit_ms": None, **w} if isinstance(w, dict) else w
               for w in d.get("windows") or []]
    return {**d, "windows": windows, "retime_version": 2}


INVOCATION_MIGRATIONS: dict[int, Step] = {0: _invocation_0_to_1}
RETIME_MIGRATIONS: dict[int, Step] = {1: _retime_1_to_2}
RUN_META_MIGRATIONS: dict[int, Step] = {}


M = TypeVar("M", bound=_Strict)


def _parse(model: type[M], d: Any, key: str, current: int, migrations: Mapping[int, Step], what: str,
           where: str) -> M:
    d = migrate(d, key, current, migrations, what, where)
    try:
        return model.model_validate(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid {what}: {validation_errors(e)}") from None


def parse_run_meta(d: Any, where: str = "run.json") -> RunMeta:
    """``run.json``'s object, migrated and validated; ValueError naming ``where`` and every bad field."""
    return _parse(RunMeta, d, "store_version", STORE_VERSION, RUN_META_MIGRATIONS, "run.json record", where)


def parse_invocation(d: Any, where: str = "invocation") -> Invocation:
    return _parse(Invocation, d, "schema_version", INVOCATION_VERSION, INVOCATION_MIGRATIONS,
                  "invocation record", where)


def parse_retime(d: Any, where: str = "retime") -> RetimeRecord:
    return _parse(RetimeRecord, d, "retime_version", RETIME_VERSION, RETIME_MIGRATIONS, "re-timing record", where)


def read_run_meta(path: Path) -> RunMeta:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg})") from None
    return parse_run_meta(data, str(path))


def _lines(path: Path) -> list[tuple[int, Any]]:
    """(line number, JSON value) of each line; a torn last line (no newline: a write cut by a kill, repaired
    by the next append) is skipped with a warning, any other unreadable line is an error."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            if n == len(lines):
                warnings.warn(f"{path}:{n}: torn last line skipped ({e.msg})", stacklevel=3)
                continue
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return out


def read_invocations(path: Path) -> list[Invocation]:
    """Every line of an ``invocations.jsonl``, in order; ValueError naming the line and field at fault."""
    return [parse_invocation(d, f"{path}:{n}") for n, d in _lines(path)]


def read_retimes(path: Path) -> list[RetimeRecord]:
    """Every line of a ``retime.jsonl``, in order (an absent file: none)."""
    path = Path(path)
    return [parse_retime(d, f"{path}:{n}") for n, d in _lines(path)] if path.is_file() else []


def _text(model: type[_Strict]) -> str:
    return json.dumps(model.model_json_schema(), indent=1, sort_keys=True) + "\n"


def schema_files() -> dict[Path, str]:
    """The exported schemas of the run folder's records: path -> text."""
    return {SCHEMAS / "run.schema.json": _text(RunMeta), SCHEMAS / "invocation.schema.json": _text(Invocation),
            SCHEMAS / "retime.schema.json": _text(RetimeRecord)}
