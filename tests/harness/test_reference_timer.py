"""The baseline timer process: replies, clear errors, restart after a crash, no leftovers (CPU tier:
without a GPU every request comes back as the reference's CUDA error, through the same protocol;
the timing itself is checked against the in-process judge by ``test_gpu.py``)."""

import json
import os
from pathlib import Path

import pytest
import torch

from mkb_eval import problems as P
from mkb_eval.harness.judge import baseline_cached
from mkb_eval.harness.lanes import GpuLanes
from mkb_eval.harness.reference_timer import ReferenceTimer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a CPU-only host")


@pytest.fixture
def timer():
    t = ReferenceTimer(0)
    yield t
    t.close()


def test_an_error_names_the_problem_and_the_next_request_gets_a_fresh_process(timer):
    p = P.find(28)
    for _ in range(2):
        pid = timer._proc.pid
        with pytest.raises(RuntimeError, match=f"timing the reference of {p.name}: .*CUDA"):
            timer.time(p.path, "smoke", [1], [2, 3])
        assert timer._proc.pid != pid and timer._proc.poll() is None
    with pytest.raises(RuntimeError, match="no_such_problem"):
        timer.time(p.path.parent / "no_such_problem", "smoke", [1], [2])


def test_a_killed_timer_is_started_again(timer):
    p = P.find(28)
    timer._proc.kill()
    timer._proc.wait()
    old = timer._proc.pid
    with pytest.raises(RuntimeError, match="CUDA"):
        timer.time(p.path, "smoke", [1], [2])
    assert timer._proc.pid != old and timer._proc.poll() is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: torch starts no extra thread")
def test_torch_starts_its_cpu_threads_before_any_pin(timer):
    """A pool started while the thread was pinned for a request would share the timing core (on the
    H200 that made one eager baseline take 90 s): the child starts it before reading a request."""
    import time

    deadline = time.monotonic() + 60
    while len(list(Path(f"/proc/{timer._proc.pid}/task").iterdir())) < 2:
        assert time.monotonic() < deadline and timer._proc.poll() is None, "no thread pool within 60 s"
        time.sleep(0.2)


def test_close_ends_the_process(timer):
    proc = timer._proc
    timer.close()
    assert proc.poll() is not None


def test_lanes_start_and_end_timers_on_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    lanes = GpuLanes(2, reference_timers=True)
    try:
        assert [lane.timer._physical for lane in lanes.lanes] == ["3", "5"]
        procs = [lane.timer._proc for lane in lanes.lanes]
    finally:
        lanes.close()
    assert all(p.poll() is not None for p in procs)
    assert all(lane.timer is None for lane in GpuLanes(2).lanes)


@pytest.mark.parametrize("exc", [ChildProcessError("timer exited twice"), TimeoutError("no reply")])
def test_a_failed_timer_is_not_remembered_as_a_failed_compile(tmp_path, exc):
    p = P.find(28)

    def measure():
        raise exc

    with pytest.raises(type(exc)):
        baseline_cached(p, "full", {"gpu": "H200", "torch": "x"}, tmp_path, measure)
    assert not (tmp_path / "compile_baselines.jsonl").exists()
    ms, cached, err = baseline_cached(p, "full", {"gpu": "H200", "torch": "x"}, tmp_path,
                                      lambda: (_ for _ in ()).throw(RuntimeError("inductor failed")))
    assert ms is None and not cached and "inductor failed" in err
    assert json.loads((tmp_path / "compile_baselines.jsonl").read_text())["error"] == err
