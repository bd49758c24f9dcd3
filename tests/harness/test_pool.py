"""Warm workers: same records as cold ones, replaced when taken, capped, and no process left behind."""

import threading
import time
from pathlib import Path

import pytest

from mkb_eval import problems as P
from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.verify import Limits, spawn_worker, verify
from tests.helpers import until

VOLATILE = ("created_at", "stages_s", "sandbox", "stdout_tail", "stderr_tail")


def _stable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in VOLATILE}


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "forked"])
def test_warm_worker_gives_the_record_a_cold_one_gives(fork):
    p36 = P.find(36)
    with WarmPool(fork=fork) as pool:
        pool.fill("cpu", 0, Limits())
        warm = verify(p36, "tirx", p36.solution_path("tirx"), tier="cpu", pool=pool).to_dict()
        assert pool.taken == 1 and pool.spawned == 2          # the taken worker was replaced (once it had imported)
        assert bool(pool.servers) == fork
    cold = verify(p36, "tirx", p36.solution_path("tirx"), tier="cpu").to_dict()
    assert warm["status"] == cold["status"] == "unverified", warm["message"]
    assert warm["sandbox"]["worker"].startswith("warm") and cold["sandbox"]["worker"] == "cold"
    assert ("forked" in warm["sandbox"]["worker"]) == fork
    for rec in (warm, cold):                                   # the worker's own CPU seconds, all its threads
        assert 0 < rec["stages_s"]["worker_cpu_before_job_s"] < rec["stages_s"]["worker_cpu_s"]
    if fork:     # the server imported torch and the toolchains once; its child pays for neither
        assert warm["stages_s"]["worker_cpu_s"] < cold["stages_s"]["worker_cpu_s"] / 2
    else:        # a warm worker imported them before its job; a cold one during it
        assert warm["stages_s"]["worker_cpu_before_job_s"] > 2 * cold["stages_s"]["worker_cpu_before_job_s"]
    assert _stable(warm) == _stable(cold)


def test_a_forked_cute_worker_dumps_its_artifacts_into_its_own_folder():
    """CuTe DSL fixes its dump folder when the server imports it; each worker must still find its
    own cubin (the CPU tier's proof of compilation) in its own folder, not in another's."""
    p1 = P.find(1)
    with WarmPool(fork=True) as pool:
        pool.fill("cpu", 0, Limits())
        recs = [verify(p1, "cutedsl", p1.solution_path("cutedsl"), tier="cpu", pool=pool).to_dict() for _ in range(2)]
    for rec in recs:            # the record says how many cubins the worker found in its own dump folder
        assert rec["status"] == "unverified" and "forked" in rec["sandbox"]["worker"], rec["message"]
        assert rec["artifacts"]["cubins"] >= 1
    assert recs[0]["artifacts"] == recs[1]["artifacts"]        # the second found none of the first's


def test_pool_close_stops_idle_workers_and_removes_their_folders():
    pool = WarmPool(per_key=2, limit=3)
    pool.fill("cpu", 0, Limits())
    w = pool.take("cpu", 0, Limits())
    assert w is not None and w.wait_preloaded(120)
    assert until(lambda: pool.spawned == 3)
    time.sleep(0.2)
    assert pool.spawned == 3                                    # capped: no fourth worker for nothing
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


def test_a_warm_worker_says_when_its_imports_are_done():
    w = spawn_worker("cpu", 0, Limits(), preload=True)
    assert not w.wait_preloaded(0)                  # a fresh interpreter has not imported torch yet
    assert w.wait_preloaded(120)
    w.kill()
    cold = spawn_worker("cpu", 0, Limits())
    assert cold.wait_preloaded(0)                   # nothing to wait for
    cold.kill()


def test_a_worker_taken_while_importing_is_replaced_once_its_imports_are_done(monkeypatch):
    """At a sweep's start every worker is taken at once: replacements importing beside them would
    slow down the imports those evaluations wait for."""
    imported = threading.Event()
    pool = _counting_pool(monkeypatch, per_key=1, imported=imported)
    pool.fill("gpu", 0, Limits())
    assert pool.take("gpu", 0, Limits()) is not None
    time.sleep(0.3)
    assert pool.spawned == 1
    imported.set()
    assert until(lambda: pool.spawned == 2)
    pool.close()
    pool.fill("gpu", 0, Limits())
    assert pool.spawned == 2                        # a closed pool starts nothing (a late replacement)



def _counting_pool(monkeypatch, imported: threading.Event | None = None, **kw) -> WarmPool:
    """A pool whose workers are live stand-ins (imports done unless ``imported`` is given): only
    what it starts is counted."""
    class Fake:
        class proc:
            @staticmethod
            def poll():
                return None

        @staticmethod
        def wait_preloaded(timeout):
            return imported is None or imported.wait(timeout)

        root = Path("never-created")

        @staticmethod
        def lost_by_server(timeout):
            return False

        @staticmethod
        def kill():
            pass

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
