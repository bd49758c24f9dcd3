"""Observe (and on demand suppress) launches of compiled DSL functions inside the worker.

Installed before the candidate is imported. Every entry point through which a compiled CuTe DSL
function or a TVM module function runs is wrapped at class level, so functions cached by the
candidate are observed too. ``launches`` counts outermost calls; while ``suppressed`` is set the
calls return without running anything (the DSL-dependence draw). The CPU tier uses the same
switch, since a compiled kernel cannot run without a GPU. The DSLs' compile entry points
(``cute.compile``, ``tvm.compile``) call ``on_compile("start" | "end")`` around an outermost compile
on the main thread when set: the worker uses it to hand its GPU lane back while it only compiles.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_state = threading.local()


class LaunchLog:
    """Counts of DSL launches by DSL, and whether launches are being suppressed."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {"cutedsl": 0, "tirx": 0}
        self.suppressed = False
        self.compiled: dict[str, int] = {"cutedsl": 0, "tirx": 0}
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


def install_cutedsl() -> None:
    """Wrap every call path of CuTe DSL compiled functions (plain, JitExecutor, tvm-ffi)."""
    from cutlass.base_dsl import jit_executor as je

    for cls in (je.JitCompiledFunction, je.JitExecutor):
        _patch(cls, "__call__", "cutedsl")
        _patch(cls, "run_compiled_program", "cutedsl")
    from cutlass.cutlass_dsl import cuda_jit_executor as cj

    _patch(cj.CudaDialectJitCompiledFunction, "__call__", "cutedsl")
    try:
        from cutlass.cutlass_dsl import tvm_ffi_provider as tp
    except ImportError:  # tvm-ffi not installed: that path does not exist
        return
    for name in ("TVMFFIJitCompiledFunction", "TVMFFIJitCompiledFunctionWithKwargs", "TVMFFIJitCompiledFunctionBase"):
        ffi_cls = getattr(tp, name, None)
        if ffi_cls is not None:
            _patch(ffi_cls, "__call__", "cutedsl")
            _patch(ffi_cls, "run_compiled_program", "cutedsl")
    # compiled functions are counted when created, to tell "never compiled" from "never called"
    _count_creation(je.JitCompiledFunction, "cutedsl")
    from cutlass.base_dsl.compiler import CompileCallable    # cute.compile and cute.compile[options]

    if not getattr(CompileCallable._compile, "_mkb_observed", False):
        CompileCallable._compile = compiling(CompileCallable._compile)  # type: ignore[method-assign]


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


def _has_device_code(mod: Any) -> bool:
    try:
        stack, seen = [mod], 0
        while stack and seen < 64:
            m = stack.pop()
            seen += 1
            if m.kind in ("cuda", "cuda_source"):
                return True
            stack.extend(m.imports)
    except Exception:  # noqa: BLE001 - a module the DSL's objects cannot walk is treated as holding no device code
        return False
    return False


class _ObservedFunction:
    """A TVM function of a module with CUDA device code; calls are counted (and may be suppressed)."""

    __slots__ = ("_fn", "_call")

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._call = _wrap_call("tirx", fn)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def install_tirx() -> None:
    """Wrap TVM module function lookups so functions of CUDA-bearing modules are observed."""
    import tvm
    import tvm_ffi

    mod_cls = tvm_ffi.Module

    def wrap_lookup(name: str) -> None:
        orig = mod_cls.__dict__[name]
        if getattr(orig, "_mkb_observed", False):
            return

        def lookup(self: Any, *args: Any, **kwargs: Any) -> Any:
            fn = orig(self, *args, **kwargs)
            if fn is not None and _has_device_code(self):
                return _ObservedFunction(fn)
            return fn

        lookup._mkb_observed = True  # type: ignore[attr-defined]
        setattr(mod_cls, name, lookup)

    for name in ("__getattr__", "get_function", "__getitem__"):
        if name in mod_cls.__dict__:
            wrap_lookup(name)
    if "__call__" in mod_cls.__dict__:
        _patch(mod_cls, "__call__", "tirx")
    _patch(tvm.runtime.Executable, "__call__", "tirx")

    compile_fn = tvm.compile
    if not getattr(compile_fn, "_mkb_observed", False):
        def counted_compile(*args: Any, **kwargs: Any) -> Any:
            LOG.compiled["tirx"] += 1
            exe = compile_fn(*args, **kwargs)
            LOG.artifacts.append({"dsl": "tirx", "executable": exe})
            return exe

        tvm.compile = compiling(counted_compile)


_PRELOAD = {
    "cutedsl": ("cutlass", "cutlass.cute", "cutlass.cute.runtime", "cuda.bindings.driver", "cutlass.utils",
                "cutlass.pipeline", "cutlass.base_dsl.jit_executor", "cutlass.cutlass_dsl"),
    "tirx": ("tvm", "tvm_ffi", "tvm.script"),
}


def preload(dsl: str) -> None:
    """Import a toolchain's modules without observing anything (a warm worker, before its job)."""
    import importlib

    for name in _PRELOAD[dsl]:
        importlib.import_module(name)


def install(dsl: str) -> None:
    """Install the observers for one DSL (imports the DSL toolchain)."""
    if dsl == "cutedsl":
        install_cutedsl()
    elif dsl == "tirx":
        install_tirx()
    else:
        raise ValueError(f"unknown DSL '{dsl}'")
