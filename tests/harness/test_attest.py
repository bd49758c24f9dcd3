"""Parent-attested timing (CPU): the job carries no timing seeds, the window arithmetic and the timing
verdict with fake clocks, the commitment digest, kernel-stamped replies, the whole window protocol
between a worker thread and the parent's driver, the harness guard, the new status, and re-timing
on the CPU tier."""

import dataclasses
import itertools
import json
import os
import random
import statistics
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from mkb_eval import problems as P
from mkb_eval.harness import attest, protocol, timed, worker, worker_phase2
from mkb_eval.harness import jobs as J
from mkb_eval.harness.attest import WindowCalibration, WindowStamps
from mkb_eval.harness.gate import GateSocket
from mkb_eval.harness.judge import Judge
from mkb_eval.harness.retime import retime, round_orders
from mkb_eval.harness import tensors

from .conftest import cpu_job

MS = 1_000_000   # ns


def test_the_job_at_start_has_no_timing_seeds_nor_rechecks(tmp_path):
    p = P.find(28)
    job = J.make_job(p, "cutedsl", tmp_path, "gpu", "full", "cuda:0")
    wire = json.loads(job.encode())                                  # what the worker reads
    assert not {"warmup_seeds", "timing_seeds", "recheck"} & set(wire)
    assert len(job.correctness_seeds) == J.CORRECTNESS_DRAWS and job.nodsl_seed is not None
    assert not any(isinstance(v, list) and len(v) >= J.TIMING_DRAWS for v in wire.values())
    again = J.make_job(p, "cutedsl", tmp_path, "gpu", "full", "cuda:0", mode="retime")
    assert len(again.correctness_seeds) == 1 and again.nodsl_seed is None and again.mode == "retime"


def test_window_calls_keep_every_call_out_of_l2_within_the_memory_budget():
    l2 = 50 << 20
    p28 = 3 * 14509 * 4096 * 2                                    # x, residual in; y out (bf16)
    assert attest.window_calls(2 * p28 // 3, p28 // 3, l2) == attest.WINDOW_CALLS
    small = attest.window_calls(1 << 20, 1 << 20, l2)              # 2 MiB a set: 75 sets to span 3 x L2
    assert small == 75 and small * (2 << 20) >= attest.COLD_FACTOR * l2
    assert attest.window_calls(1, 1, l2) == attest.WINDOW_MAX_CALLS
    assert attest.window_calls(3 << 30, 1 << 30, l2) == attest.WINDOW_MIN_CALLS   # 4 GiB sets: never below 3
    assert attest.window_calls(1 << 30, 0, l2) == 8                              # the 8 GiB budget


def test_the_digest_is_exact_keyed_and_sees_every_byte():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 333, generator=g).to(torch.bfloat16)
    key = 12345
    d = attest.digest(x, key)
    assert d == attest.digest(x.clone(), key)
    assert d == attest.digest(x.t().contiguous().t(), key)            # strides do not matter, bytes do
    for pos in (0, 1, 999 * 333 + 332, 12345):                         # head, tail, middle
        y = x.clone()
        y.view(-1)[pos] = y.view(-1)[pos] + 1
        assert attest.digest(y, key) != d, pos
    swapped = x.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert attest.digest(swapped, key)[0][1] != d[0][1]               # the keyed sum sees positions
    assert attest.digest(x, key + 1)[0][0] == d[0][0] and attest.digest(x, key + 1)[0][1] != d[0][1]
    odd = torch.arange(7, dtype=torch.uint8)                           # not a multiple of 4 bytes
    assert attest.digest(odd, key) != attest.digest(odd + 1, key)
    wrap = torch.full((4096,), 2**31 - 1, dtype=torch.int32)           # int32 sums wrap, exactly
    assert attest.digest(wrap, key) == attest.digest(wrap.clone(), key)
    assert attest.digest([x, odd], key) == d + attest.digest(odd, key)
    assert attest.digest(torch.empty(0), key) == [[0, 0]]
    batch = attest.combine([[attest.row_sums(x)], [attest.row_sums(swapped)]], key)
    assert batch == [d, attest.digest(swapped, key)]
    calls = [[x, odd], [swapped], [odd + 1, x, torch.empty(0)]]         # shapes mixed: one batch per shape
    mixed = attest.combine([[attest.row_sums(t) for t in c] for c in calls], key)
    assert mixed == [[attest.digest(t, key)[0] for t in c] for c in calls]


def _cal(**kw):
    base = dict(calls=10, make_ms=2.0, make_host_ms=0.5, commit_ms=0.05, window_ms=11.0, attested_ms=1.05)
    return WindowCalibration(**{**base, **kw})


def _stamps(pre_ms, window_ms, calls=10):
    return WindowStamps(calls=calls, sent_ns=1000 * MS, ready_ns=int((1000 + pre_ms) * MS),
                        done_ns=int((1000 + pre_ms + window_ms) * MS))


def test_the_attested_time_and_the_precompute_excess_with_a_fake_clock():
    s = _stamps(pre_ms=2.2, window_ms=1.5)
    assert s.prewindow_ms == pytest.approx(2.2) and s.window_ms == pytest.approx(1.5)
    assert attest.attested_ms(s, _cal()) == pytest.approx((1.5 - 10 * 0.05) / 10)
    assert attest.attested_ms(_stamps(2, 0.1), _cal()) == 0.0                   # never negative
    allowance = attest.PRECOMPUTE_TAU * 2.0 + attest.PRECOMPUTE_HOST_TAU * 0.5 + attest.PRECOMPUTE_SLACK_MS
    assert attest.precompute_excess_ms(s, _cal()) == pytest.approx(2.2 - 2.0 - allowance)
    assert attest.precompute_excess_ms(_stamps(2.0 + allowance + 1.1, 1.5), _cal()) == pytest.approx(1.1)


def test_the_calls_done_stamp_can_raise_the_attested_time_never_lower_it():
    """A trusted commitment cost that reads more than the worker's own (taken in another process) no
    longer takes the calls' time out with it: the span until the worker's "calls done" stands. Sent
    early it changes nothing; sent late it only makes the kernel slower; out of order it is ignored."""
    def at(called_ms, commit_ms=0.14):
        s = _stamps(pre_ms=2.0, window_ms=1.5)
        s.called_ns = s.ready_ns + int(called_ms * MS) if called_ms is not None else 0
        return attest.attested_ms(s, _cal(commit_ms=commit_ms))

    assert at(None) == pytest.approx(0.01) and at(0.9) == pytest.approx(0.09)   # over-measured cost: 0.01 -> 0.09
    assert at(0.05) == pytest.approx(0.01)                                        # early: the subtraction stands
    assert at(0.9, commit_ms=0.02) == pytest.approx((1.5 - 0.2) / 10)              # the larger of the two
    assert at(1.5) == pytest.approx(0.15) and at(2.0) == pytest.approx(0.01)       # at the end; after the end: ignored


def test_a_forged_report_is_re_timed_then_rejected():
    v = attest.decide(0.01, [0.1], [-1.0], sol_ms=0.05)                     # 10x faster than the parent saw
    assert v.status == "retime"
    v = attest.decide(0.01, [0.1, 0.11], [-1.0, -1.0], sol_ms=0.05)
    assert v.status == "policy_violation" and v.flags == ["timing_forgery"] and "forged" in v.message
    # a slow first window (a glitch) does not reject an honest report: the re-time decides, and counts
    v = attest.decide(0.1, [0.25, 0.102], [-1.0, -1.0], sol_ms=0.05)
    assert v.status == "ok" and v.kernel_ms == pytest.approx(0.102)
    # a report a little faster than the window is not a forgery; the window's time is recorded
    v = attest.decide(0.08, [0.1], [-1.0], sol_ms=0.05)
    assert v.status == "ok" and v.kernel_ms == pytest.approx(0.1) and v.attested_ms == pytest.approx(0.1)


def test_the_recorded_time_is_never_faster_than_the_parent_saw():
    rng = random.Random(7)
    for _ in range(2000):
        a = [rng.uniform(0.01, 2) for _ in range(rng.choice((1, 2)))]
        event = rng.uniform(0.001, 2)
        v = attest.decide(event, a, [rng.uniform(-2, 0.5) for _ in a], sol_ms=rng.choice((None, 0.3)),
                          device_ms=rng.choice((None, rng.uniform(0.001, 2))))
        assert v.kernel_ms >= a[-1] and v.kernel_ms >= event
        if v.status == "ok":
            assert not (event < attest.FORGERY_FACTOR * min(a))


def test_a_time_below_the_sol_bound_is_re_timed_and_rejected_if_it_stands():
    sol = 0.0743
    v = attest.decide(0.05, [0.05], [-1.0], sol_ms=sol)
    assert v.status == "retime"
    v = attest.decide(0.05, [0.05, 0.051], [-1.0, -1.0], sol_ms=sol)
    assert v.status == "implausible_time" and "speed-of-light" in v.message
    v = attest.decide(0.11, [0.05, 0.11], [-1.0, -1.0], sol_ms=sol)          # the re-time does not stand
    assert v.status == "ok" and v.kernel_ms == pytest.approx(0.11)
    assert attest.decide(0.11, [0.11], [-1.0], sol_ms=sol, device_ms=0.04).status == "retime"
    v = attest.decide(0.11, [0.11, 0.11], [-1.0, -1.0], sol_ms=sol, device_ms=0.04)
    assert v.status == "implausible_time" and "device time" in v.message
    assert attest.decide(0.068, [0.068], [-1.0], sol_ms=sol).status == "ok"   # inside the SOL margin
    assert attest.decide(0.05, [0.05], [-1.0], sol_ms=None).status == "ok"    # smoke size: no SOL


def test_work_hidden_before_the_window_is_re_timed_then_rejected():
    assert attest.decide(0.1, [0.1], [1.5], sol_ms=0.05).status == "retime"
    v = attest.decide(0.1, [0.1, 0.1], [1.5, 0.9], sol_ms=0.05)
    assert v.status == "policy_violation" and v.flags == ["timing_precompute"]
    assert attest.decide(0.1, [0.1, 0.1], [1.5, -0.2], sol_ms=0.05).status == "ok"


def test_replies_carry_the_kernels_stamp_of_their_send_not_of_their_read():
    gate = GateSocket()
    try:
        fd = gate.child_fd()
        t = time.clock_gettime_ns(time.CLOCK_REALTIME)
        os.write(fd, b"R")
        time.sleep(0.2)                                       # the parent is busy: the stamp does not move
        data, stamp = gate.recv(5)
        assert data == b"R" and 0 <= stamp - t < 50 * MS
        with pytest.raises(TimeoutError):
            gate.recv(0.05)
        gate.send(b"go")
        assert os.read(fd, 2) == b"go"
        gate.close_child()
        assert gate.recv(1)[0] == b""                         # the worker's end closed: EOF
    finally:
        gate.close()


class _FakeWorker:
    """The parent's view of a worker whose phase 2 runs in a thread of this process (CPU tensors)."""

    def __init__(self, out_dir, solve, make):
        self.gate = GateSocket()
        self.proc = SimpleNamespace(poll=lambda: None)
        self.msgs = []
        launches = itertools.count()
        log = SimpleNamespace(total=lambda: next(launches))       # every call "launched" a kernel
        clock = SimpleNamespace(synchronize=lambda: None)

        def fake_time_draws(fn, mk, warm, timing, clk, dev, keep=None, on_draw=None):
            times = []
            for i, s in enumerate(timing):
                t = time.perf_counter()
                out = fn(*mk(s))
                times.append(1e3 * (time.perf_counter() - t))
                keep(i, out)
            return SimpleNamespace(times_ms=times)

        tools = worker_phase2.Tools(fake_time_draws, lambda *a: 0.01, lambda: 1.0, attest.worker_window,
                                    attest.warm_allocator, tensors.save, tensors.walk)
        job = cpu_job(gate_fd=self.gate.child_fd(), out_dir=str(out_dir))

        def progress(stage, **kw):                               # through the wire, as the parent reads it
            wire = json.dumps(protocol.encode(protocol.progress(stage, time.time(), 0.0, **kw)))
            self.msgs.append(protocol.decode(json.loads(wire)))

        def run():
            op = worker_phase2.read_op(job.gate_fd)
            self.result = worker_phase2.serve_windows(job, op, solve, make, clock, "cpu", log, progress,
                                                      lambda where: None, tools)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def _watch(self):
        pass

    def wait_for(self, kinds, timeout, unless=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.msgs:
                if getattr(m, "stage", None) in kinds and not (unless and unless(m)):
                    return m, "message"
            time.sleep(0.01)
        return None, "timeout"


def test_the_window_protocol_end_to_end_with_the_judge(tmp_path):
    """A worker thread serves events, prep, an attested window and the chosen saves; the parent's driver
    stamps it; the judge checks the saved outputs against the reference and the commitment."""
    p = P.find(28)
    judge = Judge(p, "smoke", "cpu")
    mod = P.load_module(p)

    def solve(h, r, w):
        time.sleep(0.005)                                   # 5 ms a call, as the parent should see
        return mod.reference(h, r, w)

    fw = _FakeWorker(tmp_path, solve, judge.inputs)
    try:
        fw.gate.send_op(protocol.EventsOp([1], [2, 3, 4], device=True))
        ev, _ = fw.wait_for(("events",), 30)
        assert isinstance(ev, protocol.EventsReport) and len(ev.times_ms) == 3 and ev.device_ms == 0.01
        st = timed.run_window(fw, 5, "win0", 30)
        assert st.calls == 5 and len(st.digests) == 5 and len(st.saved) == attest.WINDOW_RECHECKS
        assert st.sent_ns < st.ready_ns < st.done_ns
        assert st.window_ms >= 5 * 5.0                         # the parent's clock saw every call's sleep
        cal = judge.time_window(st.seeds, st.key)
        assert cal.calls == 5 and cal.make_ms > 0 and cal.commit_ms >= 0 and cal.attested_ms >= 0
        assert attest.attested_ms(st, cal) >= 4.0           # the commitment's cost subtracted, the sleeps remain
        assert timed.judge_windows(judge, [st], tmp_path) is None
        assert {"inputs", "reference", "read_output", "compare", "digest"} <= set(judge.spent)   # where judging goes
        # an output that differs from what was committed at the window's end is incorrect
        i = st.saved[0]
        forged = WindowStamps(**{**st.__dict__, "digests": [[[1, 2]]] * st.calls})
        msg = timed.judge_windows(judge, [forged], tmp_path)
        assert msg and "changed after the timed window" in msg and f"call {i + 1} of 5" in msg
        timed.finish(fw, timeout=0.1)
        fw.thread.join(10)
        assert fw.result["status"] == "timed"
    finally:
        fw.gate.close()


def test_the_guard_sees_a_replaced_send_and_a_swapped_code_object():
    from mkb_eval.harness.channel import Channel

    g = worker._Guard()
    g.capture()
    assert g.replaced() == []
    orig = Channel.send
    try:
        Channel.send = lambda self, **kw: None
        assert "Channel.send" in g.replaced()
    finally:
        Channel.send = orig
    code = attest.combine.__code__
    try:
        attest.combine.__code__ = (lambda parts, key: []).__code__
        assert any("combine" in x for x in g.replaced())
    finally:
        attest.combine.__code__ = code
    assert g.replaced() == []


def test_implausible_time_is_a_closed_status_and_a_failure():
    from mkb_eval.metrics.inputs import STATUSES as METRIC_STATUSES, AttemptOutcome
    from mkb_eval.metrics.ladder import score_attempts
    from mkb_eval.records import STATUSES

    assert "implausible_time" in STATUSES and "implausible_time" in METRIC_STATUSES
    o = AttemptOutcome(problem_id=28, arm="solo_tirx", status="implausible_time", speedup=80.0)
    assert not o.passed and o.speedup is None
    assert score_attempts([o])["n_passed"] == 0


def test_retime_on_the_cpu_tier_returns_unverified_windows(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU tier only")
    p = P.find(28)
    kernels = {"base": ("cutedsl", p.solution_path("cutedsl")), "skill": ("tirx", p.solution_path("tirx"))}
    res = retime(p, kernels, rounds=3)
    assert res.tier == "cpu" and res.labels == ["base", "skill"] and res.problem_id == 28
    assert len(res.windows) == 6 and {w.status for w in res.windows} == {"unverified"}
    assert all(w.kernel_ms is None and w.attested_ms is None and w.worker_event_ms is None for w in res.windows)
    assert [[w.label for w in res.windows if w.round == r] for r in range(3)] == [["base", "skill"],
                                                                                   ["skill", "base"],
                                                                                   ["base", "skill"]]
    with pytest.raises(ValueError, match="unknown DSL"):
        retime(p, {"x": ("cuda", p.solution_path("tirx"))})


def test_round_orders_alternate_and_balance_positions():
    o = round_orders(["a", "b", "c", "d"], 6, seed=3)
    assert o == round_orders(["a", "b", "c", "d"], 6, seed=3)
    for r in range(1, 6, 2):
        assert o[r] == o[r - 1][::-1]
    assert all(sorted(x) == ["a", "b", "c", "d"] for x in o)
    first = statistics.mean(o[r].index("a") for r in range(6))
    assert first == pytest.approx(1.5)                       # a pair of rounds puts a label early and late


@pytest.mark.parametrize("forge", [1.0, 0.1])
def test_the_attested_phase_records_what_the_parent_saw_and_rejects_a_forged_report(tmp_path, monkeypatch, forge):
    """The parent's whole timed phase against a worker thread: the worker's event report scaled by
    ``forge`` on its way (a patched channel); honest, the record is ok with kernel_ms = max(event,
    attested); forged 10x, the re-time confirms it and the verdict is policy_violation."""
    p = P.find(28)
    judge = Judge(p, "smoke", "cpu")
    mod = P.load_module(p)

    def solve(h, r, w):
        time.sleep(0.01)             # long beside the commitment's cost, even as a loaded machine measures it
        return mod.reference(h, r, w)

    fw = _FakeWorker(tmp_path, solve, judge.inputs)
    fw.msgs = type("Forging", (list,), {"append": lambda self, m: list.append(self, dataclasses.replace(
        m, times_ms=[t * forge for t in m.times_ms]) if isinstance(m, protocol.EventsReport) else m)})()
    ref = timed.Reference(p, "smoke", judge)
    monkeypatch.setattr(timed.Reference, "event_ms", lambda self, warmup, timing, compiled=False: 0.5)
    try:
        fw.gate.send_op(protocol.EventsOp([1], [2, 3, 4], device=True))
        ev, _ = fw.wait_for(("events",), 30)
        stages = {}
        res = timed.attested_phase(fw, ref, ev, 4, 30, lambda measure: measure(), stages, sol_ms=None,
                                   n_warmup=1, n_timed=3, warmup=[1], timing=[2, 3, 4])
        t = res.timing
        assert t.eager_event_ms == 0.5 and t.eager_ms == max(0.5, t.eager_attested_ms)
        assert t.window_calls == 4 and t.attested_ms >= 8.0 and len(t.prewindow_excess_ms) == len(res.windows)
        assert len(t.window_span_ms) == len(t.window_commit_ms) == len(res.windows) and t.window_span_ms[0] > 0
        assert t.kernel_ms == max(t.worker_event_ms, t.attested_ms) and {"attested_window", "eager_baseline"} <= set(stages)
        if forge == 1.0:
            assert res.verdict.status == "ok" and len(res.windows) == 1
        else:
            assert res.verdict.status == "policy_violation" and res.verdict.flags == ["timing_forgery"]
            assert len(res.windows) == 2 and "retime" in stages          # re-timed before it rejected
            assert t.kernel_ms == t.attested_ms                           # the forged median was not recorded
        assert timed.judge_windows(judge, res.windows, tmp_path) is None
        timed.finish(fw, timeout=0.1)
    finally:
        fw.gate.close()


def test_a_sweeps_first_windows_share_the_problems_calibration_and_a_re_time_calibrates_afresh(monkeypatch):
    """With ``share`` a first window takes the calibration an earlier evaluation of the same problem, size,
    GPU and K made (the timer is not asked again); not one that would fill the window, not across K or
    problems, never for a re-time; without ``share`` every evaluation calibrates; the store is bounded."""
    monkeypatch.setattr(timed, "_SHARED", {})
    asked = []

    class Timer:
        def window(self, path, size, seeds, key, cpu):
            asked.append(seeds[0])
            return WindowCalibration(calls=len(seeds), make_ms=1.0, make_host_ms=0.5, commit_ms=0.01,
                                     window_ms=5.0, attested_ms=0.3)

    judge = SimpleNamespace(device="cuda:0")

    def stamps(seed, calls=4, span_ms=20):
        return WindowStamps(calls=calls, sent_ns=0, ready_ns=MS, done_ns=(1 + span_ms) * MS, seeds=[seed] * calls)

    p, q = P.find(28), P.find(1)
    first = timed.Reference(p, "full", judge, Timer(), share=True)
    assert first.window(stamps(1)) and not first.shared and asked == [1]
    second = timed.Reference(p, "full", judge, Timer(), share=True)
    assert second.window(stamps(2)).make_ms == 1.0 and second.shared and asked == [1]
    second.window(stamps(3))                                # a re-time of the same evaluation
    assert asked == [1, 3] and not second.shared
    for ref, st in ((timed.Reference(p, "full", judge, Timer(), share=True), stamps(4, calls=8)),
                    (timed.Reference(q, "full", judge, Timer(), share=True), stamps(5)),
                    (timed.Reference(p, "full", judge, Timer()), stamps(6)),
                    (timed.Reference(p, "full", judge, Timer(), share=True), stamps(7, span_ms=0.01))):
        ref.window(st)
    assert asked == [1, 3, 4, 5, 6, 7]
    monkeypatch.setattr(timed, "SHARED_CALIBRATIONS", 2)
    timed.Reference(P.find(2), "full", judge, Timer(), share=True).window(stamps(8))
    assert len(timed._SHARED) == 2



def test_the_trusted_commitment_is_that_of_dense_outputs_when_the_reference_returns_a_view(monkeypatch):
    """A reference that returns a transposed view pays a copy in its own commitment; the cost subtracted
    from a worker's window is that of contiguous outputs of the same shapes (problem 66's honest kernel
    fell under its SOL bound by the copy). On a fake clock a commitment costs 1 ms, and 20 ms more for
    each non-contiguous tensor."""
    seen, real, now = [], attest.commitments, [0.0]

    def commit(outs, key):
        flags = [t.is_contiguous() for o in outs for t in tensors.walk(o)]
        seen.append(all(flags))
        now[0] += 0.001 + 0.02 * flags.count(False)
        return real(outs, key)

    monkeypatch.setattr(attest, "commitments", commit)
    monkeypatch.setattr(attest, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    x = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    view = attest.calibrate_window(lambda a: (a.t(), a + 1), lambda s: [x + s], [1, 2, 3], 7, lambda: None)
    assert seen == [False] * 3 + [True] * 3                          # its own layout 3 times, then dense 3 times
    assert view.commit_ms == pytest.approx(1 / 3)                     # per call, the copies' 60 ms not in it
    assert view.attested_ms == 0.0                                    # the reference's own: its window less its own
    seen.clear()
    dense = attest.calibrate_window(lambda a: (a * 2, a + 1), lambda s: [x + s], [1, 2, 3], 7, lambda: None)
    assert seen == [True] * 3 and dense.commit_ms == pytest.approx(1 / 3)   # contiguous already: measured once
