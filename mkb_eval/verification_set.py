"""The curated verification set of a GPU model: one record per shipped kernel, matched by hashes.

``results/<gpu>/verification.jsonl`` holds one full sweep of every shipped solution, copied
verbatim from the sweep it was chosen from; ``results/<gpu>/verification.source.json`` says which
sweep (file, commit, sha256) and by what rule. The dataset builder, ``mkb results`` and the
README read this set and nothing else, so they cannot disagree. A record speaks for a shipped
kernel only while it verified that exact file (``kernel_sha256``) on that exact problem version
(``problem_hash``); :func:`match` says, record by record, which ones still do.

Benchmark history (every other sweep) is not tracked; ``scripts/benchmark_history.py`` rebuilds
it from git history.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkb_eval.problems import DSLS, Problem
from mkb_eval.records import parse_verification

VERIFICATION_FILE = "verification.jsonl"
SOURCE_FILE = "verification.source.json"
RESULTS_ROOT = Path(__file__).resolve().parents[1] / "results"
DEFAULT_GPU = "h200"
REQUIRED = ("problem_id", "dsl", "problem_hash", "kernel_sha256", "status", "tier")

Key = tuple[int, str]


def set_path(gpu: str = DEFAULT_GPU, root: Path | None = None) -> Path:
    """Where the curated set of ``gpu`` lives (``<root>/<gpu>/verification.jsonl``)."""
    return (root or RESULTS_ROOT) / gpu / VERIFICATION_FILE


def source_sha256(data: bytes) -> str:
    """sha256 of a kernel file as the verifier records it: its text read with universal newlines."""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return hashlib.sha256(text.encode()).hexdigest()


def shipped_hashes(problems: Iterable[Problem]) -> dict[Key, tuple[str, str]]:
    """(problem id, DSL) -> (problem hash, kernel sha256) of every shipped solution."""
    out: dict[Key, tuple[str, str]] = {}
    for p in problems:
        for dsl in DSLS:
            path = p.solution_path(dsl)
            if path.is_file():
                out[(p.id, dsl)] = (p.hash, source_sha256(path.read_bytes()))
    return out


@dataclass(frozen=True)
class Mismatch:
    """A record that does not speak for the shipped kernel, and why."""

    key: Key
    reason: str


@dataclass(frozen=True)
class MatchReport:
    """How a record set lines up with the shipped kernels (GPU-tier verification records only)."""

    matched: dict[Key, dict[str, Any]] = field(default_factory=dict)
    mismatched: tuple[Mismatch, ...] = ()
    missing: tuple[Key, ...] = ()
    n_shipped: int = 0

    @property
    def ok(self) -> tuple[Key, ...]:
        return tuple(k for k, r in sorted(self.matched.items()) if r.get("status") == "ok")

    @property
    def complete(self) -> bool:
        """Every shipped kernel has a matching record and no record is stale."""
        return not self.missing and not self.mismatched

    def describe(self) -> str:
        text = f"{len(self.matched)}/{self.n_shipped} shipped kernels matched ({len(self.ok)} ok)"
        if self.mismatched:
            text += f", {len(self.mismatched)} stale record(s): " + "; ".join(
                f"p{k[0]:02d} {k[1]}: {m.reason}" for m in self.mismatched[:5] for k in [m.key])
        if self.missing:
            text += f", {len(self.missing)} without a record: " + ", ".join(f"p{k[0]:02d} {k[1]}" for k in self.missing[:8])
        return text


def gpu_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The GPU-tier verification records, in order."""
    return [dict(r) for r in records if r.get("kind") == "verification" and r.get("tier") == "gpu"]


def match(records: Iterable[Mapping[str, Any]], shipped: Mapping[Key, tuple[str, str]]) -> MatchReport:
    """Record by record: does it verify the shipped kernel on the current problem version?

    A later record of the same (problem, DSL) supersedes an earlier one, as in every record store.
    """
    latest: dict[Key, dict[str, Any]] = {}
    for r in gpu_records(records):
        latest[(int(r["problem_id"]), str(r["dsl"]))] = r
    matched: dict[Key, dict[str, Any]] = {}
    bad: list[Mismatch] = []
    for key, r in sorted(latest.items()):
        want = shipped.get(key)
        if want is None:
            bad.append(Mismatch(key, "no such shipped solution"))
        elif r.get("problem_hash") != want[0]:
            bad.append(Mismatch(key, f"problem hash {str(r.get('problem_hash'))[:12]} != current {want[0][:12]}"))
        elif r.get("kernel_sha256") != want[1]:
            bad.append(Mismatch(key, f"kernel sha256 {str(r.get('kernel_sha256'))[:12]} != shipped {want[1][:12]}"))
        else:
            matched[key] = r
    missing = tuple(k for k in sorted(shipped) if k not in matched and k not in {m.key for m in bad})
    return MatchReport(matched=matched, mismatched=tuple(bad), missing=missing, n_shipped=len(shipped))


@dataclass(frozen=True)
class Candidate:
    """One record file considered for the curated set."""

    name: str
    lines: tuple[str, ...]           # the file's record lines, verbatim
    records: tuple[dict[str, Any], ...]

    @property
    def newest(self) -> str:
        return max((str(r.get("created_at") or "") for r in self.records), default="")

    @property
    def sha256(self) -> str:
        return hashlib.sha256("".join(line + "\n" for line in self.lines).encode("utf-8")).hexdigest()


def parse_candidate(name: str, text: str) -> Candidate:
    """A JSONL text as a candidate (torn or non-object lines are dropped: a candidate is only read)."""
    lines, recs = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            lines.append(line)
            recs.append(rec)
    return Candidate(name, tuple(lines), tuple(recs))


def choose(candidates: Sequence[Candidate], shipped: Mapping[Key, tuple[str, str]]) -> tuple[Candidate, MatchReport]:
    """The newest full sweep: every shipped kernel has a matching GPU record and no record is stale.

    Raises ValueError naming the best candidates when none qualifies. Newest = latest
    ``created_at`` of its records; ties go to the name that sorts last.
    """
    full = []
    near = []
    for c in candidates:
        rep = match(c.records, shipped)
        if rep.complete and len(gpu_records(c.records)) == len(shipped):
            full.append((c.newest, c.name, c, rep))
        elif rep.matched:
            near.append(f"{c.name}: {rep.describe()}")
    if not full:
        raise ValueError("no candidate is a full sweep of the shipped kernels at their current hashes; closest: "
                         + ("; ".join(sorted(near)[-3:]) or "none"))
    _, _, best, rep = max(full, key=lambda t: (t[0], t[1]))
    return best, rep


def read_set(path: Path) -> list[dict[str, Any]]:
    """The records of a curated set; ValueError on a torn line or a record without the join fields."""
    if not path.is_file():
        raise ValueError(f"{path}: no curated verification set (scripts/curate_verification.py writes it)")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg}); the curated set is written whole, never appended") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{path}:{n}: record lacks {', '.join(missing)}")
        parse_verification(rec, f"{path}:{n}")          # every field of the set's records is what it says
        out.append(rec)
    return out


def read_source(path: Path) -> dict[str, Any]:
    """The provenance file beside a set (empty when there is none)."""
    src = path.with_name(SOURCE_FILE)
    return json.loads(src.read_text(encoding="utf-8")) if src.is_file() else {}
