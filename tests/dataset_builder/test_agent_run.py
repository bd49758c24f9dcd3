"""A run folder written by the real attempt loop (scripted model, CPU-tier verifier) builds into
the attempts and skills configs: the contract between the agent's run store and the builder."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import datasets
import pytest

from dataset_builder.build import BuildOptions, build_dataset
from mkb_eval import problems as P
from mkb_eval.agent.backends import Sampling
from mkb_eval.agent.launch import RunOptions, run_trials
from mkb_eval.agent.loop import Budget
from tests.agent.scripted import ScriptedBackend, answer

_TASK = re.compile(r"This is task `(\d{2})_[a-z0-9_]+_(cutedsl|tirx)`")


def _script(messages: Sequence[dict[str, str]], turn: int) -> str:
    m = _TASK.search(messages[0]["content"])
    assert m, "the first message names the task"
    kernel = P.find(int(m.group(1))).solution_path(m.group(2)).read_text()
    return answer(kernel, f"- one pass over each row was enough here (observed in {m.group(2)})")


@pytest.mark.slow
def test_a_real_run_folder_builds_into_attempts_and_skills(tmp_path: Path):
    run = tmp_path / "run-real"
    opts = RunOptions(problems="28", arms="solo_cutedsl,solo_tirx,cutedsl2tirx_skill", run_dir=str(run),
                      budget=Budget(submissions=1), sampling=Sampling(seed=1), workers=2, progress=False, root=None)
    summary, _ = run_trials(opts, backend=ScriptedBackend(_script), log=lambda s: None)
    assert summary is not None and len(summary.finished) == 3

    out = tmp_path / "metakernelbench"
    res = build_dataset(BuildOptions(out=out, version="0.1.0", configs=("problems", "attempts", "skills"),
                                     problem_ids=(28,), runs=(run,), skills_corpus=None))
    assert res.rows == {"problems": 1, "attempts": 3, "skills": 2}
    attempts = datasets.load_dataset(str(out), "attempts", split="train", cache_dir=str(tmp_path / "c")).to_list()
    records = {json.loads(x)["trial"]: x for x in (run / "attempts.jsonl").read_text().splitlines()}
    for r in attempts:
        assert r["record_json"] == json.dumps(json.loads(records[r["trial"]]), sort_keys=True)
        assert r["kernel_source"] == (run / "trials" / r["trial"] / "kernel.py").read_text()
        assert r["skill_md"] == (run / "trials" / r["trial"] / "SKILL.md").read_text()
        assert r["status"] == "unverified" and r["passed"] is False          # the CPU tier times nothing
    skills = datasets.load_dataset(str(out), "skills", split="train", cache_dir=str(tmp_path / "c")).to_list()
    by_trial = {s["source_trial"]: s for s in skills}
    assert set(by_trial) == {"p28_r1_solo_cutedsl", "p28_r1_solo_tirx"}
    # two unverified attempts are two failures: neutral; the reverse direction was not run
    assert by_trial["p28_r1_solo_cutedsl"]["verdict"] == "neutral"
    assert by_trial["p28_r1_solo_tirx"]["verdict"] == "unresolved"
    assert by_trial["p28_r1_solo_cutedsl"]["text"] == (run / "trials" / "p28_r1_solo_cutedsl" / "SKILL.md").read_text()
