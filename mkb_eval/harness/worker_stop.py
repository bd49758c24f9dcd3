"""How the worker ends: :class:`Stop` carries a final status, and what the candidate raised becomes
``compile_error`` or ``runtime_error`` with the harness's frames cut from its traceback; a malformed
job ends it before it starts (:func:`read_job`). Shared by the worker's phases (:mod:`.worker`,
:mod:`.worker_phase2`)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from mkb_eval.dsl import SPECS
from mkb_eval.harness import protocol
from mkb_eval.harness.job import Job, decode

# exceptions raised by these packages before any launch are compile errors
_DSL_MODULES = tuple(m for s in SPECS.values() for m in s.error_modules)


def classify(exc: BaseException, launched: bool) -> str:
    if isinstance(exc, (SyntaxError, ImportError)):
        return "compile_error"
    mod = type(exc).__module__ or ""
    if not launched and (mod.split(".")[0] in _DSL_MODULES or "DSL" in type(exc).__name__):
        return "compile_error"
    return "runtime_error"


def format_exc(exc: BaseException, limit: int = 4000) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    keep = [ln for ln in lines if "mkb_eval/harness" not in ln and "<frozen importlib" not in ln]
    text = "".join(keep)
    return text[-limit:]


class Stop(Exception):
    """Ends the worker with a final status message."""

    def __init__(self, status: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def read_job(data: str) -> Job:
    """The job on the worker's stdin, decoded (:func:`.job.decode`). A malformed one is the parent's bug:
    the worker says which field on stderr and, where the job's channel and sentinel can be read, in a
    final message the parent records (a ``runtime_error`` at ``start``); then it exits with status 2,
    before any candidate code exists, rather than failing deep inside a phase."""
    try:
        return decode(data)
    except protocol.ProtocolError as e:
        text = f"the parent sent a malformed job (a harness bug, not the kernel's): {e}"
    sys.stderr.write(f"mkb worker: {text}\n")
    try:
        raw = json.loads(data)
        chan, sentinel = raw["channel"], raw["sentinel"]
        if isinstance(chan, str) and isinstance(sentinel, str) and chan and sentinel:
            from mkb_eval.harness.channel import Channel

            final = protocol.Final(status="runtime_error", stage="start", message=text, cpu=round(time.process_time(), 3))
            Channel(chan, sentinel).send(**protocol.encode(final))
    except Exception:  # noqa: BLE001 - no readable channel: stderr and the exit status say it
        pass
    sys.stderr.flush()
    os._exit(2)
