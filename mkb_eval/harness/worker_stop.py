"""How the worker ends: :class:`Stop` carries a final status, and what the candidate raised becomes
``compile_error`` or ``runtime_error`` with the harness's frames cut from its traceback. Shared by
the worker's phases (:mod:`.worker`, :mod:`.worker_phase2`)."""

from __future__ import annotations

import traceback
from typing import Any

from mkb_eval.dsl import SPECS

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
