"""Observe (and on demand suppress) launches of compiled DSL functions inside the worker.

Installed before the candidate is imported. Every entry point through which a compiled CuTe DSL
function or a TVM module function runs is wrapped at class level, so functions cached by the
candidate are observed too. ``launches`` counts outermost calls; while ``suppressed`` is set the
calls return without running anything (the DSL-dependence draw). The CPU tier uses the same
switch, since a compiled kernel cannot run without a GPU. The DSLs' compile entry points
(``cute.compile``, ``tvm.compile``) call ``on_compile("start" | "end")`` around an outermost compile
on the main thread when set: the worker uses it to hand its GPU lane back while it only compiles.
What each DSL wraps is its spec's ``install_hooks`` (:mod:`mkb_eval.dsl`), given this module's helpers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mkb_eval.dsl import SPECS, Hooks, get

_state = threading.local()


class LaunchLog:
    """Counts of DSL launches by DSL, and whether launches are being suppressed."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(SPECS, 0)
        self.suppressed = False
        self.compiled: dict[str, int] = dict.fromkeys(SPECS, 0)
        self.artifacts: list[dict[str, Any]] = []
        self.on_compile: Callable[[str], None] | None = None

    def total(self, dsl: str | None = None) -> int:
        return sum(self.counts.values()) if dsl is None else self.counts[dsl]


LOG = LaunchLog()


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _wrap_call(dsl: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def observed(*args: Any, **kwargs: Any) -> Any:
        outer = _depth() == 0
        if outer:
            LOG.counts[dsl] += 1
            if LOG.suppressed:
                return None
        _state.depth = _depth() + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.depth = _depth() - 1

    observed.__wrapped__ = fn  # type: ignore[attr-defined]
    observed._mkb_observed = True  # type: ignore[attr-defined]
    return observed


def compiling(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a DSL compile entry point) announcing its outermost main-thread calls to ``LOG.on_compile``."""
    def announced(*args: Any, **kwargs: Any) -> Any:
        hook = LOG.on_compile
        if hook is None or getattr(_state, "compiling", False) or threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        _state.compiling = True
        hook("start")
        try:
            return fn(*args, **kwargs)
        finally:
            _state.compiling = False
            hook("end")

    announced.__wrapped__ = fn  # type: ignore[attr-defined]
    announced._mkb_observed = True  # type: ignore[attr-defined]
    return announced


def _patch(cls: type, name: str, dsl: str) -> None:
    fn = cls.__dict__.get(name)
    if fn is None or getattr(fn, "_mkb_observed", False):
        return
    setattr(cls, name, _wrap_call(dsl, fn))


def _count_creation(cls: type, dsl: str) -> None:
    target: Any = cls           # its __init__ is read and replaced: mypy types neither on a class object
    init = target.__init__
    if getattr(init, "_mkb_observed", False):
        return

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        LOG.compiled[dsl] += 1
        init(self, *args, **kwargs)

    counted_init._mkb_observed = True  # type: ignore[attr-defined]
    target.__init__ = counted_init


_HOOKS = Hooks(patch=_patch, wrap_call=_wrap_call, count_creation=_count_creation, compiling=compiling, log=LOG)


def preload(dsl: str) -> None:
    """Import a toolchain's modules without observing anything (a warm worker, before its job)."""
    import importlib

    for name in get(dsl).preload:
        importlib.import_module(name)


def install(dsl: str) -> None:
    """Install the observers for one DSL (imports the DSL toolchain): its spec's ``install_hooks``."""
    get(dsl).install_hooks(_HOOKS)
