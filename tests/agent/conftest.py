"""Fixtures for the agent tests: a scripted model that submits the shipped solutions."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from mkb_eval import problems as P
from tests.agent.scripted import ScriptedBackend, answer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_TASK = re.compile(r"This is task `(\d{2})_[a-z0-9_]+_(cutedsl|tirx)`")


def solution_script(messages: Sequence[dict[str, str]], turn: int, root: str | None = None) -> str:
    """Answer with the shipped solution of the task's DSL and a SKILL.md naming the DSL and turn."""
    m = _TASK.search(messages[0]["content"])
    assert m, "the first message names the task"
    prob = P.find(int(m.group(1)), root)
    kernel = prob.solution_path(m.group(2)).read_text()
    return answer(kernel, f"- one CTA per row was enough at this size (turn {turn}, written in {m.group(2)})")


@pytest.fixture
def solution_backend() -> ScriptedBackend:
    return ScriptedBackend(solution_script)


@pytest.fixture
def problems_root(tmp_path: Path) -> Path:
    """A private copy of problem 28's folder, so a test may change it."""
    src = P.find(28).path
    dst = tmp_path / "problems" / src.parent.name / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "problems"
