"""The parent<->worker protocol, defined once: every message either side sends, as a small record.

The gate socket (:mod:`.gate`) carries the lane gate's bytes and the timing operations (``op``) to the
worker, and the window's replies back; the result channel (:mod:`.channel`) carries the worker's
JSON lines (``kind``: progress, lane, phase1, final). Both sides import this module, so it is stdlib
only and a leaf. The sender encodes; the parent decodes what comes from the worker (:func:`decode`,
:func:`decode_digests`) against each record's annotations: an unknown kind or field, a missing one, a
wrong type (bool for int, NaN, a string for a list), an over-long list or text is a
:class:`ProtocolError` naming the field, which the parent turns into :data:`PROTOCOL_STATUS`, never an
exception of its own. The worker decodes the parent's operations unchecked (:func:`decode_op`).
"""

from __future__ import annotations

import json
import math
import reprlib
import types
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from mkb_eval.vocab import Status

# -- bytes on the gate -----------------------------------------------------------------------------
GO, STOP = b"go", b"stop"                      # the lane gate (phase 1): go on, or end
READY, CALLED, SAVED, PREPPED = b"R", b"C", b"S", b"P"      # the window's replies (:mod:`.attest`)

OpName = Literal["events", "prep", "window", "save", "end"]
Kind = Literal["progress", "lane", "phase1", "final"]
Stage = Literal["start", "setup", "dsl_import", "kernel_import", "ready", "correctness", "dsl_dependence",
                "compile_only", "artifacts", "warmup", "timing", "events", "device_time", "report", "done"]
LaneWant = Literal["release", "shared", "step_aside"]
NoDsl = Literal["skipped", "returned", "raised"]
# what a worker's final message may claim: a failure it saw, the CPU tier's result, or how it ended
WorkerStatus = Literal["compile_error", "runtime_error", "policy_violation", "no_dsl_kernel", "unverified", "timed", "stopped"]
FAILURES: tuple[str, ...] = ("compile_error", "runtime_error", "policy_violation", "no_dsl_kernel")
PROTOCOL_STATUS: Status = "runtime_error"      # a worker that broke the protocol (as a bad window reply always was)
PROTOCOL_FLAG = "protocol_error"

MAX_LINE = 1 << 20          # bytes in one channel line (the gate's packets have the same cap)
MAX_ITEMS = 1 << 16         # items in one list
MAX_TEXT = 1 << 16          # characters in one string
MAX_INT = 1 << 64           # |int| (seeds, digests and addresses are 64-bit)
MAX_DEPTH = 16              # nesting of free-form JSON (artifacts)


class ProtocolError(Exception):
    """A message from the worker that the protocol does not allow; ``where`` names the field."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


# -- parent to worker: the timing operations -------------------------------------------------------
@dataclass(frozen=True)
class EventsOp:
    """The timing gate: the event-timed draws' seeds (none reached the worker before)."""
    op: ClassVar[OpName] = "events"
    warmup_seeds: list[int]
    timing_seeds: list[int]
    device: bool = True


@dataclass(frozen=True)
class PrepOp:
    """Hold a window's memory once (``calls`` + 1 sets)."""
    op: ClassVar[OpName] = "prep"
    calls: int


@dataclass(frozen=True)
class WindowOp:
    """One attested window: its seeds and digest key."""
    op: ClassVar[OpName] = "window"
    seeds: list[int]
    key: int
    tag: str


@dataclass(frozen=True)
class SaveOp:
    """Save the window outputs chosen after the window, as ``<tag>_<i>.pt``."""
    op: ClassVar[OpName] = "save"
    which: list[int]
    tag: str


@dataclass(frozen=True)
class EndOp:
    """The timed phase is over."""
    op: ClassVar[OpName] = "end"


Op = EventsOp | PrepOp | WindowOp | SaveOp | EndOp
_OPS: dict[str, type[Op]] = {c.op: c for c in (EventsOp, PrepOp, WindowOp, SaveOp, EndOp)}


def encode_op(op: Op) -> bytes:
    return json.dumps({"op": op.op, **vars(op)}).encode()


def decode_op(data: bytes) -> Op | None:
    """The worker's reading of one gate packet: an operation, or None (stop, end, or the parent left)."""
    if not data.startswith(b"{"):
        return None
    d = json.loads(data)
    cls = _OPS.get(d.pop("op", None)) if isinstance(d, dict) else None
    return None if cls is None or cls is EndOp else cls(**d)


# -- worker to parent on the gate: a window's replies -----------------------------------------------
@dataclass(frozen=True)
class WindowDigests:
    """The commitment of each call's output: per call, per output tensor, ``[d0, d1]``."""
    digests: list[list[list[int]]]


@dataclass(frozen=True)
class WorkerError:
    """An operation the worker could not do (e.g. too little memory for the window)."""
    error: str


def digests_reply(digests: list[list[list[int]]]) -> bytes:
    """The window's last packet. It is built inside the timed window, so no record is made for it."""
    return json.dumps({"digests": digests}).encode()


def error_reply(error: str) -> bytes:
    return json.dumps(vars(WorkerError(error))).encode()


def decode_digests(data: bytes, calls: int) -> list[list[list[int]]]:
    """The parent's reading of a window's digests packet: one ``[d0, d1]`` list per output tensor of
    each of the ``calls`` calls, else :class:`ProtocolError`."""
    got = checked_record(WindowDigests, _loads(data, "window"), "window").digests
    if len(got) != calls:
        raise ProtocolError("window.digests", f"expected {calls} digests (one per call), got {len(got)}")
    for i, call in enumerate(got):
        for j, pair in enumerate(call):
            if len(pair) != 2:
                raise ProtocolError(f"window.digests[{i}][{j}]", f"expected a pair, got {len(pair)} numbers")
    return got


def reply_text(data: bytes) -> str:
    """What an unexpected gate reply says, for the verdict's message: the worker's error, or the reply
    itself described. Never raises."""
    try:
        return checked_record(WorkerError, _loads(data, "reply"), "reply").error[:2000]
    except ProtocolError as e:
        return f"unexpected reply {data[:60]!r} ({e})"


# -- worker to parent on the result channel ---------------------------------------------------------
@dataclass(frozen=True)
class Progress:
    """A stage begins: ``t`` the worker's wall clock, ``cpu`` its CPU seconds so far; ``draw`` in the
    correctness, warm-up and timing stages."""
    kind: ClassVar[Kind] = "progress"
    stage: Stage
    t: float
    cpu: float
    draw: int | None = None


@dataclass(frozen=True)
class Setup:
    """The first progress message, sent before the candidate exists: the sandbox as the worker sees it."""
    kind: ClassVar[Kind] = "progress"
    stage: Literal["setup"]
    t: float
    cpu: float
    network: str
    outside_write: str


@dataclass(frozen=True)
class EventsReport:
    """The worker's event-timed draws of its ``n``-th ``events`` op (its report: evidence only)."""
    kind: ClassVar[Kind] = "progress"
    stage: Literal["events"]
    t: float
    cpu: float
    n: int
    times_ms: list[float] = field(metadata={"min_len": 1})
    device_ms: float | None
    launches_per_call: list[int]
    timing_s: float
    host_call_ms: float | None
    cpu_probe_ms: float


@dataclass(frozen=True)
class Lane:
    """The ``n``-th lane request of phase 1: a compile starts (release), ends (shared), or a draw ended
    (step_aside); all but release wait for the gate."""
    kind: ClassVar[Kind] = "lane"
    n: int
    want: LaneWant


@dataclass(frozen=True)
class Draw:
    """One correctness draw: its launches, the inputs' digests after the call, their addresses."""
    draw: int
    launches: int
    input_digests: list[tuple[int, int] | None]
    addresses: list[int]


@dataclass(frozen=True)
class Phase1Report:
    """Phase 1 done: the correctness draws (outputs saved for the judge) and the DSL-dependence draw."""
    kind: ClassVar[Kind] = "phase1"
    stage: Literal["correctness"]
    draws: list[Draw]
    nodsl: NoDsl
    poisoned_bytes: int
    import_s: float
    first_call_s: float | None
    correctness_s: float


@dataclass(frozen=True)
class Final:
    """The worker's last message: a status it may claim (:data:`WorkerStatus`) and the stage it ended in;
    the CPU tier's result adds its compile facts, the timed phase's the windows served."""
    kind: ClassVar[Kind] = "final"
    status: WorkerStatus
    stage: Stage
    cpu: float
    message: str = ""
    flags: list[str] = field(default_factory=list)
    artifacts: dict[str, Any] | None = None
    launches: int = 0
    compile_s: float = 0.0
    import_s: float = 0.0
    after_launch_error: str | None = None
    windows_served: int = 0


@dataclass(frozen=True)
class Malformed:
    """A channel line the protocol does not allow, kept in its place among the messages."""
    kind: ClassVar[str] = "malformed"
    error: ProtocolError


ProgressMessage = Progress | Setup | EventsReport
Message = Progress | Setup | EventsReport | Lane | Phase1Report | Final
_PROGRESS: dict[str, type[ProgressMessage]] = {"setup": Setup, "events": EventsReport}
_KINDS: dict[str, type[Message]] = {"lane": Lane, "phase1": Phase1Report, "final": Final}


def progress(stage: str, t: float, cpu: float, **fields_: Any) -> ProgressMessage:
    """The progress record of ``stage`` (the setup and events stages carry their own fields)."""
    cls: Any = _PROGRESS.get(stage, Progress)
    return cls(stage=stage, t=t, cpu=cpu, **fields_)


def encode(msg: Message) -> dict[str, Any]:
    """A channel message as the JSON object sent (the channel adds the sentinel and the newline)."""
    return {"kind": msg.kind, **{k: [vars(x) for x in v] if isinstance(v, list) and v and is_dataclass(v[0]) else v
                                 for k, v in vars(msg).items()}}      # (the draws of phase 1 are records)


def decode(obj: object) -> Message:
    """The parent's reading of one channel message (a parsed JSON object): its record, else
    :class:`ProtocolError` naming the field."""
    if not isinstance(obj, dict):
        raise ProtocolError("message", f"expected an object, got {_show(obj)}")
    kind, stage = obj.get("kind"), obj.get("stage")
    cls: type[Message] | None
    if kind == "progress":
        cls = _PROGRESS.get(stage, Progress) if isinstance(stage, str) else Progress
    else:
        cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("kind", f"unknown message kind {_show(kind)}")
    where = str(stage) if cls in (Setup, EventsReport) else str(kind)
    return checked_record(cls, {k: v for k, v in obj.items() if k != "kind"}, where)


def decode_line(text: str) -> Message | Malformed | None:
    """One channel line after its sentinel: its record, :class:`Malformed`, or None for a torn line
    (not JSON, or not an object: ignored, as before the protocol had records)."""
    if len(text) > MAX_LINE:
        return Malformed(ProtocolError("message", f"a line of {len(text)} characters (at most {MAX_LINE})"))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    except (ValueError, RecursionError) as e:      # an integer of too many digits, nesting past the stack
        return Malformed(ProtocolError("message", f"unreadable JSON ({type(e).__name__})"))
    if not isinstance(obj, dict):
        return None
    try:
        return decode(obj)
    except ProtocolError as e:
        return Malformed(e)


# -- checking a record against its annotations ------------------------------------------------------
_HINTS: dict[type, dict[str, Any]] = {}
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother = 60, 60


_show = _REPR.repr


def _loads(data: bytes, where: str) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolError(where, f"not a JSON message ({type(e).__name__})") from None


def checked_record(cls: Any, obj: object, where: str) -> Any:     # ``cls`` from ``obj``, every field checked (job.py too)
    if not isinstance(obj, dict):
        raise ProtocolError(where, f"expected an object, got {_show(obj)}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    extra = sorted(str(k) for k in obj if k not in known)
    if extra:
        raise ProtocolError(f"{where}.{extra[0]}", "unknown field")
    out = {}
    for name, f in known.items():
        if name in obj:
            out[name] = _check(obj[name], hints[name], f"{where}.{name}", f.metadata.get("min_len", 0))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolError(f"{where}.{name}", "missing")
    return cls(**out)


def _check(v: Any, tp: Any, where: str, min_len: int = 0) -> Any:
    """``v`` as annotation ``tp`` allows it (ints widened to float), else :class:`ProtocolError`."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return _json_value(v, where, 0)
    if origin is Literal:
        if any(type(v) is type(a) and v == a for a in args):
            return v
        raise ProtocolError(where, f"expected one of {', '.join(map(repr, args))}, got {_show(v)}")
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(v, inner, where, min_len)
    if tp in (bool, int, float, str):
        return _scalar(v, tp, where)
    if origin in (list, tuple):
        if not isinstance(v, list):
            raise ProtocolError(where, f"expected a list, got {_show(v)}")
        if origin is tuple:
            if len(v) != len(args):
                raise ProtocolError(where, f"expected {len(args)} items, got {len(v)}")
            return tuple(_check(x, a, f"{where}[{i}]") for i, (x, a) in enumerate(zip(v, args, strict=True)))
        if not min_len <= len(v) <= MAX_ITEMS:
            raise ProtocolError(where, f"expected {min_len} to {MAX_ITEMS} items, got {len(v)}")
        return [_check(x, args[0], f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise ProtocolError(where, f"expected an object, got {_show(v)}")
        return {k: _check(x, args[1], f"{where}.{k}") for k, x in v.items()}
    if is_dataclass(tp):
        return checked_record(tp, v, where)
    raise TypeError(f"the protocol has no check for {tp!r} ({where})")


_SCALARS = {bool: "true or false", int: "an integer", float: "a finite number", str: f"a string of at most {MAX_TEXT} characters"}


def _scalar(v: Any, tp: type, where: str) -> Any:
    t = type(v)          # exactly: a bool is no int here, and an int is a float only where a float is due
    if (t is tp is bool or t is tp is str and len(v) <= MAX_TEXT or t is int and tp in (int, float) and abs(v) <= MAX_INT
            or t is tp is float and math.isfinite(v)):
        return float(v) if tp is float else v
    raise ProtocolError(where, f"expected {_SCALARS[tp]}, got {_show(v)}")


def _json_value(v: Any, where: str, depth: int) -> Any:
    """Free-form JSON (artifacts): finite numbers, bounded text, lists and objects, at most MAX_DEPTH deep."""
    if depth > MAX_DEPTH:
        raise ProtocolError(where, f"nested deeper than {MAX_DEPTH}")
    if v is None or type(v) is bool:
        return v
    if type(v) in (int, float):
        return _scalar(v, float if type(v) is float else int, where)
    if type(v) is str:
        return _scalar(v, str, where)
    if isinstance(v, list):
        return [_json_value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {k: _json_value(x, f"{where}.{k}", depth + 1) for k, x in v.items()}
    raise ProtocolError(where, f"not JSON: {_show(v)}")
