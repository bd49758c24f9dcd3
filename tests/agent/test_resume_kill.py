"""A run killed with SIGKILL mid-way and restarted ends with every trial recorded exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mkb_eval.metrics.inputs import read_attempts

ROOT = Path(__file__).resolve().parents[2]
TRIALS = {f"p28_r1_{a}" for a in ("solo_cutedsl", "solo_tirx", "cutedsl2tirx_skill", "tirx2cutedsl_skill")}


def _driver(run: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUTE_DSL_ARCH": "sm_90a"}
    return subprocess.Popen([sys.executable, "-m", "tests.agent.run_driver", str(run), "0.5"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run: Path) -> list[dict]:
    p = run / "attempts.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


@pytest.mark.slow
def test_sigkill_then_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _driver(run)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not _records(run):
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = _records(run)
    prefix = (run / "attempts.jsonl").read_bytes()
    assert 1 <= len(first) < len(TRIALS)
    unfinished = {p.name for p in (run / "trials").iterdir()} - {r["trial"] for r in first}
    assert unfinished, "some trial was in progress when the run was killed"

    proc = _driver(run)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "FINISHED" in out
    recs = _records(run)
    assert (run / "attempts.jsonl").read_bytes().startswith(prefix)          # nothing written before was lost
    assert sorted(r["trial"] for r in recs) == sorted(TRIALS)                 # every trial exactly once
    assert all(r["error"] is None for r in recs)
    archived = {p.name.split("__", 1)[1] for p in (run / "archive").iterdir() if "__p28" in p.name}
    assert archived == unfinished                                              # partial artifacts kept, not reused
    for t in TRIALS:
        assert (run / "trials" / t / "attempt.json").is_file()
    loaded = read_attempts(run)
    assert len(loaded.outcomes) == 4 and not loaded.warnings
    invocations = (run / "invocations.jsonl").read_text().splitlines()
    assert len(invocations) == 2
