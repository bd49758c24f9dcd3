"""sweep.per_gpu: one sweep process per GPU, fed a job at a time; nothing handed out is lost."""

import io
import json
import sys

from mkb_eval import problems as P
from mkb_eval import sweep as S
from mkb_eval.sweep import per_gpu as G


class Sink:
    def __init__(self):
        self.recs, self.failures, self.notes = [], [], []

    def record(self, rec, job=None):
        self.recs.append(rec)

    def failed(self, job, error):
        self.failures.append((job.problem.id, error))

    def note(self, text):
        self.notes.append(text)


def test_children_evaluate_every_job_and_report_their_cpu(tmp_path, monkeypatch):
    """Real children (CPU tier here, a GPU each on a GPU host) give the records a one-process sweep gives."""
    monkeypatch.setenv("MKB_CACHE_DIR", str(tmp_path))
    jobs = S.shipped_jobs([P.find(28), P.find(36)], ["tirx"])
    sink = Sink()
    G.run(jobs, "cpu", {}, parallel=2, n_gpus=2, sink=sink)
    assert sink.failures == []
    assert sorted((r["problem_id"], r["status"], r["kernel_sha256"]) for r in sink.recs) == sorted(
        (j.problem.id, "unverified", j.kernel_sha256) for j in jobs)
    assert sorted(n.split(" sweep")[0] for n in sink.notes) == ["GPU 0", "GPU 1"] and all("cores" in n for n in sink.notes)


def test_a_child_that_dies_loses_nothing_silently(tmp_path, monkeypatch):
    """Each child takes one job, writes garbage and a record for a job it was never given, then dies:
    its own job and the job nobody took are reported as not recorded, and nothing false is stored."""
    fake = tmp_path / "child.py"
    fake.write_text("import json, sys\n"
                    "sys.stdin.readline()\n"
                    "print(json.dumps({'want': 1}), flush=True)\n"
                    "job = json.loads(sys.stdin.readline())\n"
                    "print('not json', flush=True)\n"
                    "print(json.dumps(['a', 'list']), flush=True)\n"
                    "print(json.dumps({'job': [1], 'record': {}}), flush=True)\n"
                    "print(json.dumps({'job': 12345, 'record': {'status': 'ok'}}), flush=True)\n"
                    "sys.exit(3)\n")
    monkeypatch.setattr(G, "CHILD", [sys.executable, str(fake)])
    jobs = S.shipped_jobs([P.find(28), P.find(29), P.find(36)], ["tirx"])
    sink = Sink()
    G.run(jobs, "cpu", {}, parallel=2, n_gpus=2, sink=sink)
    assert sink.recs == [] and sorted(i for i, _ in sink.failures) == [28, 29, 36]
    errors = sorted(e for _, e in sink.failures)
    assert sum("ended (exit code 3)" in e for e in errors) == 2 and "no GPU's sweep process was left" in errors[-1]


def test_a_slow_gpu_takes_fewer_jobs(tmp_path, monkeypatch):
    """Jobs go to whichever GPU's process asks next: one that takes a second per evaluation does not
    hold half of them while the other idles."""
    fake = tmp_path / "child.py"
    fake.write_text("import json, os, sys, time\n"
                    "sys.stdin.readline()\n"
                    "gpu = os.environ['CUDA_VISIBLE_DEVICES']\n"
                    "while True:\n"
                    "    print(json.dumps({'want': 1}), flush=True)\n"
                    "    job = json.loads(sys.stdin.readline())\n"
                    "    if job.get('done'):\n"
                    "        break\n"
                    "    time.sleep(1.0 if gpu == '0' else 0.05)\n"
                    "    print(json.dumps({'job': job['job'], 'record': {'gpu': gpu, 'kernel': job['kernel']}}), flush=True)\n"
                    "print(json.dumps({'cpu_s': 0.1, 'wall_s': 2.0}), flush=True)\n")
    monkeypatch.setattr(G, "CHILD", [sys.executable, str(fake)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    jobs = S.shipped_jobs([P.find(i) for i in (28, 29, 30, 31, 36, 1)], ["tirx"])
    sink = Sink()
    G.run(jobs, "gpu", {}, parallel=2, n_gpus=2, sink=sink)
    assert sink.failures == [] and sorted(r["kernel"] for r in sink.recs) == sorted(str(j.kernel) for j in jobs)
    assert sum(r["gpu"] == "0" for r in sink.recs) <= 2


def test_the_child_refuses_a_problem_changed_during_the_sweep(monkeypatch):
    sent = []

    class Proto:
        def send(self, msg):
            sent.append(msg)

    p = P.find(28)
    job = {"problem": str(p.path), "dsl": "tirx", "kernel": str(p.solution_path("tirx")), "remaining": 4}
    lines = [{**job, "job": 7, "hash": "0" * 64}, {**job, "job": 8, "hash": p.hash}, {"done": True}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(m) + "\n" for m in lines)))
    q = G._RemoteQueue(10, Proto())
    first = q.take()
    assert sent[1]["job"] == 7 and "changed on disk" in sent[1]["failed"]
    assert first.problem.id == 28 and q.ids[id(first)] == 8 and q.bound() == 4 and q.taken == 1
    assert q.take() is None and q.bound() == 0


def test_a_child_dies_with_its_parent(tmp_path):
    """A sweep cut by SIGKILL must not leave GPU sweep processes running its evaluations on."""
    import os
    import signal
    import subprocess
    import time

    script = ("import os, subprocess, sys\n"
              "c = subprocess.Popen([sys.executable, '-c', 'from mkb_eval.sweep.per_gpu import _die_with_parent; "
              "import time; _die_with_parent(); time.sleep(60)'])\n"
              "print(c.pid, flush=True)\n"
              "c.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)                                    # the child has asked for the signal by now
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":       # dead, not yet reaped by init
                return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the child outlived its parent")
