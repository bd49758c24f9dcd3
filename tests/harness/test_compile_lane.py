"""A worker hands its GPU lane back while it compiles: the DSLs' compile entry points announce an
outermost main-thread compile, and the parent releases the lane meanwhile, holds it again before
the worker goes on, and does not count the wait against the worker's phase-1 budget."""

import threading
import time
from pathlib import Path

from mkb_eval.harness import observe
from mkb_eval.harness.jobs import CORRECTNESS_DRAWS
from mkb_eval.harness.lane_hold import Held
from mkb_eval.harness.lanes import GpuLane
from mkb_eval.harness.phase1 import judge_phase1, run_phase1
from mkb_eval.harness.protocol import Draw, Lane, Phase1Report
from mkb_eval.harness.spawn import Worker
from mkb_eval.records import VerificationRecord

from .conftest import cpu_job


def test_compiling_announces_outermost_main_thread_compiles_only(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(observe.LOG, "on_compile", events.append)
    inner = observe.compiling(lambda: "inner")
    outer = observe.compiling(lambda: inner() + "+outer")
    assert outer() == "inner+outer" and events == ["start", "end"]
    t = threading.Thread(target=outer)
    t.start()
    t.join()
    assert events == ["start", "end"]                     # another thread's compile keeps the lane

    def fails():
        raise ValueError("bad kernel")

    try:
        observe.compiling(fails)()
    except ValueError:
        pass
    assert events == ["start", "end", "start", "end"]     # the lane is asked for again after a failure


def test_tvm_compile_is_announced(monkeypatch):
    import tvm
    from tvm.script import tirx as T

    observe.install("tirx")

    @T.prim_func
    def add_one(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        for i in range(8):
            b[i] = a[i] + T.float32(1)

    events: list[str] = []
    monkeypatch.setattr(observe.LOG, "on_compile", events.append)
    tvm.compile(add_one, target="llvm")
    assert events == ["start", "end"]


def test_cute_compile_entry_point_is_wrapped():
    observe.install("cutedsl")
    from cutlass.base_dsl.compiler import CompileCallable

    assert getattr(CompileCallable._compile, "_mkb_observed", False)


_PHASE1 = Phase1Report(stage="correctness", draws=[], nodsl="raised", poisoned_bytes=0, import_s=0.0, first_call_s=0.0,
                       correctness_s=0.0)


class _FakeWorker:
    """The parent's view of a worker (its messages and gate) driven by a script in a thread."""

    def __init__(self) -> None:
        self.msgs: list = []
        self.gates: list[float] = []
        self.proc = type("P", (), {"poll": staticmethod(lambda: None)})()

    def messages(self):
        return list(self.msgs)

    def _watch(self):
        pass

    def open_gate(self, go):
        self.gates.append(time.monotonic())

    wait_for = Worker.wait_for


def test_phase1_gives_the_lane_back_while_the_worker_compiles():
    lane, w, rec = GpuLane(0), _FakeWorker(), VerificationRecord(
        status="crashed", problem_id=28, problem="p", problem_hash="h", dsl="tirx", kernel_sha256="k", tier="gpu",
        size="full", created_at="now")
    timed: dict[str, float] = {}

    def other_evaluation_times():                         # wants the GPU to itself while this one compiles
        with lane.exclusive():
            timed["start"] = time.monotonic()
            time.sleep(0.3)
            timed["end"] = time.monotonic()

    def worker_script():
        while not w.gates:
            time.sleep(0.01)
        w.msgs.append(Lane(n=1, want="release"))
        t = threading.Thread(target=other_evaluation_times)
        t.start()
        while "start" not in timed:
            time.sleep(0.01)
        w.msgs.append(Lane(n=2, want="shared"))
        while len(w.gates) < 2:
            time.sleep(0.01)
        w.msgs.append(_PHASE1)
        t.join()

    script = threading.Thread(target=worker_script)
    script.start()
    held = Held(lane)
    try:
        msg, how = run_phase1(w, held, budget=0.2, rec=rec)   # the 0.3 s lane wait is not the worker's
    finally:
        held.release()
    script.join()
    assert msg is _PHASE1 and how == "message"
    assert w.gates[1] >= timed["end"]                     # the worker went on only after the timing ended
    assert rec.stages_s["compile_lane_wait"] >= 0.2


def test_phase1_steps_aside_between_draws_for_a_waiting_timed_phase():
    """A worker between correctness draws asks to step aside: a timed phase queued on the GPU runs
    before the worker goes on, and the wait counts neither against its budget nor as compile wait."""
    lane, w, rec = GpuLane(0), _FakeWorker(), VerificationRecord(
        status="crashed", problem_id=28, problem="p", problem_hash="h", dsl="tirx", kernel_sha256="k", tier="gpu",
        size="full", created_at="now")
    timed: dict[str, float] = {}

    def other_evaluation_times():
        with lane.exclusive():
            timed["start"] = time.monotonic()
            time.sleep(0.3)
            timed["end"] = time.monotonic()

    t = threading.Thread(target=other_evaluation_times)

    def worker_script():
        while not w.gates:
            time.sleep(0.01)
        t.start()                                         # queued behind this evaluation's shared hold
        while not lane._waiting_exclusive:
            time.sleep(0.001)
        w.msgs.append(Lane(n=1, want="step_aside"))
        while len(w.gates) < 2:
            time.sleep(0.01)
        w.msgs.append(_PHASE1)

    script = threading.Thread(target=worker_script)
    script.start()
    held = Held(lane)
    try:
        msg, how = run_phase1(w, held, budget=0.2, rec=rec)
    finally:
        held.release()
    script.join()
    t.join()
    assert msg is _PHASE1 and how == "message"
    assert w.gates[1] >= timed["end"]                     # the worker went on after the timed phase
    assert held.stepped_aside >= 0.2 and rec.stages_s["compile_lane_wait"] == 0.0


def test_judging_steps_aside_between_checks_and_that_wait_is_not_judging_time():
    """The judge offers the lane before each check; the seconds it stood aside are left out of the
    judging stage."""

    class Judge:
        def check(self, seed, path, digests=None):
            calls.append("check")

    calls: list[str] = []

    def between():
        calls.append("between")
        time.sleep(0.2)
        return 0.2

    rec = VerificationRecord(status="crashed", problem_id=28, problem="p", problem_hash="h", dsl="tirx",
                               kernel_sha256="k", tier="gpu", size="full", created_at="now")
    draws = [Draw(draw=i, input_digests=[], launches=1, addresses=[i]) for i in range(CORRECTNESS_DRAWS)]
    msg = Phase1Report(stage="correctness", import_s=0.0, first_call_s=0.0, correctness_s=0.0, draws=draws, nodsl="raised",
                       poisoned_bytes=0)
    job = cpu_job(correctness_seeds=list(range(CORRECTNESS_DRAWS)), nodsl_seed=9)
    assert judge_phase1(rec, Judge(), job, msg, Path("."), between=between)
    assert calls[:2] == ["between", "check"] and calls.count("between") == CORRECTNESS_DRAWS + 1
    assert rec.stages_s["judge_correctness"] < 0.2
