"""CPU-tier artifact checks: CuTe DSL → sm_90a cubin; TIRx → CUDA source → cubin with nvcc when present.

What counts as a DSL's artifacts is its spec's ``compiled_artifacts`` (:mod:`mkb_eval.dsl`); the nvcc
step they may use is here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from mkb_eval.dsl import ARCH, get

__all__ = ["ARCH", "check_artifacts", "nvcc_cubin"]


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
    """What the CPU tier's compile of ``dsl`` produced: its spec's ``compiled_artifacts``, given ``nvcc_cubin``."""
    return get(dsl).compiled_artifacts(log, dump_dir, nvcc_cubin)
