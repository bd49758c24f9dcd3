"""GPU tier (opt-in: pytest -m gpu): shipped solutions pass, known-bad kernels are rejected with the
right status, a faulting kernel is isolated, timing is stable, and the per-evaluation overhead.

Set MKB_GPU_RECORDS=<file.jsonl> to keep every record (the numbers reported in the issue notes).
"""

import importlib.util
import os
import statistics

import pytest
import torch
import yaml

from mkb_eval import problems as P
from tests.helpers import loadable
from mkb_eval.harness.verify import verify
from mkb_eval.records import append_jsonl

from .conftest import KERNELS, compose

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# the foundation's four problems; MKB_GPU_ALL_SOLUTIONS=1 takes every shipped solution (a sweep,
# `mkb verify --all --parallel N`, is the faster way to run them all)
CORE = {1, 25, 28, 36}
SOLUTIONS = [(p, d) for p in loadable() for d in P.DSLS if p.solution_path(d).exists()
             and (p.id in CORE or os.environ.get("MKB_GPU_ALL_SOLUTIONS") == "1")]
WRONG = [(p, path, status) for p in loadable() if p.wrong_solutions()
         for path, status in ((p.path / "solutions" / "wrong" / k, v) for k, v in
                              yaml.safe_load((p.path / "solutions" / "wrong" / "expected.yaml").read_text()).items())]


def keep(rec, **extra):
    out = os.environ.get("MKB_GPU_RECORDS")
    if out:
        rec.labels.update(extra)
        append_jsonl(out, rec.to_dict())
    return rec


@pytest.mark.parametrize("problem,dsl", SOLUTIONS, ids=[f"{p.id:02d}-{d}" for p, d in SOLUTIONS])
def test_solution_passes(problem, dsl):
    rec = keep(verify(problem, dsl, problem.solution_path(dsl)), test="solution")
    assert rec.status == "ok", f"{rec.status} at {rec.stage}: {rec.message[-3000:]}"
    assert rec.timing.kernel_ms > 0 and rec.timing.eager_ms > 0 and rec.timing.host_call_ms > 0 and rec.env.gpu
    assert rec.timing.cpu_probe_ms > 0
    assert "implausible_time" not in rec.flags and not rec.timing.prewindow_excess_ms[-1] > 0
    t = rec.timing          # the recorded time is never faster than the parent's clock saw
    assert t.attested_ms > 0 and t.worker_event_ms > 0 and t.kernel_ms == max(t.attested_ms, t.worker_event_ms)
    assert t.window_calls >= 3 and t.eager_attested_ms > 0 and t.eager_ms >= t.eager_event_ms


NO_GAIN = 0.95      # a timing cheat that is not rejected must be recorded no faster than this share of its honest twin


@pytest.mark.parametrize("problem,path,status", WRONG, ids=[f"{p.id:02d}-{path.stem}" for p, path, _ in WRONG])
def test_known_bad_kernel_rejected(problem, path, status):
    """``expected.yaml`` names the status, or alternatives ``a|b``; ``ok:not_faster`` accepts a cheat that passed
    only if its recorded time is no faster than the shipped CuTe solution's (its honest twin), timed twice right
    after: the faster of the two is the honest time (one evaluation's median of 28 varied 0.128-0.153 ms)."""
    rec = keep(verify(problem, "cutedsl", path, compile_baseline=False), test="wrong", expected=status,
               kernel=path.name)
    allowed = status.split("|")
    if rec.status == "ok" and "ok:not_faster" in allowed:
        twins = [keep(verify(problem, "cutedsl", problem.solution_path("cutedsl"), compile_baseline=False),
                      test="honest_twin", kernel=path.name) for _ in range(2)]
        assert all(t.status == "ok" for t in twins), [t.message[-1500:] for t in twins]
        best = min(t.timing.kernel_ms for t in twins)
        assert rec.timing.kernel_ms >= NO_GAIN * best, \
            f"{path.name}: recorded {rec.timing.kernel_ms:.4f} ms, faster than its honest twin's {best:.4f} ms"
        return
    assert rec.status in allowed, f"{path.name}: got {rec.status} ({rec.message[-1500:]})"


def test_illegal_memory_access_is_isolated(tmp_path):
    spec = importlib.util.spec_from_file_location("bodies", KERNELS / "bodies.py")
    bodies = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bodies)
    p28 = P.find(28)
    bad = keep(verify(p28, "cutedsl", compose(bodies.ILLEGAL_ACCESS, tmp_path, "oob"), compile_baseline=False),
               test="illegal_access")
    assert bad.status in ("runtime_error", "crashed"), bad.message
    good = keep(verify(p28, "cutedsl", compose(bodies.CPU_CASES["good"][0], tmp_path, "good"),
                       compile_baseline=False), test="after_illegal_access")
    assert good.status == "ok", good.message


def test_timing_is_stable_across_evaluations():
    p28 = P.find(28)
    dsl = "tirx" if p28.solution_path("tirx").exists() else "cutedsl"
    e2e, dev = [], []
    for k in range(5):
        rec = keep(verify(p28, dsl, p28.solution_path(dsl), compile_baseline=False), test="cv", run=k)
        assert rec.status == "ok", rec.message
        e2e.append(rec.timing.kernel_ms)
        dev.append(rec.timing.kernel_device_ms)
    cv_e2e = statistics.pstdev(e2e) / statistics.mean(e2e)
    cv_dev = statistics.pstdev(dev) / statistics.mean(dev)
    print(f"\nproblem 28 {dsl}: end-to-end medians {e2e} ms (CV {cv_e2e:.4f}); device {dev} ms (CV {cv_dev:.4f})")
    assert cv_dev < 0.02      # kernel time: the quality measure
    assert cv_e2e < 0.15      # host call path included: its speed differs between processes


@pytest.mark.parametrize("dsl", P.DSLS)
def test_compile_hands_the_lane_back(dsl):
    """The solution compiles inside its first call: the worker announces it, the parent gives the lane
    back meanwhile and holds it again before the worker goes on; the verdict is unchanged."""
    from mkb_eval.harness.lanes import GpuLane

    p28 = P.find(28)
    rec = keep(verify(p28, dsl, p28.solution_path(dsl), compile_baseline=False, lane=GpuLane(0)), test="compile_lane")
    assert rec.status == "ok", rec.message
    assert "compile_lane_wait" in rec.stages_s and rec.stages_s["compile_lane_wait"] < 1.0   # nobody else waiting


def test_device_time_leaves_the_host_path_out():
    """A call that spends 1 ms on the host before a ~40 µs kernel: the end-to-end median counts the
    host millisecond, the device time (the call queued behind a GPU sleep) does not."""
    import time

    from mkb_eval.harness.timing import Clock, stream_time_ms, time_draws

    dev = torch.device("cuda:0")
    x = torch.randn(1 << 24, device=dev)

    def slow_host(a):
        t = time.perf_counter()
        while time.perf_counter() - t < 1e-3:
            pass
        return a.mul(2)

    clock = Clock()
    e2e = time_draws(slow_host, lambda s: [x], [1, 2], range(5), clock, dev).median_ms
    device = stream_time_ms(slow_host, lambda s: [x], range(5), clock, dev, host_ms=1.0)
    print(f"\nend-to-end {e2e:.4f} ms, device {device:.4f} ms")
    assert e2e > 1.0 and device < 0.5


def test_reference_timer_matches_the_judge_in_process():
    """A baseline timed in the GPU's timer process, pinned to one core as in a sweep, agrees with the
    same baseline timed here, and is as quick (problem 21 makes its inputs partly on the CPU)."""
    import time

    from mkb_eval.harness.judge import Judge
    from mkb_eval.harness.reference_timer import ReferenceTimer

    warm, timed = list(range(10)), list(range(100, 150))
    timer = ReferenceTimer(0)
    try:
        for pid in (28, 21):
            p = P.find(pid)
            judge = Judge(p, "full", "cuda:0")
            here, there, took = [], [], []
            for _ in range(2):           # interleaved, the faster of each: the host path's speed changes by 1.6x
                t0 = time.perf_counter()
                here.append(judge.time_reference(warm, timed)[0].median_ms)
                t1 = time.perf_counter()
                there.append(timer.time(p.path, "full", warm, timed, cpu=sorted(os.sched_getaffinity(0))[-1])[0])
                took.append((t1 - t0, time.perf_counter() - t1))
            assert abs(min(there) - min(here)) / min(here) < 0.15, (pid, here, there)
            assert min(b for _, b in took) < 3 * max(a for a, _ in took) + 10, (pid, took)
    finally:
        timer.close()


def test_quiet_retime_of_one_kernel_against_itself():
    """Two re-timings at once, sharing the quiet hold (as ``mkb run`` runs them): each labels problem 28's
    shipped kernel twice (an A/A), every window passes, their timed rounds do not overlap, and the two
    labels' median device times agree within 3% (end-to-end within 10%: the host path is in it)."""
    import threading

    from mkb_eval.harness.quiet import QuietHost
    from mkb_eval.harness.retime import retime

    p28 = P.find(28)
    dsl = "tirx" if p28.solution_path("tirx").exists() else "cutedsl"
    quiet, results, spans, lock = QuietHost(), [], [], threading.Lock()
    real_quiet = quiet.quiet

    def timed_quiet():                          # the quiet sections' spans, to check they did not overlap
        import contextlib
        import time

        @contextlib.contextmanager
        def span():
            with real_quiet() as waited:
                t0 = time.perf_counter()
                yield waited
                with lock:
                    spans.append((t0, time.perf_counter()))
        return span()

    quiet.quiet = timed_quiet

    def one(seed):
        res = retime(p28, {"base": (dsl, p28.solution_path(dsl)), "skill": (dsl, p28.solution_path(dsl))},
                     rounds=4, quiet=quiet, seed=seed)
        with lock:
            results.append(res)

    threads = [threading.Thread(target=one, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(results) == 2 and len(spans) == 2
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0, f"timed rounds overlapped: {spans}"
    for res in results:
        assert all(w.status == "ok" for w in res.windows), [(w.label, w.status, w.message[:200]) for w in res.windows]
        assert "quiet_wait" in res.stages_s and "busy_wait" in res.stages_s
        med = {k: {lab: statistics.median(getattr(w, k) for w in res.windows if w.label == lab) for lab in ("base", "skill")}
               for k in ("device_ms", "kernel_ms")}
        print(f"\nquiet A/A, problem 28 {dsl}: {med}, stages {res.stages_s}")
        assert abs(med["device_ms"]["skill"] / med["device_ms"]["base"] - 1) < 0.03
        assert abs(med["kernel_ms"]["skill"] / med["kernel_ms"]["base"] - 1) < 0.10
