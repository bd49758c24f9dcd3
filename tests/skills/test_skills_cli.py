import json
from pathlib import Path

from mkb_eval.skills.corpus import read_corpus
from tests.mkb_cli import run_mkb


def test_check_flags_the_code_carrying_skill(run_dir: Path, monkeypatch, capsys):
    assert run_mkb(["skills", "check", "--no-corpus", "--runs", str(run_dir)], monkeypatch) == 1
    out = capsys.readouterr().out
    assert "p28_r2_solo_cutedsl: 1 leak finding(s)" in out and "5 skills checked" in out and "1 flagged" in out


def test_check_of_a_clean_corpus_passes(corpus_dir: Path, monkeypatch, capsys):
    assert run_mkb(["skills", "check", "--corpus", str(corpus_dir)], monkeypatch) == 0
    assert "1 skills checked" in capsys.readouterr().out


def test_release_then_index_then_export(run_dir: Path, corpus_dir: Path, tmp_path: Path, monkeypatch, capsys):
    dest = corpus_dir / "run-a"
    assert run_mkb(["skills", "export", "--format", "md", "--no-corpus", "--runs", str(run_dir),
                    "--dataset-version", "1.1.0", "--out", str(dest)], monkeypatch) == 0
    released = read_corpus(corpus_dir)
    assert len(released) == 6 and {s.released_in for s in released} == {"1.0.0", "1.1.0"}
    assert run_mkb(["skills", "index", "--corpus", str(corpus_dir), "--check"], monkeypatch) == 1
    assert run_mkb(["skills", "index", "--corpus", str(corpus_dir)], monkeypatch) == 0
    assert run_mkb(["skills", "index", "--corpus", str(corpus_dir), "--check"], monkeypatch) == 0
    assert "6 skills: 3 helped, 2 harmed, 1 flagged" in (corpus_dir / "README.md").read_text()
    capsys.readouterr()
    out = tmp_path / "dpo.jsonl"
    assert run_mkb(["skills", "export", "--format", "dpo", "--corpus", str(corpus_dir), "--out", str(out)],
                   monkeypatch) == 0
    assert "wrote 1 dpo records" in capsys.readouterr().out
    assert json.loads(out.read_text())["problem_id"] == 28


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys):
    assert run_mkb(["skills", "check", "--no-corpus", "--runs", str(tmp_path)], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("mkb skills check: ") and "not a run folder" in err and err.count("\n") == 1
    assert run_mkb(["skills", "export", "--format", "md", "--no-corpus", "--out", str(tmp_path / "o")],
                   monkeypatch) == 2
    assert "needs --dataset-version" in capsys.readouterr().err
