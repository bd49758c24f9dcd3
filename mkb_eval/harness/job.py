"""The job a worker gets at start, as one record both sides share.

The parent builds it (:func:`.jobs.make_job`), attaches its worker's result channel and gate socket
(:meth:`.spawn.Worker.start`, by ``dataclasses.replace``) and writes :meth:`Job.encode` to the worker's
stdin: one JSON object with the keys, in order, of the dict it replaced. The worker reads it once with
:func:`decode`, checked against the annotations as the parent checks the worker's messages
(:mod:`.protocol`): a malformed job is a parent bug, refused as a :class:`~.protocol.ProtocolError` naming
the field (``job.<name>``), so the worker ends with a message saying so rather than a traceback deep
inside a phase. Stdlib only, importing only the protocol and the vocabularies (as the protocol does):
the worker reads it before any candidate code exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Literal

from mkb_eval.harness.protocol import ProtocolError, checked_record
from mkb_eval.vocab import Dsl, Size, Tier

Mode = Literal["verify", "retime"]     # retime: one correctness draw, no DSL-dependence draw (verified before)
Device = Literal["cpu", "cuda:0"]      # a GPU worker sees only its own GPU, as cuda:0
ATTACHED = ("sentinel", "channel", "gate_fd")    # set by the worker's start, not by make_job


@dataclass(frozen=True)
class Job:
    """What a worker is told at start: the problem and kernel (paths as the worker sees them), its
    output and dump folders, the correctness draws' seeds (the timed draws' come through the gate at the
    timing gate: they are in no job), the cores to pin to (GPU tier); then, attached once the worker is
    known, its result channel (path and sentinel) and its end of the gate socket (a descriptor)."""
    problem_dir: str
    dsl: Dsl
    tier: Tier
    size: Size
    device: Device
    kernel_path: str
    out_dir: str
    dump_dir: str
    mode: Mode
    correctness_seeds: list[int] = field(metadata={"min_len": 1})
    reuse_draws: list[int]                  # correctness draws that refill the previous draw's buffers
    nodsl_seed: int | None                  # None: no DSL-dependence draw
    timing_cpu: int | None                  # the core kept for this GPU's timed phase
    work_cpus: list[int] | None             # the cores for all other worker work
    sentinel: str = ""
    channel: str = ""
    gate_fd: int = -1

    def encode(self) -> bytes:
        """The job as written to the worker's stdin: a JSON object of every field, in order."""
        return json.dumps(vars(self)).encode()


def checked(**values: object) -> Job:
    """A job of these values, each checked against its field (the parent's own construction: a value
    outside a vocabulary fails here, not in the worker); ProtocolError names the field."""
    job: Job = checked_record(Job, values, "job")
    return job


def decode(data: str | bytes) -> Job:
    """The worker's reading of its job: the record, else :class:`ProtocolError` naming the field when the
    data is no JSON object, a field is missing or unknown, of a wrong type or value (a bool for an int, a
    string outside its vocabulary, no correctness seed), or the channel and gate were never attached."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:       # (UnicodeDecodeError is a ValueError)
        raise ProtocolError("job", f"not a JSON object ({type(e).__name__})") from None
    if isinstance(obj, dict):                       # every field is sent, the attached ones too
        missing = [f.name for f in fields(Job) if f.name not in obj]
        if missing:
            raise ProtocolError(f"job.{missing[0]}", "missing")
    job: Job = checked_record(Job, obj, "job")            # (not an object: refused there)
    if not job.sentinel or not job.channel:
        raise ProtocolError("job.sentinel" if not job.sentinel else "job.channel",
                            "empty: the parent never attached the worker's result channel")
    if job.gate_fd < 0:
        raise ProtocolError("job.gate_fd", f"{job.gate_fd}: the parent never attached the gate socket")
    return job
