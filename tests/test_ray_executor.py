"""The Ray executor gives the local pool's records, resumes the same way, and survives a failed task.

Records are compared whole, less what differs between any two runs of the same evaluation:
``created_at`` (a timestamp), the values of ``stages_s`` (wall-clock seconds; the stage names are
kept and compared) and the evaluation's temp folder inside messages and output tails (a fresh
``mkb-eval-*`` folder per evaluation). Everything else (status, stage, message, flags, policy
details, hashes, artifacts, sandbox facts, env) must be equal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from mkb_eval import problems as P
from mkb_eval.sweep import ray_executor as R
from mkb_eval import sweep
from mkb_eval.cli import main
from mkb_eval.harness.verify import Limits
from tests.helpers import until

KW = {"limits": Limits(correctness_s=120, timing_s=120, cpu_s=120)}
_EVAL_DIR = re.compile(r"[^\s\"']*/mkb-eval-[A-Za-z0-9_]+")


@pytest.fixture(scope="module")
def ray_local() -> Any:
    ray = pytest.importorskip("ray")
    # a small object store (records are KBs); the workers inherit the offline env set by conftest, and
    # a mark of this run that the fork servers they start carry (other tests may run servers of their own)
    os.environ[_MARK] = _RUN
    try:
        # one CPU: one task at a time, and one warm actor (one fork server's imports, not two), which must
        # then go on from a failed job to the next
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
        yield ray
        ray.shutdown()
    finally:
        os.environ.pop(_MARK, None)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> list[sweep.Job]:
    """Two problems, both DSLs, three verdicts: three workers per sweep (each shipped solution of both
    problems in both DSLs took five, to show nothing more)."""
    p28, p36 = P.find(28), P.find(36)
    bad = tmp_path_factory.mktemp("bad") / "syntax.py"
    bad.write_text("def solve(h, r, w)\n    return h\n")
    return sweep.shipped_jobs([p28], ["cutedsl"]) + sweep.shipped_jobs([p36], ["tirx"]) + [
        sweep.Job(p28, "cutedsl", p28.path / "solutions" / "wrong" / "side_stream.py"),   # runtime_error on CPU
        sweep.Job(p28, "cutedsl", bad)]                                                     # compile_error


_MARK, _RUN = "MKB_TEST_RAY_RUN", uuid.uuid4().hex


def _fork_servers() -> list[int]:
    """Pids of the fork servers this module's Ray workers started and that still run (a server
    another test or process runs beside them does not count)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if (d.name.isdigit() and b"mkb_eval.harness.forkserver" in (d / "cmdline").read_bytes()
                    and f"{_MARK}={_RUN}".encode() in (d / "environ").read_bytes().split(b"\0")):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return _EVAL_DIR.sub("<eval-dir>", value)
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def _comparable(path: Path) -> list[dict]:
    recs = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        del r["created_at"]
        r["stages_s"] = sorted(r["stages_s"])
        recs.append(_norm(r))
    return sorted(recs, key=lambda r: (r["problem_id"], r["dsl"], r["kernel_sha256"]))


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["tasks", "warm-actors"])
def test_ray_records_equal_local_and_resume(ray_local: Any, jobs: list[sweep.Job], tmp_path: Path, warm: bool) -> None:
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    sweep.run_sweep(jobs, local, tier="cpu", parallel=2, verify_kwargs=KW, warm=warm)
    new = sweep.run_sweep(jobs, remote, tier="cpu", executor="ray", verify_kwargs=KW, warm=warm)
    assert len(new) == len(jobs)
    a, b = _comparable(local), _comparable(remote)
    assert sorted(r["status"] for r in b) == ["compile_error", "runtime_error"] + ["unverified"] * 2
    assert {(r["problem_id"], r["dsl"]) for r in b if r["status"] == "unverified"} == {(28, "cutedsl"), (36, "tirx")}
    assert all(r["message"] and r["stage"] for r in b)
    assert {"forked" in r["sandbox"].get("worker", "") for r in b if r["status"] == "unverified"} == {warm}
    assert a == b
    before = remote.read_text()
    assert sweep.run_sweep(jobs, remote, tier="cpu", executor="ray", verify_kwargs=KW, warm=warm) == []   # resumes
    assert remote.read_text() == before


@pytest.mark.slow
def test_failed_tasks_are_reported_not_recorded(ray_local: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    real = R.verify_task

    def dies_on_cutedsl(problem_ref: str, problem_hash: str, dsl: str, *rest: Any) -> dict:
        if dsl == "cutedsl":
            os._exit(1)                   # the Ray worker process dies, as on a lost node (Ray retries, then gives up)
        return real(problem_ref, problem_hash, dsl, *rest)

    monkeypatch.setattr(R, "verify_task", dies_on_cutedsl)
    p28, p36 = P.find(28), P.find(36)
    good = sweep.Job(p36, "tirx", p36.solution_path("tirx"))
    crash = sweep.Job(p36, "cutedsl", p36.solution_path("cutedsl"))
    # the task refuses a problem whose copy hashes differently: an infrastructure error, not a verdict
    stale = sweep.Job(dataclasses.replace(p28, hash="0" * 64), "tirx", p28.solution_path("tirx"))
    out = tmp_path / "r.jsonl"
    new = sweep.run_sweep([stale, crash, good], out, tier="cpu", executor="ray", verify_kwargs=KW)
    assert [(r["problem_id"], r["dsl"]) for r in new] == [(36, "tirx")] and len(out.read_text().splitlines()) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("NOT RECORDED") == 2 and "2 evaluation(s) not recorded" in text
    assert "WorkerCrashedError" in text and "install the same commit on every node" in text


@pytest.mark.slow
def test_warm_actors_report_a_failed_job_and_go_on(ray_local: Any, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p28, p36 = P.find(28), P.find(36)
    stale = sweep.Job(dataclasses.replace(p28, hash="0" * 64), "tirx", p28.solution_path("tirx"))
    jobs = [stale] + sweep.shipped_jobs([p36], P.DSLS)
    out = tmp_path / "w.jsonl"
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(_fork_servers())
            stop.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        new = sweep.run_sweep(jobs, out, tier="cpu", executor="ray", verify_kwargs=KW, warm=True)
    finally:
        stop.set()
        watcher.join()
    assert seen, "the actors' fork servers were not found by their mark (the check below would prove nothing)"
    assert sorted((r["problem_id"], r["dsl"]) for r in new) == [(36, "cutedsl"), (36, "tirx")]
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("NOT RECORDED") == 1 and "install the same commit on every node" in text
    assert until(lambda: not _fork_servers(), 30)      # the actors closed their pools: no server left running


@pytest.mark.slow
def test_cli_executor_ray(ray_local: Any, tmp_path: Path) -> None:
    out = tmp_path / "cli.jsonl"
    args = ["verify", "--all", "--problems", "36", "--dsl", "tirx", "--tier", "cpu", "--executor", "ray",
            "--out", str(out)]
    assert main(args) == 0
    assert [json.loads(x)["status"] for x in out.read_text().splitlines()] == ["unverified"]


def test_cli_without_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)          # as if not installed
    rc = main(["verify", "--all", "--problems", "36", "--tier", "cpu", "--executor", "ray",
               "--out", str(tmp_path / "x.jsonl")])
    assert rc == 2 and "pip install 'mkb-eval[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    assert main(["verify", "--all", "--address", "ray://x:10001", "--out", str(tmp_path / "x.jsonl")]) == 2
