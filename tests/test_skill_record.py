"""The typed skill records: every committed corpus file's front matter validates and round-trips, each kind of
bad field is refused with the file and field named (at the reader and at the release writer), the outcome is
built strictly, and the dataset's skills rows and features come from the row model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from mkb_eval import skill_record as S
from mkb_eval.skills.corpus import CORPUS_ROOT, corpus_files, front_matter, read_corpus, render_release, split_front_matter
from mkb_eval.skills.model import Outcome, Skill, SkillError

META = {"model": "m", "problem": 28, "direction": "cutedsl2tirx", "source_verdict": "ok", "sha256": "a" * 64,
        "dataset_version": "1.0.0", "replicate": 1, "source_trial": "p28_r1_solo_cutedsl", "source_speedup": 7.0,
        "outcome": {"verdict": "helped", "skill_trial": "p28_r1_cutedsl2tirx_skill", "skill_status": "ok",
                    "skill_speedup": 8.0}}


def _committed() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, split_front_matter(p.read_text(encoding="utf-8"), str(p))[0]) for p in corpus_files(CORPUS_ROOT)]


def test_committed_front_matter_validates_and_round_trips():
    files = _committed()
    assert len(files) >= 74
    for path, raw in files:
        meta = {**raw, "date": raw["date"].isoformat()} if hasattr(raw.get("date"), "isoformat") else raw
        assert S.parse_front_matter(raw, str(path)).to_json() == meta
    assert len(read_corpus()) == len(files)


def test_a_release_reads_back_as_it_was_written():
    s = Skill(origin="run:r/m/p28_r1_solo_cutedsl", model="m", problem_id=28, direction="cutedsl2tirx",
              source_verdict="ok", text="- a\n", replicate=1, source_trial="p28_r1_solo_cutedsl", source_speedup=7.0,
              outcome=Outcome(verdict="helped", skill_trial="p28_r1_cutedsl2tirx_skill", skill_speedup=8.0))
    meta, body = split_front_matter(render_release(s, "1.0.0"), "x")
    fm = S.parse_front_matter(meta)
    assert fm.to_json() == front_matter(s, "1.0.0") == meta and body == s.text
    assert list(meta) == ["model", "problem", "direction", "source_verdict", "sha256", "dataset_version",
                          "replicate", "source_trial", "source_speedup", "provenance", "outcome"]
    assert fm.outcome == s.outcome


@pytest.mark.parametrize("over, match", [
    ({"colour": "red"}, r"colour: Extra inputs are not permitted"),
    ({"problem": "28"}, r"problem: Input should be a valid integer"),
    ({"problem": 100}, r"problem: Input should be less than or equal to 99"),
    ({"direction": "cuda2tirx"}, r"direction: Input should be"),
    ({"source_verdict": "fast"}, r"source_verdict: Input should be"),
    ({"sha256": "abc"}, r"sha256: String should match pattern"),
    ({"dataset_version": "v1"}, r"dataset_version: String should match pattern"),
    ({"source_trial": "p28_r1_cutedsl2tirx_skill"}, r"source_trial: String should match pattern"),
    ({"source_speedup": 0.0}, r"source_speedup: Input should be greater than 0"),
    ({"replicate": None}, r"replicate: null \(leave an unknown key out\)"),
    ({"outcome": {"verdict": "won"}}, r"outcome.verdict: Input should be"),
    ({"outcome": {"verdict": "helped", "skill_status": None}}, r"outcome.skill_status: null"),
    ({"outcome": {"verdict": "helped", "extra": 1}}, r"outcome.extra: Extra inputs are not permitted"),
])
def test_a_bad_front_matter_field_is_refused_and_named(over: dict[str, Any], match: str):
    with pytest.raises(ValueError, match=r"^x.md: front matter: .*" + match):
        S.parse_front_matter({**META, **over}, "x.md")


def test_a_missing_key_and_a_non_mapping_are_refused():
    with pytest.raises(ValueError, match=r"sha256: Field required"):
        S.parse_front_matter({k: v for k, v in META.items() if k != "sha256"})
    with pytest.raises(ValueError, match=r"Input should be a valid dictionary"):
        S.parse_front_matter(["model"])


def test_the_writer_refuses_what_the_reader_would():
    s = Skill(origin="o", model="m", problem_id=28, direction="tirx2cutedsl", source_verdict="fine", text="- a\n")
    with pytest.raises(SkillError, match=r"^o: cannot release: source_verdict: Input should be"):
        render_release(s, "1.0.0")
    with pytest.raises(ValidationError, match="verdict"):
        Outcome(verdict="won")
    with pytest.raises(ValidationError, match="skill_speedup"):
        Outcome(verdict="helped", skill_speedup="8")          # type: ignore[arg-type]
    o = Outcome(verdict="helped")
    with pytest.raises(ValidationError, match="frozen"):
        o.verdict = "harmed"                                   # type: ignore[misc]


def _row(**over: Any) -> dict[str, Any]:
    row = {"skill_id": "0" * 16, "origin": "o", "model": "m", "problem_id": 28, "problem": "x",
           "direction": "cutedsl2tirx", "source_dsl": "cutedsl", "target_dsl": "tirx", "replicate": None,
           "source_trial": None, "source_verdict": "ok", "source_speedup": None, "text": "- a\n", "sha256": "a" * 64,
           "verdict": "unresolved", "skill_trial": None, "skill_status": None, "skill_speedup": None,
           "base_status": None, "base_speedup": None, "leak_flags": [], "released_in": None}
    return {**row, **over}


def test_skill_rows_are_strict():
    assert S.parse_row(_row()).to_json() == _row()
    with pytest.raises(ValueError, match=r"^w: not a valid skills row: colour: Extra inputs"):
        S.parse_row(_row(colour=1), "w")
    with pytest.raises(ValueError, match=r"leak_flags: Input should be a valid list"):
        S.parse_row(_row(leak_flags="code"))
    with pytest.raises(ValueError, match=r"released_in: Field required"):
        S.parse_row({k: v for k, v in _row().items() if k != "released_in"})


def test_the_dataset_skill_rows_are_built_through_the_model(run_dir: Path):
    from dataset_builder.errors import BuildError
    from dataset_builder.sources.runs import skill_rows
    from mkb_eval.skills.runs import read_run

    rows = skill_rows(read_corpus(), [read_run(run_dir)], [])
    assert len(rows) > 74 and all(S.parse_row(r).to_json() == r for r in rows)
    bad = Skill(origin="o", model="m", problem_id=28, direction="tirx2cutedsl", source_verdict="fine", text="- a\n")
    with pytest.raises(BuildError, match=r"skill o: not a valid skills row: source_verdict"):
        skill_rows([bad], [], [])


def test_the_skills_features_come_from_the_row_schema():
    from dataset_builder.features import FEATURES

    f = FEATURES["skills"]
    assert list(f) == list(S.row_schema()["properties"]) + ["dataset_version"]
    assert {k: f[k].dtype for k in ("problem_id", "replicate", "source_speedup", "verdict", "text")} == {
        "problem_id": "int32", "replicate": "int32", "source_speedup": "float64", "verdict": "string", "text": "string"}
    assert f["leak_flags"].feature.dtype == "string"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    from tests.skills.runfolder import write_run

    return write_run(tmp_path / "run-a")


def test_yaml_dates_are_read_as_the_string_written():
    meta = yaml.safe_load("date: 2026-11-30\n")
    assert S.parse_front_matter({**META, **meta}).date == "2026-11-30"
