"""Prompts as versioned data: manifest hashes, rendering, the skill arm's only difference."""

from __future__ import annotations

import re

import pytest

from mkb_eval import problems as P
from mkb_eval.agent import prompts


def test_manifest_records_every_file_hash_and_version() -> None:
    assert prompts.check_manifest() == []
    assert re.fullmatch(r"\d+\.\d+\.\d+", prompts.set_version())


@pytest.mark.parametrize("dsl", ["cutedsl", "tirx"])
def test_render_task(dsl: str) -> None:
    prob = P.find(28)
    r = prompts.render_task(prob, dsl)
    assert r.sha256 == __import__("hashlib").sha256(r.text.encode()).hexdigest()
    assert r.version == prompts.set_version()
    assert prob.reference_source.strip() in r.text and prob.description.strip() in r.text
    assert prompts.load(f"card_{dsl}").body.strip() in r.text
    assert f"{prob.name}_{dsl}" in r.text and "sm_90a" in r.text
    assert "<kernel.py>" in r.text and "<SKILL.md>" in r.text
    assert not re.search(r"\$\{?[a-z_]+\}?", r.text.replace(prob.reference_source, "")), "unfilled placeholder"
    assert set(r.parts) == {"task", "skill_instructions", f"card_{dsl}"}
    other = "tirx" if dsl == "cutedsl" else "cutedsl"
    assert prompts.load(f"card_{other}").body.strip() not in r.text


def test_tasks_differ_only_by_dsl_parts() -> None:
    a, b = (prompts.render_task(P.find(36), d).text for d in ("cutedsl", "tirx"))
    strip = [prompts.load("card_cutedsl").body.strip(), prompts.load("card_tirx").body.strip(), "CuTe DSL", "TIRx",
             "_cutedsl`", "_tirx`"]
    for s in strip:
        a, b = a.replace(s, ""), b.replace(s, "")
    assert a == b


def test_skill_task_is_the_task_plus_the_attachment() -> None:
    base = prompts.render_task(P.find(28), "tirx")
    s = prompts.render_skill_task(base, "  - loads of 16 bytes per thread doubled bandwidth\n")
    assert s.text.startswith(base.text)
    tail = s.text[len(base.text):]
    assert tail == "\n" + prompts.skill_attachment("- loads of 16 bytes per thread doubled bandwidth")
    assert tail.startswith("\n## Skill from a prior attempt\n\n")
    assert tail.rstrip().endswith("- loads of 16 bytes per thread doubled bandwidth")
    assert s.sha256 != base.sha256 and "skill_header" in s.parts


def test_malformed_prompt_files_are_named() -> None:
    with pytest.raises(prompts.PromptError, match="prompts/x.md: must start with"):
        prompts.parse_prompt_file("x", "x.md", "no front matter")
    with pytest.raises(prompts.PromptError, match="version must be a positive integer"):
        prompts.parse_prompt_file("x", "x.md", "---\nname: x\nversion: one\n---\nbody")
    with pytest.raises(prompts.PromptError, match="unknown DSL 'cuda'"):
        prompts.render_task(P.find(28), "cuda")
    with pytest.raises(prompts.PromptError, match="no value for placeholder 'n_submissions'"):
        prompts.fill("feedback", k=1)
