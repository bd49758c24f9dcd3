"""The environment a result was measured in: GPU, driver, library versions, git commit."""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """The source commit: ``MKB_GIT_COMMIT`` (for copies without .git, e.g. on a GPU host), else git."""
    import os
    import re

    given = os.environ.get("MKB_GIT_COMMIT", "")
    if re.fullmatch(r"[0-9a-f]{40}", given):
        return {"commit": given, "dirty": os.environ.get("MKB_GIT_DIRTY") == "1"}
    if given:
        import warnings

        warnings.warn(f"MKB_GIT_COMMIT={given!r} is not a full 40-hex commit; asking git instead", stacklevel=2)
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {}
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": dirty}


def describe(gpu: bool = True) -> dict[str, Any]:
    """A JSON-able description of the machine; GPU fields only when CUDA is usable."""
    import torch

    from mkb_eval._version import __version__

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "tvm": _version("apache-tvm"),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "mkb_eval": __version__,
        **git_commit(),
    }
    if gpu and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm=f"sm_{props.major}{props.minor}", gpu_count=torch.cuda.device_count(),
                   cuda_runtime=torch.version.cuda, driver=_driver_version())
    return env


@functools.lru_cache(maxsize=1)
def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None
