"""Attempt outcomes: the small, versioned input side of the metrics.

The metrics read one record per attempt, as the run store writes them to ``attempts.jsonl``.
Only the fields the arithmetic needs are kept (``AttemptOutcome``), so the metrics do not depend
on the full record schema of the attempt loop. Reading is forgiving where it can be honest about
it (a torn line is skipped with a warning that names the line; an older record is read with
defaults) and strict where guessing would be wrong (a newer ``schema_version`` is refused).

This reader stays lenient on purpose, unlike the run folder's readers (the store's resume and the
skills' release validate every line as a full :class:`mkb_eval.attempt_record.AttemptRecord`): the
``evaluate`` metric takes predictions that users build by hand and the dataset's ``attempts`` rows,
which carry only this subset, so requiring the full record would refuse valid inputs. What it does
check (arm, status, speedup, the trial coordinate, the version) is all the arithmetic reads.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval.vocab import ARM_DSL as ARM_DSL  # re-exported: the metrics' own readers import them from here
from mkb_eval.vocab import ARMS as ARMS
from mkb_eval.vocab import ATTEMPT_STATUSES as STATUSES
from mkb_eval.vocab import DIRECTIONS as DIRECTIONS
from mkb_eval.vocab import DSLS as DSLS
from mkb_eval.vocab import SKILL_ARMS as SKILL_ARMS
from mkb_eval.vocab import trial_name as trial_name

SCHEMA_VERSION = 1
"""Newest attempt-record version this reader understands."""

# Problem numbering of the original benchmark (contiguous by family); used only to fill in the
# family of records written before ``family`` was a field.
_FAMILY_RANGES = (
    (1, 18, "attention"),
    (19, 26, "kv_cache"),
    (27, 43, "mlp_norm"),
    (44, 51, "moe"),
    (52, 61, "quantization"),
    (62, 74, "linear_attention"),
)
_TRIAL_RE = re.compile(r"^p(\d+)_r(\d+)_([a-z0-9_]+)$")


class InputError(ValueError):
    """A record cannot be read; the message names where it came from and what is wrong."""


class SchemaVersionError(InputError):
    """A record was written by a newer schema than this reader knows; refusing beats guessing."""


def family_of(problem_id: int) -> str:
    """Family of a problem under the original numbering ("unknown" outside 1..74)."""
    for lo, hi, fam in _FAMILY_RANGES:
        if lo <= problem_id <= hi:
            return fam
    return "unknown"




@dataclass(frozen=True)
class AttemptOutcome:
    """What the metrics need from one attempt.

    ``speedup`` is eager_ms / kernel_ms and is kept only for a passed attempt (status "ok"): a
    failed attempt has no speedup, whatever the record says. ``error`` is an infrastructure error
    (the attempt never produced an outcome), which makes every unit using it unresolved.
    """

    problem_id: int
    arm: str
    status: str
    replicate: int = 1
    speedup: float | None = None
    kernel_ms: float | None = None
    eager_ms: float | None = None
    skipped: bool = False
    error: str | None = None
    family: str = "unknown"
    model: str = "unknown"
    skill_sha256: str | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.arm not in ARM_DSL:
            raise InputError(f"unknown arm {self.arm!r}; expected one of {', '.join(ARMS)}")
        if self.status not in STATUSES:
            raise InputError(f"unknown status {self.status!r}; expected one of {', '.join(STATUSES)}")
        if self.status == "ok" and self.speedup is None:
            raise InputError("status 'ok' needs a speedup (or eager_ms and kernel_ms)")
        if self.status != "ok" and self.speedup is not None:
            object.__setattr__(self, "speedup", None)
        if self.status == "skipped" and not self.skipped:
            object.__setattr__(self, "skipped", True)

    @property
    def dsl(self) -> str:
        return ARM_DSL[self.arm]

    @property
    def trial(self) -> str:
        return trial_name(self.problem_id, self.replicate, self.arm)

    @property
    def passed(self) -> bool:
        """Correct and timed: the only status that earns a speedup."""
        return self.status == "ok" and not self.skipped

    def attains(self, t: float) -> bool:
        """passed and speedup >= t (the original's ``attains``)."""
        return self.passed and self.speedup is not None and self.speedup >= t


@dataclass(frozen=True)
class _Torn:
    """A line that is not a JSON record; carries the warning to report."""

    message: str


@dataclass(frozen=True)
class LoadResult:
    """Outcomes read from a run (latest record per trial) and what was set aside, with reasons."""

    outcomes: tuple[AttemptOutcome, ...]
    warnings: tuple[str, ...] = ()
    n_records: int = 0
    n_superseded: int = 0
    n_other_kinds: int = 0
    source: str = "records"
    models: tuple[str, ...] = field(default=())


def _number(d: Mapping[str, Any], key: str, where: str) -> float | None:
    """A positive finite number or None; anything else names the field."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{where}: {key} must be a number or null, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise InputError(f"{where}: {key} must be a positive finite number, got {v!r}")
    return v


def _integer(v: Any, key: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def record_version(d: Mapping[str, Any], where: str) -> int:
    """The record's schema_version (missing = 0, the pre-versioning layout); newer ones raise."""
    v = d.get("schema_version", 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InputError(f"{where}: schema_version must be a non-negative integer, got {v!r}")
    if v > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{where}: attempt record has schema_version {v}, but this version of mkb_eval reads "
            f"only up to {SCHEMA_VERSION}; upgrade mkb_eval to score this run"
        )
    return v


def outcome_from_dict(d: Mapping[str, Any], where: str = "record") -> AttemptOutcome:  # noqa: C901 - one check per field
    """Parse one attempt record (any version up to SCHEMA_VERSION) into an AttemptOutcome.

    Fields missing from an older record take defaults: problem, replicate and arm from ``trial``,
    ``skipped`` from the status, ``speedup`` from eager_ms / kernel_ms, ``family`` from the
    original numbering, ``model`` "unknown". A field that contradicts another raises InputError.
    """
    if not isinstance(d, Mapping):
        raise InputError(f"{where}: an attempt record must be a JSON object, got {type(d).__name__}")
    version = record_version(d, where)
    from_trial: tuple[int, int, str] | None = None
    trial = d.get("trial")
    if trial is not None:
        m = _TRIAL_RE.match(str(trial))
        if not m:
            raise InputError(f"{where}: trial {trial!r} is not of the form p<NN>_r<k>_<arm>")
        from_trial = (int(m.group(1)), int(m.group(2)), m.group(3))

    def pick(key: str, idx: int) -> Any:
        v = d.get(key)
        if v is None and from_trial is not None:
            return from_trial[idx]
        if v is not None and from_trial is not None and v != from_trial[idx]:
            raise InputError(f"{where}: {key} {v!r} contradicts trial {trial!r}")
        return v

    problem_id, arm, status = pick("problem_id", 0), pick("arm", 2), d.get("status")
    missing = [k for k, v in (("problem_id", problem_id), ("arm", arm), ("status", status)) if v is None]
    if missing:
        raise InputError(f"{where}: schema_version {version} record lacks {', '.join(missing)}")
    problem_id = _integer(problem_id, "problem_id", where)
    if arm not in ARM_DSL:
        raise InputError(f"{where}: unknown arm {arm!r}; expected one of {', '.join(ARMS)}")
    replicate = pick("replicate", 1)
    replicate = 1 if replicate is None else _integer(replicate, "replicate", where)
    if replicate < 1:
        raise InputError(f"{where}: replicate must be >= 1, got {replicate}")
    if status not in STATUSES:
        raise InputError(f"{where}: unknown status {status!r}; expected one of {', '.join(STATUSES)}")
    dsl = d.get("dsl")
    if dsl is not None and dsl != ARM_DSL[arm]:
        raise InputError(f"{where}: dsl {dsl!r} contradicts arm {arm!r} (which runs in {ARM_DSL[arm]})")
    flag = d.get("skipped", False)
    if flag is not None and not isinstance(flag, bool):
        raise InputError(f"{where}: skipped must be true or false, got {flag!r}")
    skipped = bool(flag) or status == "skipped"
    if skipped and arm not in SKILL_ARMS:
        raise InputError(f"{where}: only a skill arm can be skipped, not {arm!r}")
    kernel_ms = _number(d, "kernel_ms", where)
    eager_ms = _number(d, "eager_ms", where)
    speedup = _number(d, "speedup", where) if status == "ok" else None  # a failure's speedup means nothing
    if status == "ok" and speedup is None:
        if kernel_ms is None or eager_ms is None:
            raise InputError(f"{where}: status 'ok' needs speedup, or eager_ms and kernel_ms")
        speedup = eager_ms / kernel_ms
    error = d.get("error")
    if error is not None and not isinstance(error, str):
        error = json.dumps(error, sort_keys=True)
    family = d.get("family") or family_of(problem_id)
    return AttemptOutcome(
        problem_id=problem_id,
        arm=arm,
        status=status,
        replicate=replicate,
        speedup=speedup,
        kernel_ms=kernel_ms,
        eager_ms=eager_ms,
        skipped=skipped,
        error=error or None,
        family=str(family),
        model=str(d.get("model") or "unknown"),
        skill_sha256=d.get("skill_sha256"),
        schema_version=version,
    )


def _collect(items: Iterable[tuple[str, Any]], source: str) -> LoadResult:
    latest: dict[tuple[str, str], AttemptOutcome] = {}
    notes: list[str] = []
    n_records = n_superseded = n_other = 0
    for where, item in items:
        if isinstance(item, _Torn):
            notes.append(item.message)
            continue
        if isinstance(item, Mapping):
            record_version(item, where)  # a newer version aborts the whole read
            kind = item.get("kind", "attempt")
            if kind != "attempt":
                n_other += 1
                continue
        try:
            o = outcome_from_dict(item, where)
        except SchemaVersionError:
            raise
        except InputError as e:
            notes.append(f"{e}; record skipped")
            continue
        n_records += 1
        key = (o.model, o.trial)
        if key in latest:
            n_superseded += 1
            del latest[key]  # re-insert so order follows the superseding line
        latest[key] = o
    for msg in notes:
        warnings.warn(msg, stacklevel=3)
    outcomes = tuple(sorted(latest.values(), key=lambda o: (o.model, o.problem_id, o.replicate, o.arm)))
    return LoadResult(
        outcomes=outcomes,
        warnings=tuple(notes),
        n_records=n_records,
        n_superseded=n_superseded,
        n_other_kinds=n_other,
        source=source,
        models=tuple(sorted({o.model for o in outcomes})),
    )


def _jsonl_items(path: Path) -> Iterable[tuple[str, Any]]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                yield where, json.loads(line.strip())
            except json.JSONDecodeError as e:
                yield where, _Torn(f"{where}: malformed JSON ({e.msg}); line skipped")


def read_attempts(source: str | Path | Iterable[Mapping[str, Any]]) -> LoadResult:
    """Read attempt records from a run dir, an ``attempts.jsonl`` file, or a list of dicts.

    Later records of the same (model, trial) supersede earlier ones (the store is append-only);
    torn or invalid records are skipped with a warning naming their line; a record of a newer
    schema version raises SchemaVersionError naming the file, line and version.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            path = path / "attempts.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"no attempts file at {path}")
        return _collect(_jsonl_items(path), str(path))
    return _collect(((f"records[{i}]", d) for i, d in enumerate(source)), "records")
