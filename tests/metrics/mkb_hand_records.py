"""The hand-built attempt records behind the hand-computed tables (imported by tests and conftests).

The hand set (model "m", replicate 1, eager_ms 1.0 so speedup = 1 / kernel_ms):

    problem  family            solo_cutedsl   solo_tirx        cutedsl2tirx_skill  tirx2cutedsl_skill
    1        attention         ok 2.0         ok 1.0 (*)       ok 1.02             ok 2.5
    25       kv_cache          ok 1.0         crashed + error  ok 1.1              ok 0.9
    28       mlp_norm          incorrect      ok 0.6           ok 1.5              skipped
    36       mlp_norm          ok 4.0         ok 3.0           ok 2.8              compile_error
    52       quantization      timeout        incorrect        runtime_error       incorrect
    62       linear_attention  ok 1.2         ok 0.8           ok 0.9              (missing)

(*) an earlier "incorrect" line for p01 solo_tirx is superseded by this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
ARM_DSL = {
    "solo_cutedsl": "cutedsl",
    "solo_tirx": "tirx",
    "cutedsl2tirx_skill": "tirx",
    "tirx2cutedsl_skill": "cutedsl",
}
FAMILY = {1: "attention", 25: "kv_cache", 28: "mlp_norm", 36: "mlp_norm", 52: "quantization", 62: "linear_attention"}


def rec(pid: int, arm: str, status: str = "ok", speedup: float | None = None, *, rep: int = 1,
        error: str | None = None, model: str = "m", **extra: Any) -> dict[str, Any]:
    """One schema-1 attempt record; a passing one gets kernel_ms = 1 / speedup with eager_ms = 1."""
    d: dict[str, Any] = {
        "schema_version": 1,
        "kind": "attempt",
        "trial": f"p{pid:02d}_r{rep}_{arm}",
        "problem_id": pid,
        "family": FAMILY.get(pid, "unknown"),
        "arm": arm,
        "dsl": ARM_DSL[arm],
        "replicate": rep,
        "status": status,
        "speedup": speedup if status == "ok" else None,
        "kernel_ms": (1.0 / speedup) if status == "ok" and speedup else None,
        "eager_ms": 1.0,
        "skipped": status == "skipped",
        "error": error,
        "skill_sha256": None,
        "model": model,
    }
    d.update(extra)
    return d


def hand_records() -> list[dict[str, Any]]:
    """The table in this module's docstring, in file order (including the superseded line)."""
    return [
        rec(1, "solo_tirx", "incorrect"),  # superseded below
        rec(1, "solo_cutedsl", "ok", 2.0),
        rec(1, "solo_tirx", "ok", 1.0),
        rec(1, "cutedsl2tirx_skill", "ok", 1.02),
        rec(1, "tirx2cutedsl_skill", "ok", 2.5),
        rec(25, "solo_cutedsl", "ok", 1.0),
        rec(25, "solo_tirx", "crashed", error="judge died"),
        rec(25, "cutedsl2tirx_skill", "ok", 1.1),
        rec(25, "tirx2cutedsl_skill", "ok", 0.9),
        rec(28, "solo_cutedsl", "incorrect"),
        rec(28, "solo_tirx", "ok", 0.6),
        rec(28, "cutedsl2tirx_skill", "ok", 1.5),
        rec(28, "tirx2cutedsl_skill", "skipped"),
        rec(36, "solo_cutedsl", "ok", 4.0),
        rec(36, "solo_tirx", "ok", 3.0),
        rec(36, "cutedsl2tirx_skill", "ok", 2.8),
        rec(36, "tirx2cutedsl_skill", "compile_error"),
        rec(52, "solo_cutedsl", "timeout"),
        rec(52, "solo_tirx", "incorrect"),
        rec(52, "cutedsl2tirx_skill", "runtime_error"),
        rec(52, "tirx2cutedsl_skill", "incorrect"),
        rec(62, "solo_cutedsl", "ok", 1.2),
        rec(62, "solo_tirx", "ok", 0.8),
        rec(62, "cutedsl2tirx_skill", "ok", 0.9),
    ]
