"""``mkb dataset check``'s record check: do a build's measurements belong to the kernels and problems it ships?

A build is only as true as its join: a ``solutions`` row claims that its record verified exactly
its kernel on exactly its problem version, and that these are the files of the checkout the
dataset describes. Each claim is checked here, row by row: the row's hashes against the
checkout's files, the embedded record's hashes against the row, and ``baselines`` rows against
the current problem hashes. Any disagreement is a finding, so a dataset built from a stale
verification set, or from an older checkout, does not pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval import verification_set as V
from mkb_eval.problems import Problem


@dataclass(frozen=True)
class RecordCheck:
    """What the check found: counts for the summary line, and one finding per disagreement."""

    solutions: int
    verified: int
    baselines: int
    findings: tuple[str, ...]

    def summary(self) -> str:
        head = (f"solutions {self.verified}/{self.solutions} verified, baselines {self.baselines} rows: records "
                "match the checkout's kernels and problems")
        return head if not self.findings else f"{len(self.findings)} record finding(s); " + head.replace(
            "records match", "records do not all match")


def _rows(files: Iterable[Path], columns: list[str]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [r for f in files for r in pq.read_table(f, columns=columns).to_pylist()]


def check_records(configs: Mapping[str, Mapping[str, list[Path]]], problems: Iterable[Problem]) -> RecordCheck:
    """Check the ``solutions`` and ``baselines`` configs of a checked folder against ``problems``."""
    probs = {p.id: p for p in problems}
    shipped = V.shipped_hashes(probs.values())
    findings: list[str] = []
    sol = _rows([f for fs in configs.get("solutions", {}).values() for f in fs],
                ["problem_id", "dsl", "kernel_sha256", "problem_hash", "verified", "status", "record_json", "note"])
    for r in sol:
        where = f"solutions p{r['problem_id']:02d} {r['dsl']}"
        want = shipped.get((r["problem_id"], r["dsl"]))
        if want is None:
            findings.append(f"{where}: no such shipped solution in the checkout")
            continue
        if (r["problem_hash"], r["kernel_sha256"]) != want:
            findings.append(f"{where}: built from kernel {r['kernel_sha256'][:12]} / problem {r['problem_hash'][:12]}, "
                            f"the checkout ships {want[1][:12]} / {want[0][:12]}: rebuild")
        if r["record_json"] is None:
            if r["note"] and "other kernel or problem versions" in r["note"]:
                findings.append(f"{where}: its verification record is stale ({r['note']}): re-verify and re-curate")
            continue
        rec = json.loads(r["record_json"])
        if (rec.get("problem_hash"), rec.get("kernel_sha256")) != (r["problem_hash"], r["kernel_sha256"]):
            findings.append(f"{where}: the joined record verified kernel {str(rec.get('kernel_sha256'))[:12]} on "
                            f"problem {str(rec.get('problem_hash'))[:12]}, not the row's")
        if r["verified"] != (rec.get("status") == "ok"):
            findings.append(f"{where}: verified={r['verified']} but the record's status is {rec.get('status')!r}")
    base = _rows([f for fs in configs.get("baselines", {}).values() for f in fs], ["problem_id", "problem_hash"])
    for r in base:
        p = probs.get(r["problem_id"])
        if p is None or p.hash != r["problem_hash"]:
            findings.append(f"baselines p{r['problem_id']:02d}: measured for problem {r['problem_hash'][:12]}, the "
                            f"checkout's is {p.hash[:12] if p else 'absent'}")
    built_ids, have = {r["problem_id"] for r in sol}, {(r["problem_id"], r["dsl"]) for r in sol}
    for pid, dsl in sorted(k for k in shipped if k[0] in built_ids and k not in have):
        findings.append(f"solutions p{pid:02d} {dsl}: the checkout ships it but the build has no row")
    return RecordCheck(solutions=len(sol), verified=sum(bool(r["verified"]) for r in sol), baselines=len(base),
                       findings=tuple(findings))
