"""A small run folder written through the agent's real RunStore (so the layout is the store's own).

Problem 28, two replicates, all four arms each; problem 36, one solo with no skill trial. The
skills and outcomes are chosen so that every verdict and a leak-flagged skill occur:

    p28 r1: cutedsl2tirx helped (skill 8x vs base 2x), tirx2cutedsl harmed (incorrect vs 7x)
    p28 r2: cutedsl2tirx harmed (runtime_error vs 3x; its skill contains code),
            tirx2cutedsl helped (1.5x vs an incorrect base)
    p36 r1: solo_tirx only, so its skill is unresolved
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from mkb_eval.agent.store import RunStore
from tests.helpers import attempt

MODEL = "test-org/test-model"
SKILLS = {
    "p28_r1_solo_cutedsl": "- One CTA per row with the whole 4096-wide row in registers reached 0.16 ms (7x eager).\n"
                           "- Vectorized 16-byte loads halved the time against scalar loads (measured).\n",
    "p28_r1_solo_tirx": "- The residual add and the normalization fused into one pass: 2x over eager.\n",
    "p28_r2_solo_cutedsl": "- This kernel worked:\n\n```python\n@cute.kernel\ndef k(x):\n    pass\n```\n",
    "p28_r2_solo_tirx": "- Reducing in fp32 across a warp then across warps kept the error within tolerance.\n",
    "p36_r1_solo_tirx": "- With a hidden size of 128 one warp per row leaves most lanes idle; pack 4 rows per warp.\n",
}


def _rec(trial: str, status: str, speedup: float | None = None, **extra: Any) -> dict[str, Any]:
    return attempt(trial, status, speedup, model=MODEL, **extra)


OUTCOMES = {
    "p28_r1_solo_cutedsl": ("ok", 7.0),
    "p28_r1_solo_tirx": ("ok", 2.0),
    "p28_r1_cutedsl2tirx_skill": ("ok", 8.0),
    "p28_r1_tirx2cutedsl_skill": ("incorrect", None),
    "p28_r2_solo_cutedsl": ("incorrect", None),
    "p28_r2_solo_tirx": ("ok", 3.0),
    "p28_r2_cutedsl2tirx_skill": ("runtime_error", None),
    "p28_r2_tirx2cutedsl_skill": ("ok", 1.5),
    "p36_r1_solo_tirx": ("ok", 2.0),
}


def write_run(root: Path) -> Path:
    """Write the run folder at ``root`` (one superseded record included) and return it."""
    with RunStore(root) as store:
        store.append_record(_rec("p28_r1_solo_tirx", "incorrect"))          # superseded below
        for trial, (status, speedup) in OUTCOMES.items():
            art = store.begin_trial(trial)
            kernel = f"# final kernel of {trial}\ndef solve(*inputs):\n    return inputs[0]\n"
            skill = SKILLS.get(trial)
            if skill is not None:
                art.skill(skill)
            extra = {"final_kernel_sha256": hashlib.sha256(kernel.encode()).hexdigest(),
                     "skill_md_sha256": hashlib.sha256(skill.encode()).hexdigest() if skill else None}
            rec = _rec(trial, status, speedup, **extra)
            art.final(kernel, rec)
            store.append_record(rec)
    return root
