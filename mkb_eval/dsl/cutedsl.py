"""NVIDIA CuTe DSL: its launch hooks, its CPU-tier artifacts (sm_90a cubins in the dump folder), its
worker environment and its prompt card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkb_eval.dsl.spec import ARCH, DslSpec, Hooks, NvccCubin


def install_hooks(h: Hooks) -> None:
    """Wrap every call path of CuTe DSL compiled functions (plain, JitExecutor, tvm-ffi)."""
    from cutlass.base_dsl import jit_executor as je

    for cls in (je.JitCompiledFunction, je.JitExecutor):
        h.patch(cls, "__call__", "cutedsl")
        h.patch(cls, "run_compiled_program", "cutedsl")
    from cutlass.cutlass_dsl import cuda_jit_executor as cj

    h.patch(cj.CudaDialectJitCompiledFunction, "__call__", "cutedsl")
    tp: Any = None
    try:
        from cutlass.cutlass_dsl import tvm_ffi_provider as tp
    except ImportError:  # tvm-ffi not installed: that call path does not exist (the counts below still apply)
        pass
    for name in ("TVMFFIJitCompiledFunction", "TVMFFIJitCompiledFunctionWithKwargs", "TVMFFIJitCompiledFunctionBase"):
        ffi_cls = getattr(tp, name, None)
        if ffi_cls is not None:
            h.patch(ffi_cls, "__call__", "cutedsl")
            h.patch(ffi_cls, "run_compiled_program", "cutedsl")
    # compiled functions are counted when created, to tell "never compiled" from "never called"
    h.count_creation(je.JitCompiledFunction, "cutedsl")
    from cutlass.base_dsl.compiler import CompileCallable    # cute.compile and cute.compile[options]

    if not getattr(CompileCallable._compile, "_mkb_observed", False):
        CompileCallable._compile = h.compiling(CompileCallable._compile)  # type: ignore[method-assign]


def compiled_artifacts(log: Any, dump_dir: Path, nvcc_cubin: NvccCubin) -> dict[str, Any]:
    """The sm_90a cubins (and PTX) CuTe DSL kept in the dump folder (``CUTE_DSL_KEEP``)."""
    cubins = sorted(dump_dir.rglob(f"*.{ARCH}.cubin"))
    ptx = sorted(dump_dir.rglob(f"*.{ARCH}.ptx"))
    if not cubins:
        return {"error": f"no {ARCH} cubin was produced (files: {[p.name for p in dump_dir.rglob('*')][:10]})"}
    return {"cubins": len(cubins), "cubin_bytes": sum(p.stat().st_size for p in cubins), "ptx": len(ptx)}


SPEC = DslSpec(
    name="cutedsl",
    display="CuTe DSL",
    card="cards/cutedsl.md",
    toolchain=("cutlass",),
    error_modules=("cutlass", "mlir"),
    preload=("cutlass", "cutlass.cute", "cutlass.cute.runtime", "cuda.bindings.driver", "cutlass.utils",
             "cutlass.pipeline", "cutlass.base_dsl.jit_executor", "cutlass.cutlass_dsl"),
    cache_dirs=("cute_cache",),
    env={"CUTE_DSL_DISABLE_FILE_CACHING": "1", "CUTE_DSL_CACHE_DIR": "{root}/cute_cache"},
    cpu_env={"CUTE_DSL_ARCH": ARCH, "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": "{root}/dump"},
    # CuTe DSL fixes its dump folder on import: a relative one lands in each forked worker's own folder
    fork_env={"CUTE_DSL_DUMP_DIR": "../dump"},
    install_hooks=install_hooks,
    compiled_artifacts=compiled_artifacts,
)
