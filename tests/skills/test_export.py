"""Skills exports: typed SFT (prompt/completion and messages) and DPO records in TRL's dataset formats."""

import json
from pathlib import Path

import datasets
import pytest

from mkb_eval import problems as P
from mkb_eval import verification_set as V
from mkb_eval.agent.prompts import render_skill_task, render_task
from mkb_eval.skills.corpus import CORPUS_ROOT, read_corpus, schema_errors
from mkb_eval.skills.export import dpo_records, export, sft_records, transferred_body, validate
from mkb_eval.skills.model import SkillError
from mkb_eval.skills.runs import read_run, run_skills
from tests.skills.runfolder import SKILLS


def task_prompt(p: P.Problem, dsl: str, body: str) -> str:
    return render_skill_task(render_task(p, dsl), body).text


@pytest.fixture
def problems() -> dict[int, P.Problem]:
    return {p.id: p for p in (P.find(28), P.find(36))}


def _load(path: Path) -> datasets.Dataset:
    return datasets.load_dataset("json", data_files=str(path), split="train")


def _null_typed(features) -> list[str]:
    out = []
    for name, f in features.items():
        inner = f.feature if isinstance(f, datasets.List) else f
        if isinstance(inner, dict):
            out += [f"{name}.{k}" for k, v in inner.items() if isinstance(v, datasets.Value) and v.dtype == "null"]
        elif isinstance(inner, datasets.Value) and inner.dtype == "null":
            out.append(name)
    return out


def test_the_maintainers_skills_export_with_their_verified_solutions(tmp_path: Path):
    """apply_skill: skill arm prompt -> the shipped target-DSL solution its curated record verified."""
    probs = {p.id: p for p in P.load_all()}
    evidence = V.match(V.read_set(V.set_path("h200")), V.shipped_hashes(probs.values())).matched
    skills = read_corpus(CORPUS_ROOT)
    out = tmp_path / "sft.jsonl"
    res = export(skills, probs, "sft", out, evidence=evidence, task_prompt=task_prompt)
    assert len(res.records) == len(skills) == 74 and res.left_out == {}
    ds = _load(out)
    assert len(ds) == 74 and _null_typed(ds.features) == []
    assert {"prompt", "completion"} <= set(ds.column_names) and "messages" not in ds.column_names
    for r, s in zip(ds, skills, strict=True):
        p = probs[s.problem_id]
        assert r["task"] == "apply_skill" and r["target_dsl"] == s.target_dsl
        assert r["prompt"] == task_prompt(p, s.target_dsl, transferred_body(s))
        assert "## What transferred" not in r["prompt"] and s.text.split("## What transferred")[0].strip() in r["prompt"]
        assert r["completion"] == f"<kernel.py>\n{p.solution_path(s.target_dsl).read_text().rstrip()}\n</kernel.py>\n"
        rec = evidence[(p.id, s.target_dsl)]
        assert (r["evidence_status"], r["evidence_kernel_sha256"]) == ("ok", rec["kernel_sha256"])
        assert r["evidence_device_ms"] == rec["timing"]["kernel_device_ms"] > 0
    msgs = tmp_path / "messages.jsonl"
    export(skills, probs, "sft-messages", msgs, evidence=evidence, task_prompt=task_prompt)
    dm = _load(msgs)
    assert len(dm) == 74 and _null_typed(dm.features) == [] and "prompt" not in dm.column_names
    assert dm.features["messages"] == datasets.List({"content": datasets.Value("string"), "role": datasets.Value("string")})
    assert [m["role"] for m in dm[0]["messages"]] == ["user", "assistant"]
    assert dm[0]["messages"][0]["content"] == ds[0]["prompt"] and dm[0]["messages"][1]["content"] == ds[0]["completion"]


def test_a_skill_whose_evidence_is_not_verified_is_left_out_with_the_reason(tmp_path: Path):
    probs = {p.id: p for p in P.load_all()}
    skills = [s for s in read_corpus(CORPUS_ROOT) if s.problem_id in (28, 36)]
    evidence = {k: r for k, r in V.match(V.read_set(V.set_path("h200")), V.shipped_hashes(probs.values()))
                .matched.items() if k[0] == 28}
    res = sft_records(skills, probs, evidence=evidence, task_prompt=task_prompt)
    assert [r["problem_id"] for r in res.records] == [28]
    assert res.left_out == {f"outcome unresolved and no verified {skills[1].target_dsl} solution in the h200 set": 1}


def test_sft_write_skill_pairs_each_resolved_skill_with_its_outcome(run_dir: Path, corpus_dir: Path, problems,
                                                                     tmp_path: Path):
    skills = read_corpus(corpus_dir) + run_skills(read_run(run_dir))
    out = tmp_path / "sft.jsonl"
    res = export(skills, problems, "sft", out)                       # no evidence: write_skill only
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == list(res.records)
    assert res.left_out == {"outcome unresolved": 1, "flagged by the leak check": 1}
    assert [r["origin"] for r in lines] == [
        "corpus:maintainers/p36_tirx2cutedsl_maintainers-hand-written_r1.md",
        "run:run-a/test-org/test-model/p28_r1_solo_cutedsl", "run:run-a/test-org/test-model/p28_r1_solo_tirx",
        "run:run-a/test-org/test-model/p28_r2_solo_tirx"]
    first_run = lines[1]
    assert first_run["task"] == "write_skill" and first_run["completion"] == SKILLS["p28_r1_solo_cutedsl"]
    assert (first_run["verdict"], first_run["skill_status"], first_run["skill_speedup"], first_run["base_status"],
            first_run["base_speedup"]) == ("helped", "ok", 8.0, "ok", 2.0)
    assert lines[0]["base_speedup"] == 0.0 and lines[0]["base_status"] == "incorrect"   # failed: 0, never null
    assert first_run["released_in"] == "" and first_run["evidence_gpu"] == ""
    assert "28_fused_add_rmsnorm" in first_run["prompt"] and "CuTe DSL" in first_run["prompt"]
    assert all(schema_errors(r, "sft") == [] for r in lines)
    assert _null_typed(_load(out).features) == []


def test_dpo_pairs_helped_against_harmed_for_the_same_problem_and_direction(run_dir: Path, problems, tmp_path: Path):
    skills = run_skills(read_run(run_dir))
    res = dpo_records(skills, problems)
    assert len(res.records) == 1
    [rec] = res.records
    assert rec["direction"] == "tirx2cutedsl" and rec["problem_id"] == 28
    assert rec["chosen"] == SKILLS["p28_r2_solo_tirx"] and rec["rejected"] == SKILLS["p28_r1_solo_tirx"]
    assert (rec["chosen_verdict"], rec["rejected_verdict"]) == ("helped", "harmed")
    validate(res.records, "dpo")
    with_flagged = dpo_records(skills, problems, include_flagged=True)
    assert len(with_flagged.records) == 2                          # the code-carrying skill is a rejected side
    flagged = next(r for r in with_flagged.records if r["direction"] == "cutedsl2tirx")
    assert flagged["rejected_leak_flags"] == "code_block@3"
    out = tmp_path / "dpo.jsonl"
    export(skills, problems, "dpo", out, include_flagged=True)
    ds = _load(out)
    assert len(ds) == 2 and _null_typed(ds.features) == []
    assert all(ds.features[c] == datasets.Value("string") for c in ("prompt", "chosen", "rejected"))


def test_an_export_that_would_be_empty_is_an_error_that_says_why(tmp_path: Path):
    probs = {p.id: p for p in P.load_all()}
    out = tmp_path / "x.jsonl"
    with pytest.raises(SkillError, match=r"the dpo export would be empty: of 74 skill\(s\), 74 outcome unresolved.*"
                                         r"pass --runs RUN"):
        export(read_corpus(CORPUS_ROOT), probs, "dpo", out)
    with pytest.raises(SkillError, match=r"the sft export would be empty: of 74 skill\(s\), 74 outcome unresolved; "
                                         r"give run folders"):
        export(read_corpus(CORPUS_ROOT), probs, "sft", out)
    assert not out.exists()


def test_a_record_that_breaks_the_schema_or_carries_a_null_is_refused(run_dir: Path, problems, tmp_path: Path,
                                                                      monkeypatch):
    from mkb_eval.skills import export as E

    skills = run_skills(read_run(run_dir))
    good = sft_records(skills, problems)
    with pytest.raises(SkillError, match=r"sft record 0 .*completion"):
        validate([{**good.records[0], "completion": ""}], "sft")
    with pytest.raises(SkillError, match=r"sft record 0 .*skill_status"):
        validate([{**good.records[0], "skill_status": None}], "sft")
    broken = [{**good.records[0], "completion": ""}]
    monkeypatch.setattr(E, "sft_records", lambda *a, **k: E.ExportResult(tuple(broken), {}))
    out = tmp_path / "x.jsonl"
    with pytest.raises(SkillError):
        export(skills, problems, "sft", out)
    assert not out.exists()


def test_unknown_problem_and_format(run_dir: Path, tmp_path: Path):
    skills = run_skills(read_run(run_dir))
    with pytest.raises(SkillError, match="problem 28 is not in the problem set"):
        sft_records(skills, {})
    with pytest.raises(SkillError, match="unknown export format"):
        export(skills, {}, "csv", tmp_path / "x")
