"""CPU-tier artifact checks: CuTe DSL → sm_90a cubin; TIRx → CUDA source → cubin with nvcc when present."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

ARCH = "sm_90a"


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


def nvcc_cubin(source: str, work: Path, name: str, timeout: float = 180.0) -> dict[str, Any]:
    """Compile CUDA source to an sm_90a cubin with nvcc; {'cubin_bytes': n} or {'error': ...}."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return {"skipped": "nvcc not found"}
    cu, cubin = work / f"{name}.cu", work / f"{name}.cubin"
    cu.write_text(source)
    try:
        r = subprocess.run([nvcc, f"-arch={ARCH}", "-cubin", "-O3", "-o", str(cubin), str(cu)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"nvcc timed out after {timeout:.0f}s"}
    if r.returncode != 0:
        return {"error": f"nvcc failed on the generated CUDA source:\n{(r.stderr or r.stdout)[-3000:]}"}
    return {"cubin_bytes": cubin.stat().st_size}


def check_artifacts(dsl: str, log: Any, dump_dir: Path) -> dict[str, Any]:
    if dsl == "cutedsl":
        cubins = sorted(dump_dir.rglob(f"*.{ARCH}.cubin"))
        ptx = sorted(dump_dir.rglob(f"*.{ARCH}.ptx"))
        if not cubins:
            return {"error": f"no {ARCH} cubin was produced (files: {[p.name for p in dump_dir.rglob('*')][:10]})"}
        return {"cubins": len(cubins), "cubin_bytes": sum(p.stat().st_size for p in cubins), "ptx": len(ptx)}
    sources = [s for a in log.artifacts if a["dsl"] == "tirx" for s in _cuda_sources(a["executable"])]
    if not sources:
        return {"error": "no CUDA device module was produced by tvm.compile (is the target CUDA?)"}
    res: dict[str, Any] = {"cuda_sources": len(sources), "cuda_source_bytes": sum(len(s) for s in sources)}
    for k, src in enumerate(sources):
        r = nvcc_cubin(src, dump_dir, f"tirx_{k}")
        if "error" in r:
            return {**res, "error": r["error"]}
        res.setdefault("nvcc", []).append(r)
    return res
