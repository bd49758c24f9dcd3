"""Run-time guard in the worker: the candidate may not call the task's ``reference`` or ``make_inputs``.

The static policy only sees names; a candidate reaches the task module through ``sys.modules``, ``gc``
or frames whatever it is called. So the worker installs this guard after importing the task and before
importing the candidate, and watches the start of every Python code object:

* Python 3.12+: ``sys.monitoring`` (tool ``mkb-guard``), ``PY_START`` for the whole process. Code that
  is not the task's is seen once and then disabled for the tool, so the steady-state cost is nil.
* Python 3.11 (CPU machines, CI): ``sys.settrace`` + ``threading.settrace``, a global trace function
  that returns no local tracer (it sees each new frame once; no line events).

A call is forbidden when the code started is the task's (``reference.py``'s code objects, or any code
compiled from that file name) or a copy of ``reference`` / ``make_inputs`` (same bytecode and names,
whatever its function name or file), except ``make_inputs`` and its helpers while the harness itself
makes inputs (``harness()``, on the harness's thread). ``reference`` is never called in the worker, so
any call to it is forbidden. A forbidden call records a violation and raises :class:`ReferenceCall`
inside the call, so the candidate gets no result from it even if it catches the exception and wipes
the record; ``check()`` (before every report the worker sends) also says when the guard was removed
or replaced (tool freed, events off, another callback, trace function changed, ``make_inputs`` code
swapped).

Caught: calls through ``sys.modules`` / ``gc`` / frames, ``FunctionType`` copies of the code,
``code.replace`` renames, re-importing ``reference.py`` from its file (any module name), ``exec`` of its
source under its own file name or under another name (same bytecode). Not caught: a reference
re-implemented with changed bytecode (any edit to its body: that is the candidate's own torch code,
which the DSL-dependence draw judges), code run inside another monitoring / trace / profile callback
(CPython fires no events there), code run by ``torch.compile`` from a rewritten frame, threads started
with ``_thread`` on 3.11, a candidate that finds the guard (``gc``) and opens its harness window to call
``make_inputs`` (never ``reference``), and one that removes the guard and restores it exactly between
two checks. The process is the candidate's: the guard raises the
cost of cheating, the parent's verdict does not rest on it alone.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TOOL_NAME = "mkb-guard"


class ReferenceCall(BaseException):
    """Raised inside a forbidden call (a BaseException: ``except Exception`` in the candidate lets it pass)."""


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _fingerprint(code: types.CodeType) -> tuple[bytes, tuple[str, ...]]:
    return code.co_code, code.co_names


class Guard:
    """The installed guard of one worker (``install``)."""

    def __init__(self, module: types.ModuleType) -> None:
        self.file = getattr(module, "__file__", None) or "<task>"
        self._real = os.path.realpath(self.file)
        self._base = os.path.basename(self.file)
        self.violations: list[str] = []
        self._harness_thread: int | None = None
        self._get_ident = threading.get_ident
        self._make = getattr(module, "make_inputs", None)
        self._make_code = getattr(self._make, "__code__", None)
        # the task's code objects, held so that their ids stay theirs
        self._task: dict[int, tuple[types.CodeType, str]] = {}
        self._copies: dict[tuple[bytes, tuple[str, ...]], str] = {}
        for name, value in vars(module).items():
            obj = value
            for _ in range(8):                   # through decorators (torch.no_grad) to the task's own code
                code = getattr(obj, "__code__", None)
                if isinstance(code, types.CodeType) and code.co_filename == self.file:
                    for c in _codes(code):
                        self._task[id(c)] = (c, name)
                    if name in ("reference", "make_inputs"):
                        self._copies[_fingerprint(code)] = name
                    break
                obj = getattr(obj, "__wrapped__", None)
                if obj is None:
                    break
        self.mechanism = "none"

    # -- the decision (runs inside the hook: small, no allocation-heavy work) ----------------------
    def _task_code(self, code: types.CodeType) -> str | None:
        """The task function this code belongs to (or copies), or None."""
        hit = self._task.get(id(code))
        if hit is not None and hit[0] is code:
            return hit[1]
        fn = code.co_filename
        if fn == self.file or (fn.endswith(self._base) and os.path.realpath(fn) == self._real):
            return code.co_name
        return self._copies.get(_fingerprint(code))

    def _started(self, code: types.CodeType) -> bool:
        """Whether ``code`` is watched (False: never look at it again); raises on a forbidden call."""
        name = self._task_code(code)
        if name is None:
            return False
        if name != "reference" and self._harness_thread == self._get_ident():
            return True                       # the harness's own make_inputs and its helpers
        if name == "<module>":
            msg = "the candidate re-imported or exec'd the task's reference.py"
        else:
            what = "reference" if name == "reference" else f"the task's {name}"
            msg = f"the candidate called {what} ({code.co_name}, line {code.co_firstlineno})"
        if msg not in self.violations:
            self.violations.append(msg)
        raise ReferenceCall(msg)

    @contextmanager
    def harness(self) -> Iterator[None]:
        """The harness makes inputs: ``make_inputs`` (not ``reference``) may run on this thread."""
        prev, self._harness_thread = self._harness_thread, self._get_ident()
        try:
            yield
        finally:
            self._harness_thread = prev

    def check(self) -> list[str]:
        """Violations seen, and every way the guard was found removed or replaced (empty: all well)."""
        bad = list(self.violations)
        bad += self._installed()
        make_code = getattr(self._make, "__code__", None)
        if make_code is not self._make_code:
            bad.append("make_inputs' code was replaced")
        return bad

    def _installed(self) -> list[str]:
        return []

    def remove(self) -> None:
        """Uninstall (tests; a worker keeps its guard until it exits)."""


class _Monitoring(Guard):
    """Python 3.12+: one process-wide ``sys.monitoring`` tool."""

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module)
        # sys.monitoring is Python 3.12+; mypy checks for 3.10 (python_version), where sys has no such attribute
        mon: Any = sys.monitoring  # type: ignore[attr-defined]
        self._mon = mon
        self._fns = (mon.get_tool, mon.get_events, mon.register_callback, mon.set_events)
        self._event = mon.events.PY_START
        self._disable = mon.DISABLE
        self.tool = next((i for i in (4, 3, 2, 1, 0, 5) if mon.get_tool(i) is None), None)
        if self.tool is None:
            raise RuntimeError("no free sys.monitoring tool id")
        mon.use_tool_id(self.tool, TOOL_NAME)
        started, disable = self._started, self._disable

        def on_start(code: types.CodeType, offset: int) -> Any:
            return None if started(code) else disable

        self._cb = on_start
        mon.register_callback(self.tool, self._event, on_start)
        mon.set_events(self.tool, self._event)
        self.mechanism = "sys.monitoring"

    def _installed(self) -> list[str]:
        get_tool, get_events, register, _ = self._fns
        bad = []
        if get_tool(self.tool) != TOOL_NAME:
            bad.append(f"the guard's monitoring tool {self.tool} was freed or renamed")
        elif not get_events(self.tool) & self._event:
            bad.append("the guard's PY_START events were turned off")
        else:
            prev = register(self.tool, self._event, self._cb)     # puts ours back, says what was there
            if prev is not self._cb:
                bad.append("the guard's monitoring callback was replaced")
        return bad

    def remove(self) -> None:
        if self._mon.get_tool(self.tool) == TOOL_NAME:
            self._mon.set_events(self.tool, 0)
            self._mon.register_callback(self.tool, self._event, None)
            self._mon.free_tool_id(self.tool)


class _Tracing(Guard):
    """Python 3.11: a global trace function on every thread that returns no local tracer."""

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module)
        started = self._started
        watched: dict[int, types.CodeType] = {}     # ids of code seen and found harmless, held
        self._seen = watched

        def trace(frame: types.FrameType, event: str, arg: Any) -> None:
            code = frame.f_code
            if watched.get(id(code)) is not code and not started(code):
                watched[id(code)] = code
            return None

        self._fn = trace
        self._gettrace, self._tgettrace = sys.gettrace, getattr(threading, "gettrace", None)
        threading.settrace(trace)
        sys.settrace(trace)
        self.mechanism = "sys.settrace"

    def _installed(self) -> list[str]:
        bad = []
        if self._gettrace() is not self._fn:
            if not (self.violations and self._gettrace() is None):   # CPython unsets a trace function that raised
                bad.append("the guard's trace function was removed or replaced")
            sys.settrace(self._fn)
        if self._tgettrace is not None and self._tgettrace() is not self._fn:
            bad.append("the guard's trace function for new threads was removed or replaced")
        return bad

    def remove(self) -> None:
        sys.settrace(None)
        threading.settrace(None)


def install(module: types.ModuleType, mechanism: str | None = None) -> Guard:
    """Watch the task ``module``'s code from now on (call before the candidate is imported).
    ``mechanism`` ("monitoring" | "trace") forces one, for tests; default: the best this Python has."""
    if mechanism is None:
        mechanism = "monitoring" if hasattr(sys, "monitoring") else "trace"
    if mechanism == "monitoring":
        try:
            return _Monitoring(module)
        except RuntimeError:            # every tool id taken (by the harness's imports): trace instead
            pass
    return _Tracing(module)
