"""Sweep tables: torch.compile times filled from the verifier's cache only for a matching key."""

import json

import pytest

from mkb_eval.harness.judge import baseline_key
from mkb_eval.sweep import fill_compile_baselines


def _rec(h: str, status: str = "ok") -> dict:
    return {"problem_hash": h, "size": "full", "status": status, "flags": [],
            "env": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"},
            "timing": {"kernel_ms": 0.5, "compile_ms": None, "speedup_vs_compile": None}}


def test_compile_times_fill_only_matching_passing_records(tmp_path):
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}
    cache = tmp_path / "compile_baselines.jsonl"
    cache.write_text(json.dumps({"key": baseline_key("aa", "full", env), "ms": 2.0, "error": None}) + "\n"
                     + "not json\n")
    hit, other, failed = _rec("aa"), _rec("bb"), _rec("aa", "incorrect")
    with pytest.warns(UserWarning, match=r"compile_baselines.jsonl:2: malformed JSON"):
        assert fill_compile_baselines([hit, other, failed], cache) == 1
    assert hit["timing"]["compile_ms"] == 2.0 and hit["timing"]["speedup_vs_compile"] == 4.0
    assert "compile_baseline_from_cache" in hit["flags"]
    assert other["timing"]["compile_ms"] is None and failed["timing"]["compile_ms"] is None


def test_compile_baseline_is_measured_once_and_looked_up_after(tmp_path):
    from mkb_eval import problems as P
    from mkb_eval.harness.judge import baseline_cached

    p28, env, calls = P.find(28), {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}, []
    assert baseline_cached(p28, "full", env, tmp_path, None) == (None, False, None)   # lookup only
    assert baseline_cached(p28, "full", env, tmp_path, lambda: calls.append(1) or 2.5) == (2.5, False, None)
    with open(tmp_path / "compile_baselines.jsonl", "a") as f:
        f.write("torn{\n")
    with pytest.warns(UserWarning, match=r"compile_baselines.jsonl:2: malformed JSON .*; baseline entry skipped"):
        assert baseline_cached(p28, "full", env, tmp_path, lambda: calls.append(1) or 9.0) == (2.5, True, None)
    assert calls == [1]


def test_eager_baseline_reuse_has_its_own_file_and_failures_raise(tmp_path):
    """Reusing the eager time is an option of sweeps: kept apart from torch.compile times, and an
    eager reference that fails is the problem's fault, raised, never cached as a missing time."""
    from mkb_eval import problems as P
    from mkb_eval.harness.judge import baseline_cached

    p28, env = P.find(28), {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}
    assert baseline_cached(p28, "full", env, tmp_path, lambda: 3.0, kind="eager") == (3.0, False, None)
    assert baseline_cached(p28, "full", env, tmp_path, lambda: 7.0, kind="eager") == (3.0, True, None)
    assert baseline_cached(p28, "full", env, tmp_path, None) == (None, False, None)     # compile: own file
    with pytest.raises(RuntimeError):
        baseline_cached(P.find(36), "full", env, tmp_path, lambda: (_ for _ in ()).throw(RuntimeError("x")),
                                kind="eager")
    assert len((tmp_path / "eager_baselines.jsonl").read_text().splitlines()) == 1


def test_out_of_memory_beside_other_evaluations_is_retried_alone(monkeypatch):  # noqa: C901 - one fake per outcome
    """Evaluations in flight share the GPU's memory: a kernel (or the judge) that ran out of it there
    is evaluated again alone before a verdict is stored, and the record says so; other failures are
    stored as they are, and a harness exception is reported, not stored, without ending the sweep."""
    import torch

    from mkb_eval import problems as P
    from mkb_eval import sweep as S
    from mkb_eval.harness import verify as V

    class Rec:
        def __init__(self, job, status, message=""):
            self.flags, self.d = [], {"tier": "gpu", "problem_id": job.problem.id, "dsl": job.dsl,
                                      "status": status, "message": message}

        def to_dict(self):
            return {**self.d, "flags": self.flags}

    calls = []

    def fake_verify(problem, dsl, kernel, *, gpu, lane=None, pool=None, **kw):
        calls.append((problem.id, dsl, lane is None, gpu))
        if problem.id == 28 and lane is not None:          # crowded: out of memory
            return Rec(S.Job(problem, dsl, kernel), "runtime_error", "torch.OutOfMemoryError: CUDA out of memory")
        if problem.id == 29 and lane is not None:          # raised by make_inputs outside torch's allocator
            return Rec(S.Job(problem, dsl, kernel), "runtime_error", "torch.AcceleratorError: CUDA error: out of memory")
        if problem.id == 30 and lane is not None:          # the judge itself ran short
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 11.25 GiB")
        if problem.id == 31:
            raise KeyError("a harness bug")
        if problem.id == 36:
            return Rec(S.Job(problem, dsl, kernel), "runtime_error", "RuntimeError: boom")
        return Rec(S.Job(problem, dsl, kernel), "ok")

    monkeypatch.setattr(V, "verify", fake_verify)

    class Sink:
        recs, failures = [], []

        def record(self, r, job):
            self.recs.append(r)

        def failed(self, job, error):
            self.failures.append((job.problem.id, error))

    jobs = S.shipped_jobs([P.find(i) for i in (28, 29, 30, 31, 36, 1)], ["tirx"])
    sink = Sink()
    S.run_local(S.JobQueue(S.spread_order(jobs)), "gpu", {}, parallel=3, sink=sink)
    by = {r["problem_id"]: r for r in sink.recs}
    assert len(sink.recs) == 5 and all(by[i]["status"] == "ok" and by[i]["flags"] == ["retried_alone_after_oom"]
                                       for i in (28, 29, 30))
    assert by[36]["status"] == "runtime_error" and by[36]["flags"] == []
    assert sink.failures == [(31, "KeyError: 'a harness bug'")]
    alone = [c for c in calls if c[2]]                                 # retries run without a shared lane
    assert sorted(c[0] for c in alone) == [28, 29, 30]

    from mkb_eval.harness import pool as W

    class Pool:                                # warm workers: each retry gets one started ahead on its GPU
        allowed, filled = 0, []

        def allow(self, n):
            self.allowed += n

        def cap(self, n):
            pass

        def fill(self, tier, gpu, limits):
            self.filled.append(gpu)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

    fake = Pool()
    monkeypatch.setattr(W.WarmPool, "for_lanes", classmethod(lambda cls, *a, **k: fake))
    S.run_local(S.JobQueue(S.spread_order(jobs)), "gpu", {}, parallel=3, sink=Sink(), warm=True)
    assert fake.allowed == 3 and fake.filled == [0, 0, 0]


def test_stage_table_says_where_the_time_went():
    from mkb_eval.sweep import stage_table

    recs = [{"stages_s": {"worker_start": 2.0, "worker_timing": 1.0, "total": 10.0}},
            {"stages_s": {"worker_start": 4.0, "total": 20.0}}, {"stages_s": {"total": "torn"}}]
    t = stage_table(recs, wall_s=30.0)
    assert "| worker start and imports (warm: taking a started worker) | 2 | 3.00 | 6.0 |" in t
    assert "| timing | 1 | 1.00 | 1.0 |" in t and "| total, one evaluation | 2 | 15.00 | 30.0 |" in t
    assert "3 evaluations in 30.0 s (6.0 per minute)" in t and "eager" not in t


def test_spread_order_deals_families_in_turn_and_puts_a_problems_kernels_apart():
    from collections import Counter

    from mkb_eval import problems as P
    from mkb_eval import sweep as S

    jobs = S.shipped_jobs(P.load_all(), list(P.DSLS))
    order = S.spread_order(jobs)
    assert sorted(map(id, order)) == sorted(map(id, jobs))                 # the same jobs, each once
    n_fam = len({j.problem.family for j in jobs})
    first = Counter(j.problem.family for j in order[:2 * n_fam])
    assert max(first.values()) == 2                                        # 12 in flight: two of each family
    pos = {(j.problem.id, j.dsl): k for k, j in enumerate(order)}
    gaps = [abs(pos[(p, "tirx")] - pos[(p, "cutedsl")]) for p in {j.problem.id for j in jobs}]
    assert min(gaps) >= len(jobs) // 4
    moe = [j for j in order if j.problem.family == "moe"][:8]              # the first half: DSLs take turns
    assert Counter(j.dsl for j in moe) == Counter({"cutedsl": 4, "tirx": 4})
    assert S.spread_order([]) == []
