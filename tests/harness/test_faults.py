"""Fault injection on the CPU tier: each fault is survived and the next evaluation is healthy."""

import dataclasses

import pytest

from mkb_eval.harness import faults as F
from mkb_eval.harness.pool import WarmPool

CPU_FAULTS = [f for f in F.FAULTS if f.tier == "any"]


@pytest.mark.parametrize("fault", CPU_FAULTS, ids=[f.name for f in CPU_FAULTS])
def test_fault_survived(fault, tmp_path):
    row = F.run_fault(fault, "cpu", tmp_path)
    assert row.status in fault.expect, row
    assert row.survived, row
    assert row.leftovers == 0 and row.next_ok, row


@pytest.fixture(scope="module")
def forked_pool():
    with WarmPool(fork=True) as pool:
        yield pool


@pytest.mark.parametrize("fault", CPU_FAULTS, ids=[f.name for f in CPU_FAULTS])
def test_fault_survived_by_a_forked_worker(fault, tmp_path, forked_pool):
    """A sweep's workers are forked by a server that runs as the sweep's user: the same caps hold, each
    entered by its forked child (one server for every fault's caps and the healthy evaluation's)."""
    if fault.name == "hang_cpu":          # a forked worker's imports are done: 4 s reach into solve with room
        fault = dataclasses.replace(fault, limits={**fault.limits, "timeout": 4})
    taken = forked_pool.taken
    row = F.run_fault(fault, "cpu", tmp_path, forked_pool)
    assert forked_pool.taken == taken + 2 and len(forked_pool.servers) == 1   # the fault's and the healthy one's
    assert row.status in fault.expect, row
    assert row.survived, row
    assert row.leftovers == 0 and row.next_ok, row


def test_store_faults_lose_nothing(tmp_path):
    rows = F.store_faults(tmp_path)
    torn = rows[0]
    assert torn.survived and torn.lost == 0, torn
    full = rows[1]
    if "could not mount" in full.note:
        pytest.skip(full.note)
    assert full.survived and full.lost == 0, full
