"""Versioned result records and an append-only JSONL store.

Records are plain JSON objects with ``schema_version`` and ``kind``. The store only appends:
each record is one line written with a single ``write`` and fsynced, so a crash leaves at most a
torn last line, which ``read_jsonl`` reports and skips (never a silent drop of good lines).

A verification record's parts are typed: :class:`Timing`, :class:`Correctness`, :class:`Artifacts`,
:class:`SandboxFacts` and :class:`Env` are dataclasses with known fields; ``stages_s`` is an open map of
seconds by stage (:data:`STAGES` and the prefixes of :func:`stage_key_rule`). Records of an older
``schema_version`` are brought to the current shape by :mod:`mkb_eval.record_migrations` before the
strict parse.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mkb_eval.vocab import STATUSES as STATUSES  # re-exported: the closed set of a verification record

SCHEMA_VERSION = 2        # 2: ``kernels`` gone (see mkb_eval.record_migrations), ``labels`` added


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


class _Part:
    """A record's part whose fields are each filled only by the step that measured them: None means not
    measured here and is not written, so the JSON keeps the keys the steps set (absent and null read the same)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]  # every subclass is a dataclass
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = [x.to_dict() if isinstance(x, _Part) else x for x in v] if isinstance(v, list) else v
        return out


@dataclass
class Correctness(_Part):
    """The judge's findings: the GPU tier's correctness draws and DSL-dependence draw, the CPU tier's smoke run."""

    draws_passed: int | None = None             # draws matched before the first mismatch (all of them when passed)
    max_error: float | None = None              # the mismatching draw's largest error and its allowance, when numeric
    allowance: float | None = None
    launches: list[int] | None = None           # the candidate's DSL launches in each correctness draw
    distinct_input_addresses: int | None = None  # distinct input address sets over the draws (buffers refilled on reuse)
    dsl_dependence: str | None = None           # how the output failed with DSL launches suppressed
    reference_smoke: str | None = None          # CPU tier: "ok" once the reference ran at smoke size


@dataclass
class NvccCubin(_Part):
    """One generated CUDA source compiled to a cubin by nvcc (CPU tier, TIRx)."""

    cubin_bytes: int | None = None
    skipped: str | None = None                  # why it was not compiled ("nvcc not found")


@dataclass
class Artifacts(_Part):
    """What the CPU tier's compile-only run produced (each DSL's ``compiled_artifacts``); empty on the GPU tier."""

    error: str | None = None                    # why no usable artifact came out (status compile_error)
    cubins: int | None = None                   # CuTe DSL: sm_90a cubins (and PTX files) in the dump folder
    cubin_bytes: int | None = None
    ptx: int | None = None
    cuda_sources: int | None = None             # TIRx: CUDA device modules of tvm.compile's results
    cuda_source_bytes: int | None = None
    nvcc: list[NvccCubin] | None = None         # one per CUDA source, until one failed (then ``error``)
    after_launch_error: str | None = None       # what solve raised after its launches were intercepted (last 1000 chars)
    cupti_kernels: list[str] | None = None      # records of schema 1 before commit 01b0f6e: CUPTI names of the kernels
    #                                             the timed calls launched (their ``kernels``; see record_migrations)


@dataclass
class SandboxFacts(_Part):
    """What confinement the evaluation's worker had (``Worker.facts``); empty when no worker started."""

    cgroup: str | None = None                   # "v2", "v1 memory+pids", or "unavailable (parent watchdog only)"
    confinement: str | None = None              # the Landlock plan, or why it was off (since 2026-12-01)
    uid: str | None = None                      # the worker's uid (and why it kept the parent's)
    network: str | None = None                  # the worker's own report at setup ("isolated", ...)
    outside_write: str | None = None            # its probe of a write outside its folder ("denied", "allowed", ...)
    worker: str | None = None                   # "cold", or how it was warm (preloaded, forked)
    leftover_processes: str | None = None       # its session's processes alive after the kill (a count)


@dataclass
class Env(_Part):
    """The machine and versions a result was measured with (``mkb_eval.env.describe``); GPU fields on the GPU tier."""

    python: str | None = None
    torch: str | None = None
    cutlass_dsl: str | None = None              # None: not installed
    tvm: str | None = None
    tvm_ffi: str | None = None
    mkb_eval: str | None = None
    commit: str | None = None                   # the source commit and whether the tree was dirty
    dirty: bool | None = None
    gpu: str | None = None                      # the device's name, e.g. "NVIDIA H200"
    sm: str | None = None
    gpu_count: int | None = None
    cuda_runtime: str | None = None
    driver: str | None = None
    gpu_index: int | str | None = None          # the host's number (or id) of the GPU used


# Seconds by stage, an open map: the parent's steps by fixed name (STAGES), the worker's progress stages as
# ``w_<stage>`` (named by the worker), the judge's parts as ``judge_correctness_<part>`` and
# ``judge_rechecks_<part>`` (inputs, reference, read_output, compare, digest, ...).
StageSeconds = dict[str, float]
STAGES = {
    "total": "the whole verification, policy check to record", "worker_start": "worker start to ready",
    "worker_phase1": "gate 1 to the phase-1 report", "compile_lane_wait": "phase 1's waits for the GPU lane",
    "import_s": "the kernel's import, in the worker", "first_call_s": "the first correctness draw's call",
    "correctness_draws_s": "the correctness draws, in the worker", "judge_correctness": "judging the draws",
    "lane_step_aside": "the lane given to a timed phase between draws", "timing_lane_wait": "waiting for the lane",
    "worker_timing": "the worker's event-timed draws", "attested_window": "the first attested window",
    "retime": "the re-timed window", "eager_baseline": "the eager baseline and its window",
    "compile_baseline": "the torch.compile baseline", "recheck_lane_wait": "waiting for the lane to re-check",
    "judge_rechecks": "judging the window outputs", "worker_cpu_before_job_s": "worker CPU seconds before its job",
    "worker_cpu_s": "worker CPU seconds in all", "reference_smoke": "CPU tier: the reference at smoke size",
    "compile_s": "CPU tier: the compile-only run",
}
STAGE_PREFIXES = ("w_", "judge_correctness_", "judge_rechecks_")


def stage_key_rule(key: str) -> str | None:
    """Which of the rules above a ``stages_s`` key follows (a fixed name or its prefix); None: none of them."""
    return key if key in STAGES else next((p for p in STAGE_PREFIXES if key.startswith(p) and key != p), None)


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
    correctness: Correctness = field(default_factory=Correctness)
    timing: Timing = field(default_factory=Timing)
    stages_s: StageSeconds = field(default_factory=dict)
    artifacts: Artifacts = field(default_factory=Artifacts)
    sandbox: SandboxFacts = field(default_factory=SandboxFacts)   # what confinement this evaluation had
    env: Env = field(default_factory=Env)
    stdout_tail: str = ""
    stderr_tail: str = ""
    created_at: str = ""
    labels: dict[str, str | int] = field(default_factory=dict)    # the caller's tags (the GPU tests: test, kernel, ...)
    schema_version: int = SCHEMA_VERSION
    kind: str = "verification"

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update({k: getattr(self, k).to_dict() for k in ("correctness", "artifacts", "sandbox", "env")})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "record") -> VerificationRecord:
        """A record from its JSON object, validated field by field (:func:`parse_verification`)."""
        return parse_verification(d, where)


_PARTS = (Timing, Correctness, NvccCubin, Artifacts, SandboxFacts, Env)
_ADAPTERS: dict[type, Any] = {}


def _adapter(tp: type = VerificationRecord) -> Any:
    """The pydantic validator of a record type (built on first use: pydantic is not imported by every
    command): strict about unknown fields, in the record and in each of its parts."""
    if tp not in _ADAPTERS:
        from pydantic import ConfigDict, TypeAdapter

        for c in (VerificationRecord, *_PARTS):
            setattr(c, "__pydantic_config__", ConfigDict(extra="forbid"))  # noqa: B010 - pydantic reads this attribute
        _ADAPTERS[tp] = TypeAdapter(tp)
    return _ADAPTERS[tp]


def parse_verification(d: Any, where: str = "record") -> VerificationRecord:
    """A verification record from its JSON object, an older one first brought to the current shape by
    :mod:`mkb_eval.record_migrations`; ValueError naming ``where`` and every bad field (a version no
    migration reads, an unknown status or field, a field missing or of the wrong type)."""
    from pydantic import ValidationError

    from mkb_eval.record_migrations import migrate_verification

    if not isinstance(d, dict):
        raise ValueError(f"{where}: a verification record must be a JSON object, got {type(d).__name__}")
    d = migrate_verification(d, SCHEMA_VERSION, where)
    if d.get("status") not in STATUSES:
        raise ValueError(f"{where}: unknown status {d.get('status')!r} (one of {', '.join(STATUSES)})")
    missing = [f.name for f in fields(VerificationRecord) if f.name not in d]
    if isinstance(d.get("timing"), dict):
        missing += [f"timing.{f.name}" for f in fields(Timing) if f.name not in d["timing"]]
    if missing:
        raise ValueError(f"{where}: verification record lacks {', '.join(missing)} "
                         f"(a schema_version {SCHEMA_VERSION} record has every field)")
    try:
        rec: VerificationRecord = _adapter().validate_python(d)
    except ValidationError as e:
        raise ValueError(f"{where}: not a valid verification record: {validation_errors(e)}") from None
    return rec


def artifacts_from_worker(d: Any) -> Artifacts:
    """The worker's report of what its compile produced, as the record's type. The worker runs the
    candidate's code, so a report of another shape becomes the artifacts' error, never an exception."""
    from pydantic import ValidationError

    try:
        arts: Artifacts = _adapter(Artifacts).validate_python(d)
    except ValidationError as e:
        return Artifacts(error=f"the worker's artifact report is malformed: {validation_errors(e)}"[:1000])
    return arts


def validation_errors(e: Any) -> str:
    """A pydantic ValidationError as one line: each bad field's path and what is wrong with it."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(record)'}: {err['msg']}" for err in e.errors())


SCHEMAS = Path(__file__).with_name("schemas")
VERIFICATION_SCHEMA_PATH = SCHEMAS / "verification.schema.json"


def verification_schema() -> dict[str, Any]:
    """The JSON Schema of a verification record (``mkb_eval/schemas/verification.schema.json``)."""
    schema: dict[str, Any] = _adapter().json_schema()
    schema["required"] = [f.name for f in fields(VerificationRecord)]      # as parse_verification checks
    schema["$defs"]["Timing"]["required"] = [f.name for f in fields(Timing)]
    props = schema["properties"]
    props["schema_version"]["const"] = SCHEMA_VERSION                    # older ones: mkb_eval.record_migrations
    props["stages_s"]["description"] = ("Seconds by stage: the fixed names of mkb_eval.records.STAGES, the worker's "
                                        "stages as w_<stage>, the judge's parts as judge_correctness_<part> and "
                                        "judge_rechecks_<part>.")
    props["labels"]["description"] = "The caller's tags; the GPU tests write test, kernel, expected and run."
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
