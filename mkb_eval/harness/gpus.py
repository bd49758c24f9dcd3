"""Which physical GPU a process-local GPU index names (a leaf: lanes, the reference timer and the
per-GPU sweep all need it, and none of them may import another for it)."""

from __future__ import annotations

import os


def physical_gpu(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry for this process's GPU ``index`` (respects an inherited mask)."""
    mask = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return mask[index] if index < len(mask) else str(index)
