"""Synthetic attempt records for report tests: every arm of every problem, seeded outcomes."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from mkb_eval.metrics.inputs import ARMS, family_of, trial_name

STATUSES = ("ok", "ok", "ok", "incorrect", "compile_error", "runtime_error", "timeout")


def records(problem_ids: list[int], *, tier: str = "gpu", seed: int = 0, model: str = "synth/model") -> list[dict[str, Any]]:
    """One record per (problem, arm): GPU-tier outcomes drawn from ``STATUSES``; CPU tier: unverified."""
    rng = random.Random(seed)
    out = []
    for pid in problem_ids:
        for arm in ARMS:
            status = rng.choice(STATUSES) if tier == "gpu" else rng.choice(("unverified", "compile_error"))
            rec: dict[str, Any] = {"schema_version": 1, "kind": "attempt", "trial": trial_name(pid, 1, arm),
                                   "problem_id": pid, "arm": arm, "replicate": 1, "status": status, "model": model,
                                   "family": family_of(pid), "skipped": False, "error": None, "tier": tier}
            if status == "ok":
                sp = round(rng.uniform(0.3, 12.0), 3)
                rec.update(speedup=sp, kernel_ms=round(1.0 / sp, 6), eager_ms=1.0)
            out.append(rec)
    return out


def write_run(root: Path, recs: list[dict[str, Any]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return root
