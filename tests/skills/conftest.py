"""Fixtures for the skills tests: a run folder written by the real run store, a small corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from mkb_eval.skills.corpus import write_release
from mkb_eval.skills.index import END, START
from mkb_eval.skills.model import Outcome, Skill
from tests.skills.runfolder import write_run

MAINTAINER_SKILL = ("- At hidden size 128 a row is 256 bytes: one warp covers four rows with 16-byte loads; "
                    "measured 0.10 ms against 0.16 ms for one row per warp.\n")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run-a")


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "README.md").write_text(f"# corpus\n\n{START}\n\nold\n\n{END}\n")
    skill = Skill(origin="maintainers", model="maintainers/hand-written", problem_id=36,
                  direction="tirx2cutedsl", source_verdict="ok", text=MAINTAINER_SKILL, replicate=1,
                  source_trial="p36_r1_solo_tirx", source_speedup=10.6,
                  outcome=Outcome(verdict="helped", skill_trial="p36_r1_tirx2cutedsl_skill", skill_status="ok",
                                  skill_speedup=9.8, base_status="incorrect"))
    write_release([skill], corpus / "maintainers", "1.0.0")
    return corpus
