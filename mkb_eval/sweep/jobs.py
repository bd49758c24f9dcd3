"""What a sweep evaluates: jobs (problem, DSL, kernel), where they come from, the order they start in,
the queue its threads take them from, and which are already done in a store (the resume key)."""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mkb_eval import problems as P
from mkb_eval.records import read_jsonl


@dataclass(frozen=True)
class Job:
    problem: P.Problem
    dsl: str
    kernel: Path

    @property
    def kernel_sha256(self) -> str:
        return hashlib.sha256(self.kernel.read_text(errors="replace").encode()).hexdigest()


def shipped_jobs(problems: Iterable[P.Problem], dsls: Iterable[str]) -> list[Job]:
    dsls = list(dsls)
    return [Job(p, d, p.solution_path(d)) for p in problems for d in dsls if p.solution_path(d).exists()]


def spread_order(jobs: list[Job]) -> list[Job]:
    """The order a local sweep starts ``jobs`` in: families dealt in turn, and a problem's second
    kernel half a sweep after its first (the two DSLs take turns going first).

    Evaluations in flight share their GPU's memory, and a family's problems are alike: in id order
    the MoE layers (44-51) ran together and four of them ran a GPU short of memory. A second kernel
    started apart from the first also finds the problem's eager time already cached.
    """
    by_problem: dict[int, list[Job]] = {}
    families: dict[str, list[int]] = {}
    for j in jobs:
        if j.problem.id not in by_problem:
            families.setdefault(j.problem.family, []).append(j.problem.id)
        by_problem.setdefault(j.problem.id, []).append(j)
    turns: list[list[Job]] = []                       # one per problem, in the dealt order
    for i in range(max(map(len, families.values()), default=0)):
        for ids in families.values():
            if i < len(ids):
                mine = by_problem[ids[i]]
                k = i % len(mine)                     # within a family the DSLs take turns going first
                turns.append(mine[k:] + mine[:k])
    return [t[r] for r in range(max(map(len, turns), default=0)) for t in turns if r < len(t)]


def folder_jobs(folder: Path, problems: Iterable[P.Problem]) -> list[Job]:
    """Kernels named ``<NN>_<dsl>.py`` or ``<NN>/<dsl>.py`` in a folder."""
    by_id = {p.id: p for p in problems}
    jobs = []
    for path in sorted(folder.rglob("*.py")):
        stem, parent = path.stem, path.parent.name
        if "_" in stem and stem.split("_")[0].isdigit() and stem.split("_", 1)[1] in P.DSLS:
            pid, dsl = int(stem.split("_")[0]), stem.split("_", 1)[1]
        elif parent.isdigit() and stem in P.DSLS:
            pid, dsl = int(parent), stem
        else:
            continue
        if pid in by_id:
            jobs.append(Job(by_id[pid], dsl, path))
    return jobs


class JobQueue:
    """The jobs of a sweep, taken one at a time by its threads. ``bound`` is how many more it may
    still hand out: a warm pool starts no worker beyond what could still be taken."""

    def __init__(self, jobs: Iterable[Job]) -> None:
        self._jobs = collections.deque(jobs)
        self._lock = threading.Lock()
        self.taken = 0

    def take(self) -> Job | None:
        with self._lock:
            if not self._jobs:
                return None
            self.taken += 1
            return self._jobs.popleft()

    def bound(self) -> int:
        return len(self._jobs)


def done_keys(out: Path, tier: str, gpu: str | None) -> set[tuple[str, str, str]]:
    if not out.exists():
        return set()
    keys = set()
    for r in read_jsonl(out):
        if r.get("kind") == "verification" and r.get("tier") == tier and r.get("env", {}).get("gpu") == gpu:
            keys.add((r["problem_hash"], r["dsl"], r["kernel_sha256"]))
    return keys
