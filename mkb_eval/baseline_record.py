"""A baseline cache entry (``<cache>/{eager,compile}_baselines.jsonl``) as a strict typed model.

The verifier's cache of reference times (:func:`mkb_eval.harness.judge.baseline_cached`), a run's shared
baselines (``<run>/baselines/``, :mod:`mkb_eval.agent.baselines`) and the committed H200 report's
``results/h200/2026-11-30_compile_baselines.jsonl`` hold one entry a line: the cache key (problem hash,
size, GPU model, torch), and either the time in ms or the error that stands for it. They were dict
literals read with ``.get``: a line with a misspelt key or a time of the wrong type was silently a cache
miss, or worse a time. Now the writer builds a :class:`BaselineEntry` and every reader goes through
:func:`read_baselines`, which validates each line and skips a bad one with a warning naming the file,
the line and the field: a cache never stops a sweep, and a malformed entry is never used (its key is
timed again). ``mkb_eval/schemas/baseline.schema.json`` is generated from the model.

Entries written before this module have no ``schema_version`` and no ``kind`` (version 0): the one
migration adds both and changes nothing else; the shape ``{key, ms, error}`` is the only one the
toolkit ever wrote (``git log -S'json.dumps({"key"'``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mkb_eval.records import SCHEMAS, validation_errors
from mkb_eval.record_migrations import Step, migrate

BASELINE_VERSION = 1
SCHEMA_PATH = SCHEMAS / "baseline.schema.json"
KEY = r"^[^|]+\|[^|]+\|[^|]*\|[^|]*$"          # problem hash | size | GPU model | torch (judge.baseline_key)


class BaselineEntry(BaseModel):
    """One cached reference time: ``ms`` when it was timed, else ``error`` (why it could not be)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_version: Literal[1] = 1
    kind: Literal["baseline"] = "baseline"
    key: str = Field(pattern=KEY)
    ms: float | None = Field(gt=0, allow_inf_nan=False)
    error: str | None = Field(min_length=1)

    @model_validator(mode="after")
    def _time_or_error(self) -> BaselineEntry:
        if (self.ms is None) == (self.error is None):
            raise ValueError("an entry holds a time (ms) or an error, exactly one of them")
        return self

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _v0_to_v1(d: dict[str, Any]) -> dict[str, Any]:
    """Lines before the typed record: ``{key, ms, error}`` only; the version and kind added."""
    return {**d, "schema_version": 1, "kind": "baseline"}


MIGRATIONS: dict[int, Step] = {0: _v0_to_v1}


def parse_baseline(d: Any, where: str = "baseline") -> BaselineEntry:
    """An entry from its JSON object, migrated and validated; ValueError naming ``where`` and the bad fields."""
    d = migrate(d, "schema_version", BASELINE_VERSION, MIGRATIONS, "baseline entry", where)
    try:
        return BaselineEntry.model_validate(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid baseline entry: {validation_errors(e)}") from None


def read_baselines(path: Path) -> dict[str, BaselineEntry]:
    """A cache file's entries by key, the first valid one of a key winning (an absent file: none). A line
    that is not a valid entry is skipped with a warning naming ``path:line`` and the field: the key it
    would have answered is a miss, timed again, never an unchecked number."""
    path = Path(path)
    out: dict[str, BaselineEntry] = {}
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = parse_baseline(json.loads(line), f"{path}:{n}")
        except json.JSONDecodeError as e:
            warnings.warn(f"{path}:{n}: malformed JSON ({e.msg}); baseline entry skipped", stacklevel=2)
            continue
        except ValueError as e:
            warnings.warn(f"{e}; baseline entry skipped", stacklevel=2)
            continue
        out.setdefault(entry.key, entry)
    return out


def json_schema() -> dict[str, Any]:
    """The model's schema, with the rule its validator adds: a time and no error, or an error and no time."""
    schema = BaselineEntry.model_json_schema()
    schema["oneOf"] = [{"properties": {"ms": {"type": "number"}, "error": {"type": "null"}}},
                       {"properties": {"ms": {"type": "null"}, "error": {"type": "string"}}}]
    return schema


def schema_text() -> str:
    return json.dumps(json_schema(), indent=1, sort_keys=True) + "\n"
