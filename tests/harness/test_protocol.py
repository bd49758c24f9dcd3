"""The parent<->worker protocol (:mod:`mkb_eval.harness.protocol`): every message round-trips through
its encoder and decoder; what a hostile worker can put on the channel or the gate instead (unknown
kinds, missing or unknown fields, wrong types, NaN, bools for ints, over-long lists and text, deep
nesting) is a protocol error naming the field, and the parent makes a verdict of it."""

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from mkb_eval.harness import protocol as P
from mkb_eval.harness import timed
from mkb_eval.harness.channel import Channel, read_messages
from mkb_eval.harness.gate import MAX_PACKET, GateSocket
from mkb_eval.harness.phase1 import judge_phase1
from mkb_eval.harness.spawn import Worker, fail_from_worker
from mkb_eval.harness.verify import Limits, verify
from mkb_eval.records import VerificationRecord

from .conftest import compose, cpu_job

DRAW = P.Draw(draw=0, launches=2, input_digests=[(1, -2), None], addresses=[140000000000])
MESSAGES = [
    P.progress("kernel_import", 1.5, 0.25),
    P.progress("correctness", 2.0, 0.5, draw=3),
    P.progress("setup", 1.0, 0.1, network="isolated", outside_write="denied"),
    P.progress("events", 3.0, 1.0, n=1, times_ms=[0.5, 0.25], device_ms=None, launches_per_call=[1],
               timing_s=0.5, host_call_ms=0.01, cpu_probe_ms=1.25),
    P.Lane(n=2, want="step_aside"),
    P.Phase1Report(stage="correctness", draws=[DRAW], nodsl="raised", poisoned_bytes=1 << 30, import_s=1.0,
                   first_call_s=0.5, correctness_s=2.0),
    P.Final(status="unverified", stage="done", cpu=3.0, artifacts={"cubin_bytes": 4096, "names": ["k"]},
            launches=3, compile_s=1.5, import_s=0.5, after_launch_error=None),
    P.Final(status="policy_violation", stage="correctness", cpu=1.0, message="no", flags=["harness_patch"]),
]


def _wire(msg) -> dict:
    return json.loads(json.dumps(P.encode(msg)))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: f"{type(m).__name__}-{getattr(m, 'stage', '')}")
def test_every_channel_message_round_trips(msg):
    assert P.decode(_wire(msg)) == msg
    assert type(P.decode_line(json.dumps(P.encode(msg)))) is type(msg)


@pytest.mark.parametrize("op", [P.EventsOp([1, 2], [3], device=False), P.PrepOp(17), P.WindowOp([5, 6], 7, "win0"),
                                P.SaveOp([0, 2], "win1")], ids=lambda o: o.op)
def test_every_operation_round_trips_and_end_or_stop_end_the_phase(op):
    assert P.decode_op(P.encode_op(op)) == op
    assert P.decode_op(P.encode_op(P.EndOp())) is None
    assert P.decode_op(P.STOP) is None and P.decode_op(b"") is None


def test_the_window_replies_round_trip():
    digests = [[[1, 2], [3, -4]], [[5, 6], [7, 8]]]
    assert P.decode_digests(P.digests_reply(digests), 2) == digests
    assert P.reply_text(P.error_reply("holding the window's memory: OOM")) == "holding the window's memory: OOM"
    assert len({P.GO, P.STOP, P.READY, P.CALLED, P.SAVED, P.PREPPED}) == 6


def _edit(msg, **changes) -> dict:
    d = _wire(msg)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = d
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is _DROP:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return d


_DROP = object()
NAN, INF = float("nan"), float("inf")
PROG, SETUP, EVENTS, LANE, PHASE1, FINAL = MESSAGES[1], MESSAGES[2], MESSAGES[3], MESSAGES[4], MESSAGES[5], MESSAGES[7]
HOSTILE = [
    (_edit(PROG, stage="nonsense"), "progress.stage"),
    (_edit(PROG, t="soon"), "progress.t"),
    (_edit(PROG, cpu=NAN), "progress.cpu"),
    (_edit(PROG, draw=True), "progress.draw"),
    (_edit(PROG, t=_DROP), "progress.t: missing"),
    (_edit(PROG, extra=1), "progress.extra: unknown field"),
    (_edit(SETUP, network=5), "setup.network"),
    (_edit(EVENTS, times_ms="0.1,0.2"), "events.times_ms"),
    (_edit(EVENTS, times_ms=[]), "events.times_ms"),
    (_edit(EVENTS, times_ms=[0.1, INF]), "events.times_ms[1]"),
    (_edit(EVENTS, times_ms=[0.1] * (P.MAX_ITEMS + 1)), "events.times_ms"),
    (_edit(EVENTS, n=True), "events.n"),
    (_edit(EVENTS, device_ms="fast"), "events.device_ms"),
    (_edit(EVENTS, launches_per_call=[1.0]), "events.launches_per_call[0]"),
    (_edit(LANE, want="everything"), "lane.want"),
    (_edit(LANE, n=1.5), "lane.n"),
    (_edit(PHASE1, draws__0__addresses="0x7f"), "phase1.draws[0].addresses"),
    (_edit(PHASE1, draws__0__input_digests__0=[1, 2, 3]), "phase1.draws[0].input_digests[0]"),
    (_edit(PHASE1, draws__0__draw=False), "phase1.draws[0].draw"),
    (_edit(PHASE1, draws="all of them"), "phase1.draws"),
    (_edit(PHASE1, nodsl="maybe"), "phase1.nodsl"),
    (_edit(PHASE1, stage="done"), "phase1.stage"),
    (_edit(FINAL, status="ok"), "final.status"),
    (_edit(FINAL, status=_DROP), "final.status: missing"),
    (_edit(FINAL, flags="harness_patch"), "final.flags"),
    (_edit(FINAL, message="x" * (P.MAX_TEXT + 1)), "final.message"),
    (_edit(FINAL, launches=1 << 70), "final.launches"),
    (_edit(FINAL, artifacts={"a": NAN}), "final.artifacts.a"),
    (_edit(FINAL, artifacts=json.loads("[" * 40 + "]" * 40)), "final.artifacts"),
    (_edit(FINAL, artifacts={"a": json.loads("[" * 40 + "]" * 40)}), "final.artifacts.a"),
    ({"kind": "verdict", "status": "ok"}, "kind: unknown message kind 'verdict'"),
    ({"status": "ok"}, "kind: unknown message kind None"),
]


@pytest.mark.parametrize("obj,where", HOSTILE, ids=[w for _, w in HOSTILE])
def test_a_malformed_message_is_a_protocol_error_naming_its_field(obj, where):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(obj)
    assert str(e.value).startswith(where), str(e.value)
    line = P.decode_line(json.dumps(obj))                 # on the channel: kept in place, never raised
    assert isinstance(line, P.Malformed) and str(line.error).startswith(where)


@pytest.mark.parametrize("text,what", [
    ("[" * 100_000, "RecursionError"),                    # json.loads gives up past the stack
    ('{"kind": "lane", "n": ' + "9" * 5000 + "}", "ValueError"),     # past Python's int digits limit
    ('{"kind": "final", "message": "' + "x" * P.MAX_LINE + '"}', "characters"),
])
def test_unreadable_lines_are_protocol_errors_and_torn_ones_are_ignored(text, what):
    got = P.decode_line(text)
    assert isinstance(got, P.Malformed) and what in str(got.error)
    assert P.decode_line('{"kind": "final", "sta') is None and P.decode_line("[1, 2]") is None


def test_the_channel_keeps_malformed_messages_in_their_place(tmp_path):
    path, sentinel = tmp_path / "channel", "s3cr3t"
    chan = Channel(path, sentinel)
    chan.send(**P.encode(MESSAGES[0]))
    with open(path, "a") as f:
        f.write(sentinel + '{"kind": "lane", "n": "one", "want": "release"}\n')
        f.write('{"kind": "final", "status": "ok"}\n')                    # no sentinel: foreign, ignored
        f.write(sentinel + '{"kind": "final", "sta\n')                  # torn: ignored
    chan.send(**P.encode(FINAL))
    msgs = read_messages(path, sentinel)
    assert [type(m) for m in msgs] == [P.Progress, P.Malformed, P.Final]
    assert str(msgs[1].error).startswith("lane.n")


class _Fake:
    """What the parent reads of a worker: its messages (``Worker.wait_for`` over them)."""

    def __init__(self, msgs):
        self.msgs = msgs
        self.proc = SimpleNamespace(poll=lambda: 0, wait=lambda: 0, returncode=0)

    def messages(self):
        return self.msgs

    def _watch(self):
        pass

    def death(self):
        return "exited with code 0"

    wait_for = Worker.wait_for
    last_stage = Worker.last_stage


def _rec() -> VerificationRecord:
    return VerificationRecord(status="crashed", problem_id=28, problem="p", problem_hash="h", dsl="cutedsl",
                              kernel_sha256="k", tier="gpu", size="full", created_at="now")


def test_a_malformed_message_ends_the_wait_and_becomes_the_verdict():
    bad = P.decode_line(json.dumps(_edit(EVENTS, times_ms="all fast")))
    w = _Fake([MESSAGES[2], P.progress("ready", 2.0, 0.2), bad, FINAL])
    assert w.wait_for(("ready", "final"), 1)[0] == w.msgs[1]           # what came before it is read as ever
    msg, how = w.wait_for(("events", "final"), 1)
    assert (msg, how) == (None, "protocol")
    rec = _rec()
    fail_from_worker(rec, w, how, 1)
    assert rec.status == P.PROTOCOL_STATUS and P.PROTOCOL_FLAG in rec.flags and "events.times_ms" in rec.message


@pytest.mark.parametrize("status", ["timed", "stopped", "unverified"])
def test_a_final_that_claims_no_failure_where_one_was_due_is_a_protocol_error(status):
    rec = _rec()
    fail_from_worker(rec, _Fake([P.Final(status=status, stage="correctness", cpu=1.0)]), "message", 1)
    assert rec.status == P.PROTOCOL_STATUS and "final.status" in rec.message and P.PROTOCOL_FLAG in rec.flags
    fail_from_worker(rec, _Fake([FINAL]), "message", 1)                  # a failure it may claim stands
    assert rec.status == "policy_violation" and "harness_patch" in rec.flags


@pytest.mark.parametrize("draws,nodsl,where", [([], "raised", "phase1.draws"),
                                                ([DRAW, DRAW], "raised", "phase1.draws"),
                                                ([DRAW], "skipped", "phase1.nodsl")])
def test_a_phase1_report_of_other_draws_than_asked_is_not_judged(draws, nodsl, where):
    judge = SimpleNamespace(check=lambda *a, **k: pytest.fail("judged a report it should refuse"))
    msg = P.Phase1Report(stage="correctness", draws=draws, nodsl=nodsl, poisoned_bytes=0, import_s=0.0,
                         first_call_s=0.0, correctness_s=0.0)
    rec = _rec()
    assert not judge_phase1(rec, judge, cpu_job(correctness_seeds=[11], nodsl_seed=12), msg, Path("."))
    assert rec.status == P.PROTOCOL_STATUS and where in rec.message


class _ScriptedWorker:
    """A worker's gate end that answers prep and window honestly, then sends ``last`` as its digests."""

    def __init__(self, last: bytes):
        self.gate = GateSocket()
        self.proc = SimpleNamespace(poll=lambda: None)
        self.ops: list = []

        def run():
            child = self.gate.child
            self.ops.append(P.decode_op(child.recv(MAX_PACKET)))
            child.send(P.PREPPED)
            self.ops.append(P.decode_op(child.recv(MAX_PACKET)))
            child.send(P.READY)
            child.send(P.CALLED)
            child.send(last)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def _watch(self):
        pass


@pytest.mark.parametrize("reply,where", [
    (b'{"digests": "all good"}', "window.digests"),
    (P.digests_reply([[[1, 2]]] * 2), "window.digests: expected 3 digests"),
    (P.digests_reply([[[1, 2]], [[1, 2, 3]], [[1, 2]]]), "window.digests[1][0]"),
    (P.digests_reply([[[1, 2]], [[True, 2]], [[1, 2]]]), "window.digests[1][0][0]"),
    (P.digests_reply([[[1, 2]], [[1.5, 2]], [[1, 2]]]), "window.digests[1][0][0]"),
    (json.dumps({"digests": [[[1, 2]]] * 3, "fast": True}).encode(), "window.fast: unknown field"),
    (b"[" * 200_000, "window: not a JSON message"),
    (b"\xff\xfe", "window: not a JSON message"),
    (b"[1, 2, 3]", "window: expected an object"),
])
def test_a_forged_window_reply_is_a_status_not_a_parent_crash(reply, where):
    w = _ScriptedWorker(reply)
    try:
        with pytest.raises(timed.WindowFailed) as e:
            timed.run_window(w, 3, "win0", 10)
        assert e.value.status == P.PROTOCOL_STATUS and e.value.flags == (P.PROTOCOL_FLAG,)
        assert where in e.value.message, e.value.message
        assert [type(o) for o in w.ops] == [P.PrepOp, P.WindowOp] and w.ops[1].tag == "win0"
    finally:
        w.thread.join(5)
        w.gate.close()


# a candidate that rewrites the worker's messages on their way (json.dumps swapped between the guard's
# check and the send, as solutions/wrong/cheat_time_forged_unseen.py does)
FORGE = '''
import json as _json
import time as _time

_real_dumps, _real_pt = _json.dumps, _time.process_time
_FORGED = {forged!r}


def _forging_dumps(obj, *a, **kw):
    _json.dumps = _real_dumps
    if isinstance(obj, dict) and obj.get("kind") == {kind!r}:
        obj = {{**obj, **_FORGED}}
    return _real_dumps(obj, *a, **kw)


def _process_time():
    _json.dumps = _forging_dumps
    return _real_pt()


_time.process_time = _process_time


def solve(h, r, w):
    return rmsnorm_rest(add_fp32(h, r), w)
'''


@pytest.mark.parametrize("kind,forged,where", [("final", {"status": "ok"}, "final.status"),
                                               ("progress", {"cpu": "a lot"}, "progress.cpu")])
def test_a_worker_that_forges_its_messages_gets_a_protocol_verdict(p28, tmp_path, kind, forged, where):
    """End to end on the CPU tier: a final claiming ``ok`` (the parent once copied a final's status into
    the record) or a progress message with a wrong type is a protocol error's verdict."""
    kernel = compose(FORGE.format(kind=kind, forged=forged), tmp_path, "forge")
    rec = verify(p28, "cutedsl", kernel, tier="cpu", limits=Limits(cpu_s=90))
    assert rec.status == P.PROTOCOL_STATUS and P.PROTOCOL_FLAG in rec.flags, (rec.status, rec.message[-1500:])
    assert where in rec.message
