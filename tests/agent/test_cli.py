"""``mkb run`` on bad input: one clear line on stderr, exit 2, no traceback, the run folder untouched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import attempt

ROOT = Path(__file__).resolve().parents[2]


def mkb(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mkb_eval.agent.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("mkb run: ") and needle in lines[0], res.stderr


@pytest.fixture
def seeded_run(tmp_path: Path) -> Path:
    """A run folder that already holds a record, to check that bad input leaves it byte for byte."""
    run = tmp_path / "run"
    run.mkdir()
    rec = attempt("p36_r1_solo_tirx", "incorrect", model="m")      # the model test_unreachable_server asks for
    (run / "attempts.jsonl").write_text(json.dumps(rec) + "\n")
    return run


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_unknown_problem(seeded_run: Path) -> None:
    before = _snapshot(seeded_run)
    _one_line_error(mkb("run", "--problems", "28,99", "--run-dir", str(seeded_run)), "no problem '99'")
    assert _snapshot(seeded_run) == before


def test_unreachable_server(seeded_run: Path) -> None:
    before = _snapshot(seeded_run)
    res = mkb("run", "--model", f"openai:http://127.0.0.1:{_closed_port()}/v1#m", "--problems", "28",
              "--run-dir", str(seeded_run), "--quiet")
    _one_line_error(res, "cannot reach the OpenAI-compatible server")
    assert _snapshot(seeded_run) == before


def test_model_without_chat_template(seeded_run: Path, tmp_path: Path) -> None:
    d = tmp_path / "no-template-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "tokenizer_config.json").write_text("{}")
    before = _snapshot(seeded_run)
    _one_line_error(mkb("run", "--model", str(d), "--problems", "28", "--run-dir", str(seeded_run)),
                    "has no chat template")
    assert _snapshot(seeded_run) == before


def test_bad_arm_and_replicates(tmp_path: Path) -> None:
    _one_line_error(mkb("run", "--arms", "solo_cuda", "--run-dir", str(tmp_path / "r")), "unknown arm(s) solo_cuda")
    _one_line_error(mkb("run", "--replicates", "0", "--run-dir", str(tmp_path / "r")), "--replicates must be >= 1")
    _one_line_error(mkb("run", "--submissions", "0", "--run-dir", str(tmp_path / "r")), "submissions must be >= 1")


def test_dry_run_lists_the_plan(tmp_path: Path) -> None:
    res = mkb("run", "--problems", "28,36", "--arms", "tirx2cutedsl_skill", "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr
    assert "p36_r1_solo_tirx" in res.stdout and "p28_r1_tirx2cutedsl_skill" in res.stdout
    assert not (tmp_path / "r" / "attempts.jsonl").exists()
