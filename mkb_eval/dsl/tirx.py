"""Apache TVM TIRx: its launch hooks (functions of modules with CUDA device code), its CPU-tier
artifacts (the CUDA source of every device module, compiled to a cubin with nvcc when present), its
worker environment and its prompt card."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkb_eval.dsl.spec import DslSpec, Hooks, NvccCubin


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

    def __init__(self, fn: Any, wrap_call: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        self._fn = fn
        self._call = wrap_call("tirx", fn)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def install_hooks(h: Hooks) -> None:
    """Wrap TVM module function lookups so functions of CUDA-bearing modules are observed."""
    import tvm
    import tvm_ffi

    mod_cls = tvm_ffi.Module
    wrap_call = h.wrap_call

    def wrap_lookup(name: str) -> None:
        orig = mod_cls.__dict__[name]
        if getattr(orig, "_mkb_observed", False):
            return

        def lookup(self: Any, *args: Any, **kwargs: Any) -> Any:
            fn = orig(self, *args, **kwargs)
            if fn is not None and _has_device_code(self):
                return _ObservedFunction(fn, wrap_call)
            return fn

        lookup._mkb_observed = True  # type: ignore[attr-defined]
        setattr(mod_cls, name, lookup)

    for name in ("__getattr__", "get_function", "__getitem__"):
        if name in mod_cls.__dict__:
            wrap_lookup(name)
    if "__call__" in mod_cls.__dict__:
        h.patch(mod_cls, "__call__", "tirx")
    h.patch(tvm.runtime.Executable, "__call__", "tirx")

    compile_fn = tvm.compile
    if not getattr(compile_fn, "_mkb_observed", False):
        log = h.log

        def counted_compile(*args: Any, **kwargs: Any) -> Any:
            log.compiled["tirx"] += 1
            exe = compile_fn(*args, **kwargs)
            log.artifacts.append({"dsl": "tirx", "executable": exe})
            return exe

        tvm.compile = h.compiling(counted_compile)


def _cuda_sources(exe: Any) -> list[str]:
    """CUDA C++ of every device module in a TVM executable's import tree."""
    out, stack, seen = [], [getattr(exe, "mod", exe)], 0
    while stack and seen < 64:
        m = stack.pop()
        seen += 1
        if m.kind == "cuda":
            src = m.inspect_source()
            if src:
                out.append(src)
        stack.extend(m.imports)
    return out


def compiled_artifacts(log: Any, dump_dir: Path, nvcc_cubin: NvccCubin) -> dict[str, Any]:
    """The CUDA source of every ``tvm.compile`` result, each compiled to a cubin by ``nvcc_cubin``; a source
    identical to an earlier one (a kernel that compiles the same module twice) shares its cubin."""
    sources = [s for a in log.artifacts if a["dsl"] == "tirx" for s in _cuda_sources(a["executable"])]
    if not sources:
        return {"error": "no CUDA device module was produced by tvm.compile (is the target CUDA?)"}
    res: dict[str, Any] = {"cuda_sources": len(sources), "cuda_source_bytes": sum(len(s) for s in sources)}
    done: dict[str, dict[str, Any]] = {}
    for k, src in enumerate(sources):
        r = done.get(src)
        if r is None:
            r = done[src] = nvcc_cubin(src, dump_dir, f"tirx_{k}")
        if "error" in r:
            return {**res, "error": r["error"]}
        res.setdefault("nvcc", []).append(dict(r))
    return res


SPEC = DslSpec(
    name="tirx",
    display="TIRx",
    card="cards/tirx.md",
    toolchain=("tvm",),
    error_modules=("tvm", "tvm_ffi"),
    preload=("tvm", "tvm_ffi", "tvm.script"),
    cache_dirs=("tvm",),
    env={"TVM_HOME": "{root}/tvm"},
    cpu_env={},
    fork_env={},        # (TVM's FFI asks torch whether CUDA is available: spawn answers it through NVML for every server)
    install_hooks=install_hooks,
    compiled_artifacts=compiled_artifacts,
)
