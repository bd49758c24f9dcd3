"""harness/cores.py: timing cores and their SMT siblings stay free of other work, and a sweep's
threads and the processes it starts run on the work cores."""

import os
import subprocess
import sys
import threading

import pytest

from mkb_eval.harness import cores


def test_parse_cpu_list():
    assert cores.parse_cpu_list("0-3,8\n") == {0, 1, 2, 3, 8}
    assert cores.parse_cpu_list("5") == {5}


def test_timing_cores_leave_their_smt_siblings_out_of_the_work_cores():
    pairs = lambda c: {c % 8, c % 8 + 8}          # noqa: E731 - 8 cores of 2 threads, siblings c and c+8
    timing, work = cores.plan(1, list(range(16)), pairs)
    assert timing == [15] and 7 not in work and 15 not in work and len(work) == 14
    timing, work = cores.plan(2, list(range(16)), pairs)
    assert timing == [15, 14] and set(work) == set(range(16)) - {6, 7, 14, 15}


def test_plan_reserves_nothing_on_small_hosts_and_never_starves_the_work():
    assert cores.plan(1, [0, 1, 2]) is None
    assert cores.plan(2, list(range(7))) is None
    everything = lambda c: {0, 1, 2, 3}           # noqa: E731 - one core with 4 hardware threads
    assert cores.plan(1, [0, 1, 2, 3], everything) == ([3], [0, 1, 2])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell timing from work")
def test_a_sweep_process_and_what_it_starts_keep_off_the_timing_core(monkeypatch):
    mask = sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(cores, "plan", lambda n: ([mask[-1]], mask[:-1]))
    seen: dict[str, set[int]] = {}
    with cores.keep_off_timing_cores(1) as work:
        assert work == mask[:-1] and cores.allowed() == mask        # the plan still sees the whole host
        t = threading.Thread(target=lambda: seen.update(thread=os.sched_getaffinity(0)))
        t.start()
        t.join()
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True).stdout
        os.sched_setaffinity(0, {mask[-1]})                         # a timed phase may still take the core
        os.sched_setaffinity(0, set(work))
    assert seen["thread"] == set(mask[:-1]) and child.strip() == str(mask[:-1])
    assert sorted(os.sched_getaffinity(0)) == mask                  # restored


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_holds_the_calling_thread_on_one_core_for_the_block_only():
    before = os.sched_getaffinity(0)
    core = max(before)
    with cores.pinned(core):
        assert os.sched_getaffinity(0) == {core}
    assert os.sched_getaffinity(0) == before
    with cores.pinned(None):
        assert os.sched_getaffinity(0) == before


def test_split_deals_whole_physical_cores_into_contiguous_shares():
    pairs = lambda c: {c % 8, c % 8 + 8}          # noqa: E731 - 8 cores of 2 threads, siblings c and c+8
    assert cores.split(2, list(range(16)), pairs) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert cores.split(3, list(range(7)), lambda c: {c}) == [[0, 1], [2, 3, 4], [5, 6]]
    assert cores.split(3, [0, 1, 8, 9], pairs) is None        # two physical cores for three shares
