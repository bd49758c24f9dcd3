"""Fixtures: one dataset built once per session from a problem subset, a run folder and a corpus.

The build is the real one (reference runs on CPU included); only the problem set is cut to four
problems to keep it at a few seconds. Every test reads from the fixture's folder or copies it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from dataset_builder.build import BuildOptions, BuildResult, build_dataset
from mkb_eval.skills.corpus import write_release
from mkb_eval.skills.model import Outcome, Skill
from tests.dataset_builder.fakehub import FakeHub
from tests.skills.runfolder import write_run

IDS = (1, 25, 28, 36)
CORPUS_SKILL = "- At hidden size 128 one warp covers four rows with 16-byte loads (0.10 ms against 0.16 ms).\n"


@dataclass(frozen=True)
class Built:
    result: BuildResult
    options: BuildOptions
    run: Path
    corpus: Path

    @property
    def out(self) -> Path:
        return self.result.out


def make_corpus(root: Path) -> Path:
    skill = Skill(origin="maintainers", model="maintainers/hand-written", problem_id=36, direction="tirx2cutedsl",
                  source_verdict="ok", text=CORPUS_SKILL, replicate=1,
                  outcome=Outcome(verdict="helped", skill_status="ok", skill_speedup=9.8, base_status="incorrect"))
    write_release([skill], root / "maintainers", "1.0.0")
    return root


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    src = tmp_path_factory.mktemp("sources")
    run = write_run(src / "run-a")
    corpus = make_corpus(src / "corpus")
    opts = BuildOptions(out=tmp_path_factory.mktemp("ds") / "metakernelbench", version="1.0.0", problem_ids=IDS,
                        runs=(run,), skills_corpus=corpus)
    return Built(build_dataset(opts), opts, run, corpus)


@pytest.fixture
def copy_of(built: Built, tmp_path: Path) -> Path:
    """A private copy of the built folder, to damage."""
    dest = tmp_path / "metakernelbench"
    shutil.copytree(built.out, dest)
    return dest


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """huggingface_hub online, its HTTP client answered by an in-memory Hub, its caches under tmp."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    hub = FakeHub()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent-harnesses.json"))
    _http.set_client_factory(lambda: httpx2.Client(transport=hub.transport(), follow_redirects=True,
                                                   event_hooks={"request": [_http.hf_request_event_hook]}))
    yield hub
    _http.set_client_factory(_http.default_client_factory)
