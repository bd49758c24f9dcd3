"""Compile-only (CPU tier) check of every shipped solution: CuTe → sm_90a cubin, TIRx → CUDA → cubin.

The 148 checks run as one local sweep (``mkb verify --all --tier cpu --warm --parallel 2`` does the same): a fork
server imports torch and both toolchains once and forks a fresh worker for every solution, as many
at a time as the machine has cores (two on CI). Each solution keeps its own test and verdict; only
the selected ones are checked (``-k 28-`` runs two). In cold workers, each paying ~7 s of imports
before its compile, the file took 17.9 min on the 2-core CI machine; this way it takes 3.0 min (179 s,
2026-12-01, the machine otherwise idle). The cold, exec'd path is still
checked here for one solution per DSL, by the known-bad kernels in tests/harness/test_verify_cpu.py and
by the exec'd fault variants in tests/harness/test_faults.py.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import pytest

from mkb_eval import problems as P
from mkb_eval.harness.verify import Limits, verify
from mkb_eval.sweep.jobs import Job, JobQueue
from mkb_eval.sweep.local import run_local
from tests.helpers import loadable

SOLUTIONS = [(p, d) for p in loadable() for d in P.DSLS if p.solution_path(d).exists()]
LIMITS = Limits(cpu_s=240)
IN_FLIGHT = max(1, min(4, len(os.sched_getaffinity(0))))
TEST = "test_solution_compiles_for_sm90a"


class _Outcomes:
    """The sweep's sink: each record by (problem id, DSL), or why none came back."""

    def __init__(self) -> None:
        self.records: dict[tuple[int, str], dict[str, Any]] = {}
        self.errors: dict[tuple[int, str], str] = {}
        self._lock = threading.Lock()

    def record(self, rec: dict[str, Any], job: Job) -> None:
        with self._lock:
            self.records[(job.problem.id, job.dsl)] = rec

    def failed(self, job: Job, error: str) -> None:
        with self._lock:
            self.errors[(job.problem.id, job.dsl)] = error


@pytest.fixture(scope="module")
def swept(request: pytest.FixtureRequest) -> _Outcomes:
    """Every solution this session selected, compile-checked once through a warm forked pool."""
    wanted = {(item.callspec.params["problem"].id, item.callspec.params["dsl"]) for item in request.session.items
              if getattr(item, "originalname", None) == TEST and item.module is request.module}
    jobs = [Job(p, d, p.solution_path(d)) for p, d in SOLUTIONS if (p.id, d) in wanted]
    out = _Outcomes()
    run_local(JobQueue(jobs), "cpu", {"limits": LIMITS}, parallel=IN_FLIGHT, sink=out, warm=True)
    return out


def check_compiled(rec: dict[str, Any], dsl: str) -> None:
    assert rec["status"] == "unverified", f"{rec['status']}: {(rec.get('message') or '')[-3000:]}"
    assert not rec["flags"], rec["policy_details"]
    if dsl == "cutedsl":
        assert rec["artifacts"]["cubins"] >= 1
    else:
        assert rec["artifacts"]["cuda_sources"] >= 1
        if shutil.which("nvcc"):
            assert all(r.get("cubin_bytes", 0) > 0 for r in rec["artifacts"]["nvcc"])


@pytest.mark.parametrize("problem,dsl", SOLUTIONS, ids=[f"{p.id:02d}-{d}" for p, d in SOLUTIONS])
def test_solution_compiles_for_sm90a(problem: P.Problem, dsl: str, swept: _Outcomes) -> None:
    key = (problem.id, dsl)
    assert key not in swept.errors, f"no record (harness failure): {swept.errors[key]}"
    rec = swept.records[key]
    check_compiled(rec, dsl)


@pytest.mark.parametrize("problem_id,dsl", [(28, "cutedsl"), (36, "tirx")])
def test_a_cold_exec_worker_compiles_too(problem_id: int, dsl: str) -> None:
    """The path without a pool (``mkb verify`` of one kernel): an exec'd worker pays its own imports."""
    problem = P.find(problem_id)
    check_compiled(verify(problem, dsl, problem.solution_path(dsl), tier="cpu", limits=LIMITS).to_dict(), dsl)
