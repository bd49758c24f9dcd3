import json
from pathlib import Path

import pytest

from mkb_eval import problems as P
from mkb_eval.skills.corpus import read_corpus, schema_errors
from mkb_eval.skills.export import dpo_records, export, sft_records, validate
from mkb_eval.skills.model import SkillError
from mkb_eval.skills.runs import read_run, run_skills
from tests.skills.runfolder import SKILLS


@pytest.fixture
def problems() -> dict[int, P.Problem]:
    return {p.id: p for p in (P.find(28), P.find(36))}


def test_sft_pairs_each_resolved_skill_with_its_outcome(run_dir: Path, corpus_dir: Path, problems, tmp_path: Path):
    skills = read_corpus(corpus_dir) + run_skills(read_run(run_dir))
    out = tmp_path / "sft.jsonl"
    res = export(skills, problems, "sft", out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == list(res.records)
    assert res.left_out == {"outcome unresolved": 1, "flagged by the leak check": 1}
    assert [r["meta"]["origin"] for r in lines] == [
        "corpus:maintainers/p36_tirx2cutedsl_maintainers-hand-written_r1.md",
        "run:run-a/test-org/test-model/p28_r1_solo_cutedsl", "run:run-a/test-org/test-model/p28_r1_solo_tirx",
        "run:run-a/test-org/test-model/p28_r2_solo_tirx"]
    first_run = lines[1]
    assert first_run["completion"] == SKILLS["p28_r1_solo_cutedsl"]
    assert first_run["outcome"] == {"verdict": "helped", "skill_status": "ok", "skill_speedup": 8.0,
                                    "base_status": "ok", "base_speedup": 2.0}
    assert "28_fused_add_rmsnorm" in first_run["prompt"] and "CuTe DSL" in first_run["prompt"]
    assert all(schema_errors(r, "sft") == [] for r in lines)


def test_dpo_pairs_helped_against_harmed_for_the_same_problem_and_direction(run_dir: Path, problems):
    skills = run_skills(read_run(run_dir))
    res = dpo_records(skills, problems)
    assert len(res.records) == 1
    [rec] = res.records
    assert rec["meta"]["direction"] == "tirx2cutedsl" and rec["meta"]["problem_id"] == 28
    assert rec["chosen"] == SKILLS["p28_r2_solo_tirx"] and rec["rejected"] == SKILLS["p28_r1_solo_tirx"]
    assert (rec["meta"]["chosen"]["verdict"], rec["meta"]["rejected"]["verdict"]) == ("helped", "harmed")
    validate(res.records, "dpo")
    with_flagged = dpo_records(skills, problems, include_flagged=True)
    assert len(with_flagged.records) == 2                          # the code-carrying skill is a rejected side
    flagged = next(r for r in with_flagged.records if r["meta"]["direction"] == "cutedsl2tirx")
    assert flagged["meta"]["rejected"]["leak_flags"] == ["code_block@3"]


def test_a_record_that_breaks_the_schema_is_refused_and_nothing_is_written(run_dir: Path, problems, tmp_path: Path,
                                                                          monkeypatch):
    from mkb_eval.skills import export as E

    skills = run_skills(read_run(run_dir))
    good = sft_records(skills, problems)
    broken = [{**good.records[0], "completion": ""}]
    with pytest.raises(SkillError, match=r"sft record 0 .*completion"):
        validate(broken, "sft")
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
