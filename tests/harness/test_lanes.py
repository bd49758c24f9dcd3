"""The GPU lane: shared holders overlap, an exclusive holder never overlaps anyone."""

import os
import threading
import time

from mkb_eval.harness.lanes import GpuLane, GpuLanes


def test_exclusive_never_overlaps_shared():
    lane = GpuLane()
    state = {"shared": 0, "exclusive": 0, "max_shared": 0, "violations": 0}
    mu = threading.Lock()

    def reader():
        for _ in range(20):
            with lane.shared():
                with mu:
                    state["shared"] += 1
                    state["max_shared"] = max(state["max_shared"], state["shared"])
                    state["violations"] += state["exclusive"] > 0
                time.sleep(0.001)
                with mu:
                    state["shared"] -= 1

    def writer():
        for _ in range(10):
            with lane.exclusive():
                with mu:
                    state["exclusive"] += 1
                    state["violations"] += state["shared"] > 0 or state["exclusive"] > 1
                time.sleep(0.002)
                with mu:
                    state["exclusive"] -= 1

    threads = [threading.Thread(target=reader) for _ in range(4)] + [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert state["violations"] == 0
    assert state["max_shared"] > 1            # readers really ran side by side


def test_a_shared_holder_steps_aside_for_a_waiting_timed_phase():
    """Holding shared, yield_shared lets a waiting exclusive holder run first and then holds shared
    again; with no one waiting it returns at once and keeps the hold."""
    lane, order = GpuLane(), []
    lane.acquire_shared()
    assert lane.yield_shared() is False

    def timed():
        with lane.exclusive():
            order.append("timed")

    t = threading.Thread(target=timed)
    t.start()
    deadline = time.monotonic() + 10
    while not lane._waiting_exclusive and time.monotonic() < deadline:   # the timed phase is queued
        time.sleep(0.001)
    assert lane.yield_shared() is True
    order.append("shared again")
    t.join(timeout=10)
    assert order == ["timed", "shared again"]
    with lane._cond:
        assert lane._shared == 1 and not lane._exclusive       # held again, and only by us
    lane.release_shared()


def test_evaluations_go_to_the_least_busy_gpu_in_turn_among_equals():
    lanes = GpuLanes(3)
    with lanes.least_busy() as a:                 # a long evaluation keeps its GPU busy
        seen = []
        for _ in range(4):                        # short ones one after another: the idle GPUs in turn
            with lanes.least_busy() as lane:
                seen.append(lane.index)
        with lanes.least_busy() as b, lanes.least_busy() as c:
            assert {b.index, c.index} == {0, 1, 2} - {a.index}
    assert a.index == 0 and seen == [1, 2, 1, 2]
    assert lanes[1] is lanes.lanes[1] and len(lanes) == 3


def test_each_gpu_keeps_a_timing_core_that_other_work_avoids(monkeypatch):
    import torch

    from mkb_eval.harness import cores
    from mkb_eval.harness.jobs import gpu_cores

    monkeypatch.setattr(cores, "smt_siblings", lambda c: {c})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_cores(0) == (31, list(range(30)))
    assert gpu_cores(1) == (30, list(range(30)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert gpu_cores(0) == (None, None)            # too few cores: pin nothing rather than starve
