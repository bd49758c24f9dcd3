"""Planning a run: which trials to run, rerun, reuse, or refuse as stale.

Every invocation plans all selected trials against the run folder's records:

- ``run``:   no record yet (or the trial was cut off before it finished);
- ``rerun``: the record carries an infrastructure error;
- ``stale``: the record was made under a different problem, prompt set or protocol (budget,
  sampling, tier), or, for a skill trial, its source is being run again or now holds a different
  SKILL.md than the one that was attached; refused unless ``--rerun-stale``;
- ``reuse``: otherwise. A skipped skill record (the source wrote no SKILL.md) is reused too.

A selected skill trial pulls in its source solo, since it cannot start without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mkb_eval import problems as P
from mkb_eval.agent import prompts
from mkb_eval.agent.arms import TrialKey

RUN, RERUN, STALE, REUSE = "run", "rerun", "stale", "reuse"


class PlanError(ValueError):
    """The run cannot go ahead as asked (stale trials without --rerun-stale, bad selection)."""


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Stamps:
    """What a trial's outcome depends on; recorded with it and compared on the next run."""

    problem_hash: str
    prompt_sha256: str
    protocol_sha256: str

    def to_dict(self) -> dict[str, str]:
        return {"problem_hash": self.problem_hash, "prompt_set_sha256": self.prompt_sha256,
                "protocol_sha256": self.protocol_sha256}


def protocol_sha256(budget: Mapping[str, Any], sampling: Mapping[str, Any], tier: str) -> str:
    return _sha({"budget": dict(budget), "sampling": dict(sampling), "tier": tier})


def stamps_for(problem: P.Problem, protocol: str) -> Stamps:
    return Stamps(problem_hash=problem.hash, prompt_sha256=prompts.prompt_set_sha256(), protocol_sha256=protocol)


def skill_sha256(skill_body: str | None) -> str | None:
    """sha256 of the attachment a skill trial receives (header included); None for a missing/blank skill."""
    if skill_body is None or not skill_body.strip():
        return None
    return hashlib.sha256(prompts.skill_attachment(skill_body).encode()).hexdigest()


@dataclass(frozen=True)
class Planned:
    key: TrialKey
    status: str
    reason: str = ""


def select(problem_ids: Iterable[int], arms: Iterable[str], replicates: int) -> list[TrialKey]:
    """The selected trials plus the sources their skill trials need, in a stable order."""
    if replicates < 1:
        raise PlanError(f"--replicates must be >= 1, got {replicates}")
    keys: set[TrialKey] = set()
    arms = list(arms)
    for pid in problem_ids:
        for r in range(1, replicates + 1):
            for arm in arms:
                k = TrialKey(pid, r, arm)
                keys.add(k)
                if k.source is not None:
                    keys.add(k.source)
    return sorted(keys)


def _stale_reason(rec: Mapping[str, Any], stamps: Stamps) -> str | None:
    if rec.get("problem_hash") != stamps.problem_hash:
        return "the problem changed"
    if rec.get("prompt_set_sha256") != stamps.prompt_sha256:
        return "the prompts changed"
    if rec.get("protocol_sha256") != stamps.protocol_sha256:
        return "the budget, sampling or tier changed"
    return None


def plan(keys: list[TrialKey], records: Mapping[str, Mapping[str, Any]], stamps: Mapping[int, Stamps],
         current_skill: Mapping[str, str | None]) -> list[Planned]:
    """Status of every trial; ``current_skill`` maps a solo trial id to the SKILL.md it now holds."""
    out: dict[TrialKey, Planned] = {}
    for k in sorted(keys, key=lambda k: (k.is_skill, k)):   # solos first: skill trials look at them
        rec = records.get(k.id)
        if rec is None:
            out[k] = Planned(k, RUN, "no record")
            continue
        if rec.get("error"):
            out[k] = Planned(k, RERUN, f"previous attempt failed: {str(rec['error'])[:120]}")
            continue
        why = _stale_reason(rec, stamps[k.problem_id])
        if why is None and k.is_skill:
            src = k.source
            assert src is not None
            src_plan = out.get(src)
            if src_plan is not None and src_plan.status != REUSE:
                why = f"its source {src.id} is to be {src_plan.status}"
            elif rec.get("skill_sha256") != skill_sha256(current_skill.get(src.id)):
                why = f"the SKILL.md of its source {src.id} differs from the one attached"
        out[k] = Planned(k, STALE, why) if why else Planned(k, REUSE, "finished")
    return [out[k] for k in sorted(out)]


def check_stale(planned: list[Planned], rerun_stale: bool) -> None:
    stale = [p for p in planned if p.status == STALE]
    if stale and not rerun_stale:
        first = stale[0]
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        raise PlanError(f"{len(stale)} finished trial(s) are stale: {first.key.id}: {first.reason}{more}; "
                        "rerun them with --rerun-stale or use another --run-dir")


def counts(planned: list[Planned]) -> dict[str, int]:
    c = {RUN: 0, RERUN: 0, STALE: 0, REUSE: 0}
    for p in planned:
        c[p.status] += 1
    return c
