"""Versioned result records and an append-only JSONL store.

Records are plain JSON objects with ``schema_version`` and ``kind``. The store only appends:
each record is one line written with a single ``write`` and fsynced, so a crash leaves at most a
torn last line, which ``read_jsonl`` reports and skips (never a silent drop of good lines).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval.vocab import STATUSES as STATUSES  # re-exported: the closed set of a verification record

SCHEMA_VERSION = 1



@dataclass
class Timing:
    """Milliseconds unless named otherwise; speedups are eager / kernel."""

    kernel_ms: float | None = None          # recorded: max(worker_event_ms, attested_ms), never faster than the parent saw
    worker_event_ms: float | None = None    # the worker's median end-to-end, device-wide sync inside the events
    attested_ms: float | None = None        # per call in the parent-clocked window (last window, if re-timed)
    attested_windows_ms: list[float] = field(default_factory=list)   # every attested window, in order
    window_calls: int = 0                   # calls per attested window
    prewindow_excess_ms: list[float] = field(default_factory=list)   # per window: time before it beyond the allowance
    window_span_ms: list[float] = field(default_factory=list)        # per window: ready to done, the parent's clock
    window_commit_ms: list[float] = field(default_factory=list)      # per window: trusted commitment cost per call
    kernel_device_ms: float | None = None   # GPU time on the call's stream, host path excluded
    host_call_ms: float | None = None       # median time until solve returned in the timed draws (host path)
    cpu_probe_ms: float | None = None       # fixed interpreter work on the timing core, before/after timing (slower one)
    kernel_cv: float | None = None
    eager_ms: float | None = None           # max(eager_event_ms, eager_attested_ms): the kernel's rule
    eager_event_ms: float | None = None
    eager_attested_ms: float | None = None
    compile_ms: float | None = None         # torch.compile baseline
    compile_cached: bool = False
    speedup: float | None = None            # eager_ms / kernel_ms
    speedup_vs_compile: float | None = None
    sol_ms: float | None = None
    sol_fraction: float | None = None       # sol_ms / kernel_ms
    n_warmup: int = 0
    n_timed: int = 0
    times_ms: list[float] = field(default_factory=list)


@dataclass
class VerificationRecord:
    """The outcome of verifying one kernel against one problem on one machine."""

    status: str
    problem_id: int
    problem: str
    problem_hash: str
    dsl: str
    kernel_sha256: str
    tier: str                                # "gpu" | "cpu"
    size: str
    message: str = ""
    stage: str = ""
    flags: list[str] = field(default_factory=list)
    policy_details: list[str] = field(default_factory=list)
    correctness: dict[str, Any] = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)
    stages_s: dict[str, float] = field(default_factory=dict)
    kernels: list[str] = field(default_factory=list)   # CUPTI kernel names: records before commit 01b0f6e only
    artifacts: dict[str, Any] = field(default_factory=dict)
    sandbox: dict[str, str] = field(default_factory=dict)   # what confinement this evaluation had
    env: dict[str, Any] = field(default_factory=dict)
    stdout_tail: str = ""
    stderr_tail: str = ""
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION
    kind: str = "verification"

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "record") -> VerificationRecord:
        """A record from its JSON object, validated field by field (:func:`parse_verification`)."""
        return parse_verification(d, where)


_ADAPTER: list[Any] = []


def _adapter() -> Any:
    """The pydantic validator of VerificationRecord (built on first use: pydantic is not imported by every
    command): strict about unknown fields, in the record and in its timing."""
    if not _ADAPTER:
        from pydantic import ConfigDict, TypeAdapter

        for c in (VerificationRecord, Timing):
            setattr(c, "__pydantic_config__", ConfigDict(extra="forbid"))  # noqa: B010 - pydantic reads this attribute
        _ADAPTER.append(TypeAdapter(VerificationRecord))
    return _ADAPTER[0]


def parse_verification(d: Any, where: str = "record") -> VerificationRecord:
    """A verification record from its JSON object; ValueError naming ``where`` and every bad field (a
    newer or older ``schema_version``, an unknown status or field, a value of the wrong type)."""
    from pydantic import ValidationError

    if not isinstance(d, dict):
        raise ValueError(f"{where}: a verification record must be a JSON object, got {type(d).__name__}")
    if d.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{where}: verification record has schema_version {d.get('schema_version')!r}; "
                         f"this toolkit reads {SCHEMA_VERSION}")
    if d.get("status") not in STATUSES:
        raise ValueError(f"{where}: unknown status {d.get('status')!r} (one of {', '.join(STATUSES)})")
    try:
        rec: VerificationRecord = _adapter().validate_python(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid verification record: {validation_errors(e)}") from None
    return rec


def validation_errors(e: Any) -> str:
    """A pydantic ValidationError as one line: each bad field's path and what is wrong with it."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(record)'}: {err['msg']}" for err in e.errors())


SCHEMAS = Path(__file__).with_name("schemas")
VERIFICATION_SCHEMA_PATH = SCHEMAS / "verification.schema.json"


def verification_schema() -> dict[str, Any]:
    """The JSON Schema of a verification record (``mkb_eval/schemas/verification.schema.json``)."""
    schema: dict[str, Any] = _adapter().json_schema()
    return schema


def verification_schema_text() -> str:
    return json.dumps(verification_schema(), indent=1, sort_keys=True) + "\n"


class StoreError(OSError):
    """A record could not be stored; the file is left as it was before the attempt."""


def repair_jsonl(path: str | Path) -> str | None:
    """Cut a torn last line (power cut, SIGKILL, disk full) off a JSONL file, keeping its bytes.

    The torn bytes go to ``<file>.torn`` so nothing is silently dropped; returns a message saying
    what was done, or None when the file was whole.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None
    with open(path, "rb") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return None
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    cut = tail.rfind(b"\n")
    keep = size - len(tail) + cut + 1 if cut >= 0 else (size - len(tail) if size > len(tail) else 0)
    with open(path, "rb") as f:
        f.seek(keep)
        torn = f.read()
    with open(str(path) + ".torn", "ab") as t:
        t.write(torn + b"\n")
        t.flush()
        os.fsync(t.fileno())
    os.truncate(path, keep)
    msg = (f"{path}: repaired a torn last record ({len(torn)} bytes, incomplete write); "
           f"its bytes are kept in {path.name}.torn")
    warnings.warn(msg, stacklevel=2)
    return msg


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as one line, durably: one write, fsync; all or nothing.

    A torn last line left by an earlier crash is repaired first (else the new record would be
    glued to it). If the write fails part-way (disk full), the file is cut back to its previous
    length and StoreError says so.
    """
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    repair_jsonl(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(28, f"short write ({written} of {len(line)} bytes)")
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            raise StoreError(e.errno, f"could not append a record to {path}: {e.strerror or e}; "
                                      "the file is unchanged") from None
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records in order; a malformed line is reported with its number and skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                warnings.warn(f"{path}:{n}: unreadable record skipped ({e.msg})", stacklevel=2)
                continue
            if not isinstance(rec, dict):
                warnings.warn(f"{path}:{n}: record is not an object, skipped", stacklevel=2)
                continue
            yield rec
