from pathlib import Path

import pytest

from mkb_eval.skills.corpus import CORPUS_ROOT, read_corpus
from mkb_eval.skills.index import render_index, update_readme
from mkb_eval.skills.model import SkillError


def test_the_committed_corpus_index_is_current():
    _, changed = update_readme(CORPUS_ROOT / "README.md", read_corpus(CORPUS_ROOT))
    assert not changed, "skills_corpus/README.md index is stale: run `mkb skills index`"


def test_index_lists_every_skill(corpus_dir: Path):
    skills = read_corpus(corpus_dir)
    text, changed = update_readme(corpus_dir / "README.md", skills)
    assert changed and "old" not in text and text.startswith("# corpus\n")
    assert "1 skills: 1 helped, 0 harmed, 0 flagged" in text
    assert "| [maintainers/p36_tirx2cutedsl_maintainers-hand-written_r1.md]" in text
    assert render_index(skills) in text


def test_readme_without_markers_is_an_error(tmp_path: Path):
    (tmp_path / "README.md").write_text("# no markers\n")
    with pytest.raises(SkillError, match="needs exactly one index block"):
        update_readme(tmp_path / "README.md", [])
