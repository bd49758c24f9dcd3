from pathlib import Path

import pytest

from mkb_eval.skills.corpus import (corpus_files, parse_skill_file, read_corpus, render_release, seal_file,
                                    write_release)
from mkb_eval.skills.model import Skill, SkillError
from tests.skills.conftest import MAINTAINER_SKILL


def test_released_file_round_trips(corpus_dir: Path):
    [skill] = read_corpus(corpus_dir)
    assert skill.text == MAINTAINER_SKILL
    assert skill.origin == "corpus:maintainers/p36_tirx2cutedsl_maintainers-hand-written_r1.md"
    assert (skill.model, skill.problem_id, skill.direction, skill.released_in) == (
        "maintainers/hand-written", 36, "tirx2cutedsl", "1.0.0")
    assert skill.outcome is not None and skill.outcome.verdict == "helped"
    assert [p.name for p in corpus_files(corpus_dir)] == [skill.path.name]   # README is not a skill


def test_edited_text_no_longer_matches_its_sha256(corpus_dir: Path):
    [path] = corpus_files(corpus_dir)
    path.write_text(path.read_text() + "- one more line\n")
    with pytest.raises(SkillError, match=r"sha256 .* differs"):
        read_corpus(corpus_dir)


def test_seal_makes_an_edited_file_valid_again(corpus_dir: Path):
    [path] = corpus_files(corpus_dir)
    path.write_text(path.read_text() + "## What transferred\n- the row-per-warp layout\n")
    digest = seal_file(path)
    [skill] = read_corpus(corpus_dir)
    assert skill.sha256 == digest and skill.text.endswith("- the row-per-warp layout\n")


def test_front_matter_is_validated_against_the_schema(tmp_path: Path):
    bad = tmp_path / "c" / "x.md"
    bad.parent.mkdir()
    bad.write_text("---\nmodel: m\nproblem: 28\ndirection: cuda2tirx\nsource_verdict: ok\n"
                   "sha256: abc\ndataset_version: 1.0\n---\n- text\n")
    with pytest.raises(SkillError) as e:
        parse_skill_file(bad, tmp_path / "c")
    msg = str(e.value)                                                 # the file, then every bad field
    assert "x.md: front matter: direction:" in msg and "sha256: String should match" in msg
    assert "dataset_version: Input should be a valid string" in msg
    bad.write_text("no front matter\n")
    other = tmp_path / "c" / "y.md"
    other.write_text("---\n[unclosed\n")
    with pytest.raises(SkillError) as e:
        read_corpus(tmp_path / "c")
    assert "x.md" in str(e.value) and "y.md" in str(e.value)      # every bad file is listed


def test_release_refuses_to_overwrite_different_content(tmp_path: Path):
    s = Skill(origin="run:r/m/p28_r1_solo_tirx", model="m", problem_id=28, direction="tirx2cutedsl",
              source_verdict="ok", text="- a\n", replicate=1)
    [path] = write_release([s], tmp_path, "1.0.0")
    assert write_release([s], tmp_path, "1.0.0") == [path]          # same content: idempotent
    s2 = Skill(**{**s.__dict__, "text": "- b\n"})
    with pytest.raises(SkillError, match="exists with different content"):
        write_release([s2], tmp_path, "1.0.0")
    assert path.read_text().endswith("- a\n")


def test_release_needs_a_semver_dataset_version():
    s = Skill(origin="o", model="m", problem_id=28, direction="tirx2cutedsl", source_verdict="ok", text="- a\n")
    with pytest.raises(SkillError, match="dataset_version"):
        render_release(s, "v1")
