"""Compile-only (CPU tier) check of every shipped solution: CuTe → sm_90a cubin, TIRx → CUDA → cubin."""

import shutil

import pytest

from mkb_eval import problems as P
from tests.helpers import loadable
from mkb_eval.harness.verify import Limits, verify

SOLUTIONS = [(p, d) for p in loadable() for d in P.DSLS if p.solution_path(d).exists()]


@pytest.mark.parametrize("problem,dsl", SOLUTIONS, ids=[f"{p.id:02d}-{d}" for p, d in SOLUTIONS])
def test_solution_compiles_for_sm90a(problem, dsl):
    rec = verify(problem, dsl, problem.solution_path(dsl), tier="cpu", limits=Limits(cpu_s=240))
    assert rec.status == "unverified", f"{rec.status}: {rec.message[-3000:]}"
    assert not rec.flags, rec.policy_details
    if dsl == "cutedsl":
        assert rec.artifacts["cubins"] >= 1
    else:
        assert rec.artifacts["cuda_sources"] >= 1
        if shutil.which("nvcc"):
            assert all(r.get("cubin_bytes", 0) > 0 for r in rec.artifacts["nvcc"])
