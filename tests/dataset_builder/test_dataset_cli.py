"""``mkb dataset build|check|push`` through the mkb parser, as the maintainer's hook registers them."""

import json
from pathlib import Path

from mkb_eval.dataset import read_manifest
from tests.dataset_builder.conftest import Built
from tests.mkb_cli import run_mkb


def test_build_check_and_dry_run_push(tmp_path: Path, monkeypatch, capsys):
    out = tmp_path / "ds" / "metakernelbench"
    rc = run_mkb(["dataset", "build", "--out", str(out), "--version", "0.1.0", "--problems", "28,36",
                  "--configs", "problems,solutions,baselines,reference_outputs", "--seeds", "0"], monkeypatch)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "built MetaKernelBench 0.1.0" in text and "reference_outputs       2 rows" in text
    assert read_manifest(out)["sources"]["seeds"] == [0]
    assert run_mkb(["dataset", "check", str(out), "--reference-outputs"], monkeypatch) == 0
    assert "reference_outputs: 2/2 rows reproduced on this CPU" in capsys.readouterr().out
    assert run_mkb(["dataset", "push", "--repo", "org/metakernelbench", "--tag", "v0.1.0", "--folder", str(out)],
                   monkeypatch) == 0
    assert "would push (dry run; add --push to upload)" in capsys.readouterr().out


def test_check_reports_a_hash_that_does_not_reproduce(tmp_path: Path, monkeypatch, capsys):
    import pyarrow.parquet as pq

    out = tmp_path / "metakernelbench"
    assert run_mkb(["dataset", "build", "--out", str(out), "--version", "0.1.0", "--problems", "36",
                    "--configs", "problems,reference_outputs", "--seeds", "0"], monkeypatch) == 0
    f = out / "reference_outputs" / "test-00000-of-00001.parquet"
    t = pq.read_table(f)
    rows = t.to_pylist()
    rows[0]["sha256"] = "0" * 64
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), f)
    manifest = json.loads((out / "manifest.json").read_text())
    from mkb_eval.dataset import sha256_file

    manifest["configs"]["reference_outputs"]["files"]["reference_outputs/test-00000-of-00001.parquet"] = sha256_file(f)
    (out / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert run_mkb(["dataset", "check", str(out), "--reference-outputs"], monkeypatch) == 1
    assert "MISMATCH problem 36 seed 0: sha256 differs" in capsys.readouterr().out


def test_errors_are_one_line_with_exit_2(built: Built, tmp_path: Path, monkeypatch, capsys):
    assert run_mkb(["dataset", "build", "--out", str(tmp_path / "o"), "--version", "one"], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err == "mkb dataset build: dataset version 'one' is not semver MAJOR.MINOR.PATCH (e.g. 1.0.0)\n"
    assert run_mkb(["dataset", "push", "--repo", "org/x", "--tag", "v9.0.0", "--folder", str(built.out)],
                   monkeypatch) == 2
    assert "mkb dataset push: tag 'v9.0.0' does not match" in capsys.readouterr().err
    assert run_mkb(["dataset", "check", str(tmp_path / "none")], monkeypatch) == 2
    assert "not a dataset folder" in capsys.readouterr().err
    assert run_mkb(["dataset", "build", "--out", str(tmp_path / "o"), "--version", "1.0.0", "--problems", "x"],
                   monkeypatch) == 2
    assert "--problems must be comma-separated integers" in capsys.readouterr().err


def test_the_global_root_option_selects_the_problem_folder(tmp_path: Path, monkeypatch, capsys):
    import shutil

    from mkb_eval import problems as P

    src = P.find(36).path
    shutil.copytree(src, tmp_path / "problems" / src.parent.name / src.name)
    out = tmp_path / "metakernelbench"
    assert run_mkb(["--root", str(tmp_path / "problems"), "dataset", "build", "--out", str(out), "--version", "0.0.1",
                    "--configs", "problems"], monkeypatch) == 0
    assert list(read_manifest(out)["problems"]) == ["36"]
