"""Warm workers: same records as cold ones, replaced when taken, capped, and no process left behind."""

from pathlib import Path

from mkb_eval import problems as P
from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.verify import Limits, spawn_worker, verify

VOLATILE = ("created_at", "stages_s", "sandbox", "stdout_tail", "stderr_tail")


def _stable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in VOLATILE}


def test_warm_worker_gives_the_record_a_cold_one_gives():
    p36 = P.find(36)
    with WarmPool() as pool:
        pool.fill("cpu", 0, Limits())
        warm = verify(p36, "tirx", p36.solution_path("tirx"), tier="cpu", pool=pool).to_dict()
        assert pool.taken == 1 and pool.spawned == 2          # the taken worker was replaced at once
    cold = verify(p36, "tirx", p36.solution_path("tirx"), tier="cpu").to_dict()
    assert warm["status"] == cold["status"] == "unverified", warm["message"]
    assert warm["sandbox"]["worker"].startswith("warm") and cold["sandbox"]["worker"] == "cold"
    assert _stable(warm) == _stable(cold)


def test_pool_close_stops_idle_workers_and_removes_their_folders():
    pool = WarmPool(per_key=2, limit=3)
    pool.fill("cpu", 0, Limits())
    w = pool.take("cpu", 0, Limits())
    assert w is not None and pool.spawned == 3                 # capped: no fourth worker for nothing
    idle = [x for xs in pool._idle.values() for x in xs]
    pool.close()
    for x in idle:
        assert x.proc.poll() is not None and not Path(x.root).exists()
    w.kill()


def test_a_worker_whose_parent_leaves_without_a_job_exits_cleanly():
    w = spawn_worker("cpu", 0, Limits(), preload=True)
    w.proc.stdin.close()
    assert w.proc.wait(timeout=120) == 0
    w.kill()


def _counting_pool(monkeypatch, **kw) -> WarmPool:
    """A pool whose workers are live stand-ins: only what it starts is counted."""
    class Fake:
        class proc:
            @staticmethod
            def poll():
                return None

    pool = WarmPool(**kw)
    monkeypatch.setattr(pool, "_spawn", lambda *a: (setattr(pool, "spawned", pool.spawned + 1), Fake())[1])
    return pool


def test_allow_starts_a_worker_ahead_for_an_evaluation_run_again(monkeypatch):
    """A sweep's limit is its job count; a job crowded out of GPU memory runs again, and its retry
    should find a warm worker like every other job instead of starting one cold."""
    pool = _counting_pool(monkeypatch, per_key=1, limit=1)
    pool.fill("gpu", 0, Limits())
    assert pool.take("gpu", 0, Limits()) is not None and pool.spawned == 1     # the limit: no replacement
    pool.allow(1)
    pool.fill("gpu", 0, Limits())
    assert pool.spawned == 2 and pool.take("gpu", 0, Limits()) is not None
    assert pool.take("gpu", 0, Limits()) is None and pool.spawned == 2        # and no more than that


def test_cap_stops_starting_workers_no_evaluation_can_take(monkeypatch):
    """A sweep fed a job at a time learns how many may still come: no worker beyond that is started,
    and a cap never raises the limit."""
    pool = _counting_pool(monkeypatch, per_key=3, limit=10)
    pool.cap(2)
    pool.fill("gpu", 0, Limits())
    assert pool.spawned == 2
    pool.cap(50)
    assert pool.limit == 2
