"""The job a worker gets at start (:mod:`mkb_eval.harness.job`): it round-trips through its encoder and
the worker's decoder, its wire keys are those of the dict it replaced, a malformed job is refused naming
the field (at the parent already when a value is outside a vocabulary), and a worker given one ends at
once with a final message that says which field."""

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mkb_eval import problems as P
from mkb_eval.harness import protocol
from mkb_eval.harness.channel import read_messages
from mkb_eval.harness.job import Job, decode
from mkb_eval.harness.jobs import CORRECTNESS_DRAWS, REUSE_DRAWS, make_job
from mkb_eval.harness.spawn import Worker

from .conftest import cpu_job

ROOT = Path(__file__).resolve().parents[2]
# the keys, in order, of the dict make_job built and Worker.start extended before the job was typed
WIRE_KEYS = ["problem_dir", "dsl", "tier", "size", "device", "kernel_path", "out_dir", "dump_dir", "mode",
             "correctness_seeds", "reuse_draws", "nodsl_seed", "timing_cpu", "work_cpus", "sentinel", "channel", "gate_fd"]
ATTACHED = {"sentinel": "ab" * 16, "channel": "eval/channel", "gate_fd": 3}


def sent(**over: object) -> Job:
    """A job as a worker receives it: channel and gate attached."""
    return cpu_job(**{**ATTACHED, **over})


def wire(**over: object) -> dict:
    return {**json.loads(sent().encode()), **over}


@pytest.mark.parametrize("job", [
    sent(),
    sent(tier="gpu", size="full", device="cuda:0", timing_cpu=7, work_cpus=[0, 1, 2]),
    sent(mode="retime", correctness_seeds=[2**63 - 1], reuse_draws=[], nodsl_seed=None),
])
def test_a_job_round_trips_through_its_encoder_and_the_workers_decoder(job):
    assert decode(job.encode()) == job
    assert decode(job.encode().decode()) == job               # the worker reads its stdin as text


def test_the_wire_keys_are_those_of_the_untyped_job():
    job = sent()
    assert list(json.loads(job.encode())) == WIRE_KEYS
    assert [f.name for f in dataclasses.fields(Job)] == WIRE_KEYS
    assert job.encode() == json.dumps(dict(zip(WIRE_KEYS, (getattr(job, k) for k in WIRE_KEYS), strict=True))).encode()


def test_make_job_sets_every_field_but_the_attached_ones(tmp_path):
    job = make_job(P.find(28), "tirx", tmp_path, "cpu", "smoke", "cpu")
    assert job.kernel_path == str(tmp_path / "work" / "kernel.py") and job.out_dir == str(tmp_path / "out")
    assert len(job.correctness_seeds) == CORRECTNESS_DRAWS and job.reuse_draws == list(REUSE_DRAWS)
    assert job.nodsl_seed is not None and job.timing_cpu is None and job.work_cpus is None
    assert (job.sentinel, job.channel, job.gate_fd) == ("", "", -1)
    with pytest.raises(protocol.ProtocolError, match=r"job\.sentinel"):
        decode(job.encode())                                   # never attached: refused by the worker


def test_a_value_outside_a_vocabulary_is_refused_at_the_parent(tmp_path):
    with pytest.raises(protocol.ProtocolError, match=r"^job\.dsl: expected one of 'cutedsl', 'tirx', got 'cuda'"):
        make_job(P.find(28), "cuda", tmp_path, "cpu", "smoke", "cpu")
    with pytest.raises(protocol.ProtocolError, match=r"^job\.mode"):
        make_job(P.find(28), "tirx", tmp_path, "cpu", "smoke", "cpu", mode="fast")


@pytest.mark.parametrize("field,value,where,says", [
    ("dsl", "triton", "job.dsl", "expected one of"),
    ("tier", "tpu", "job.tier", "expected one of"),
    ("size", "medium", "job.size", "expected one of"),
    ("device", "cuda:1", "job.device", "expected one of"),
    ("mode", "fast", "job.mode", "expected one of"),
    ("problem_dir", 3, "job.problem_dir", "expected a string"),
    ("out_dir", None, "job.out_dir", "expected a string"),
    ("kernel_path", "x" * (protocol.MAX_TEXT + 1), "job.kernel_path", "expected a string of at most"),
    ("correctness_seeds", [], "job.correctness_seeds", "expected 1 to"),
    ("correctness_seeds", "123", "job.correctness_seeds", "expected a list"),
    ("correctness_seeds", [1, True], "job.correctness_seeds[1]", "expected an integer"),
    ("correctness_seeds", [2**70], "job.correctness_seeds[0]", "expected an integer"),
    ("reuse_draws", None, "job.reuse_draws", "expected a list"),
    ("nodsl_seed", 1.5, "job.nodsl_seed", "expected an integer"),
    ("timing_cpu", True, "job.timing_cpu", "expected an integer"),
    ("work_cpus", [0, "1"], "job.work_cpus[1]", "expected an integer"),
    ("sentinel", "", "job.sentinel", "never attached"),
    ("channel", "", "job.channel", "never attached"),
    ("gate_fd", -1, "job.gate_fd", "never attached"),
    ("gate_fd", "3", "job.gate_fd", "expected an integer"),
])
def test_a_bad_field_is_refused_naming_it(field, value, where, says):
    with pytest.raises(protocol.ProtocolError) as e:
        decode(json.dumps(wire(**{field: value})))
    assert e.value.where == where and says in e.value.problem


@pytest.mark.parametrize("data,where,says", [
    (json.dumps({k: v for k, v in wire().items() if k != "dump_dir"}), "job.dump_dir", "missing"),
    (json.dumps({k: v for k, v in wire().items() if k != "gate_fd"}), "job.gate_fd", "missing"),
    (json.dumps(wire(warmup_seeds=[1, 2])), "job.warmup_seeds", "unknown field"),
    ("[1, 2]", "job", "expected an object"),
    ('{"problem_dir": ', "job", "not a JSON object"),
    (b"\xff\xfe", "job", "not a JSON object"),
])
def test_a_job_of_missing_unknown_or_unreadable_fields_is_refused(data, where, says):
    with pytest.raises(protocol.ProtocolError) as e:
        decode(data)
    assert e.value.where == where and says in e.value.problem


def test_start_attaches_the_workers_channel_and_gate_by_replace():
    class Stdin(io.BytesIO):
        def close(self):
            self.sent = self.getvalue()
            super().close()

    job, stdin = cpu_job(), Stdin()
    w = SimpleNamespace(sentinel="cd" * 16, channel=Path("eval/channel"), child_gate_fd=3, proc=SimpleNamespace(stdin=stdin))
    Worker.start(w, job)
    got = decode(stdin.sent)
    assert got == dataclasses.replace(job, sentinel="cd" * 16, channel="eval/channel", gate_fd=3)
    assert job.sentinel == ""                                  # the parent's job itself is unchanged


def test_a_worker_given_a_malformed_job_ends_at_once_saying_which_field(tmp_path):
    chan = tmp_path / "channel"
    bad = json.dumps(wire(channel=str(chan), tier="tpu"))
    res = subprocess.run([sys.executable, "-m", "mkb_eval.harness.worker", "-"], input=bad, capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert res.returncode == 2 and "job.tier" in res.stderr and "Traceback" not in res.stderr
    (final,) = read_messages(chan, ATTACHED["sentinel"])
    assert isinstance(final, protocol.Final) and (final.status, final.stage) == ("runtime_error", "start")
    assert "malformed job" in final.message and "job.tier" in final.message
