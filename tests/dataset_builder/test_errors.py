"""A damaged folder or bad input gives one clear line naming the file, and never a half-written build."""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dataset_builder.build import BuildOptions, build_dataset
from dataset_builder.errors import BuildError
from mkb_eval.dataset import DatasetError, check_folder, load_dataset, read_manifest
from tests.dataset_builder.conftest import Built
from tests.helpers import attempt


def test_a_truncated_parquet_is_named(copy_of: Path, tmp_path: Path):
    f = copy_of / "problems" / "test-00000-of-00001.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(DatasetError, match=r"problems/test-00000-of-00001.parquet: not a readable parquet file "
                                           r"\(truncated or corrupt"):
        load_dataset("problems", path=copy_of, cache_dir=str(tmp_path / "c"))


def test_a_card_whose_config_points_nowhere_is_named(copy_of: Path, tmp_path: Path):
    card = copy_of / "README.md"
    card.write_text(card.read_text().replace("path: tasks/test-*.parquet", "path: tasks/nothing-*.parquet"))
    with pytest.raises(DatasetError, match=r"README.md: config 'tasks' split 'test' points to "
                                           r"'tasks/nothing-\*.parquet', which matches no file"):
        load_dataset("problems", path=copy_of, cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("card, message", [
    (None, "missing dataset card"),
    ("# no front matter\n", "must start with a YAML front matter"),
    ("---\nconfigs: [\n", "not closed by a '---' line"),
    ("---\nconfigs: [\n---\n", "invalid YAML front matter"),
    ("---\nlicense: mit\n---\n", "has no 'configs:' list"),
    ("---\nconfigs:\n- data_files: x\n---\n", "needs a config_name"),
    ("---\nconfigs:\n- config_name: a\n  data_files:\n  - split: t\n    path: /etc/passwd\n---\n", "absolute path"),
    ("---\nconfigs:\n- config_name: a\n  data_files:\n  - split: t\n    path: ../outside.parquet\n---\n",
     "points outside the folder"),
])
def test_card_faults(copy_of: Path, card: str | None, message: str):
    (copy_of.parent / "outside.parquet").write_bytes(b"")
    if card is None:
        (copy_of / "README.md").unlink()
    else:
        (copy_of / "README.md").write_text(card)
    with pytest.raises(DatasetError, match=message):
        check_folder(copy_of)


def test_a_rewritten_but_readable_file_fails_the_hash_check(copy_of: Path):
    f = copy_of / "baselines" / "test-00000-of-00001.parquet"
    t = pq.read_table(f)
    pq.write_table(t.slice(0, 1), f)
    check_folder(copy_of)                                         # still a readable folder...
    with pytest.raises(DatasetError, match=r"sha256 differs from manifest.json"):
        check_folder(copy_of, verify_hashes=True)                 # ...but not the one that was built


def test_unknown_config_and_split(built: Built, tmp_path: Path):
    with pytest.raises(DatasetError, match="no config 'nope'; configs: problems, tasks"):
        load_dataset("nope", path=built.out)
    with pytest.raises(DatasetError, match="config 'skills' has no split 'test'; splits: train"):
        load_dataset("skills", split="test", path=built.out)


def test_an_empty_config_is_left_out_and_explained(tmp_path: Path):
    out = tmp_path / "metakernelbench"
    build_dataset(BuildOptions(out=out, version="0.1.0", configs=("problems", "attempts"), problem_ids=(28,)))
    assert read_manifest(out)["empty_configs"] == ["attempts"] and not (out / "attempts").exists()
    assert "No rows in this version (so not declared above): `attempts`." in (out / "README.md").read_text()
    with pytest.raises(DatasetError, match="no config 'attempts' \\(it has no rows in this version\\)"):
        load_dataset("attempts", path=out)


def test_build_input_faults(tmp_path: Path, built: Built):
    out = tmp_path / "metakernelbench"
    cases = [
        (dict(version="1.0"), "not semver"),
        (dict(version="1.0.0", configs=("problems", "bogus")), "unknown config"),
        (dict(version="1.0.0", configs=("tasks",)), "'problems' config is always built"),
        (dict(version="1.0.0", problem_ids=(28, 98)), r"no problem\(s\) \[98\]"),
        (dict(version="1.0.0", previous=tmp_path), "--previous: .*manifest.json: missing"),
        (dict(version="1.0.0", configs=("problems", "solutions"), results_root=tmp_path / "none"),
         "results folder not found"),
        (dict(version="1.0.0", configs=("problems", "attempts"), runs=(tmp_path,)), "not a run folder"),
    ]
    for kw, message in cases:
        with pytest.raises(BuildError, match=message):
            build_dataset(BuildOptions(out=out, **kw))
        assert not out.exists()
    assert list(tmp_path.iterdir()) == []                         # no staging folder left anywhere


def test_a_failed_rebuild_keeps_the_previous_build(copy_of: Path, tmp_path: Path):
    before = {p: p.read_bytes() for p in copy_of.rglob("*") if p.is_file()}
    run = tmp_path / "bad-run"
    run.mkdir()
    (run / "attempts.jsonl").write_text(json.dumps(attempt("p28_r1_solo_tirx", "ok", 2.0)) + '\n{"torn')
    with pytest.raises(BuildError, match=r"attempts.jsonl:2: malformed JSON"):
        build_dataset(BuildOptions(out=copy_of, version="1.0.1", configs=("problems", "attempts"), problem_ids=(28,),
                                   runs=(run,), previous=copy_of))
    assert {p: p.read_bytes() for p in copy_of.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in copy_of.parent.iterdir()) == ["bad-run", "metakernelbench"]


def test_refuses_to_replace_a_folder_that_is_not_a_build(tmp_path: Path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(BuildError, match="not empty and not an earlier build"):
        build_dataset(BuildOptions(out=out, version="1.0.0", configs=("problems",), problem_ids=(28,)))
    assert (out / "notes.txt").read_text() == "keep me"


def test_a_torn_verification_record_fails_the_build(tmp_path: Path):
    res = tmp_path / "results" / "h200"
    res.mkdir(parents=True)
    good = (Path(__file__).resolve().parents[2] / "results" / "h200" / "verification.jsonl").read_text().splitlines()[0]
    (res / "verification.jsonl").write_text(good + "\n" + good[:50] + "\n")
    with pytest.raises(BuildError, match=r"verification.jsonl:2: not JSON .*fix the set"):
        build_dataset(BuildOptions(out=tmp_path / "o", version="1.0.0", configs=("problems", "solutions"),
                                   problem_ids=(28,), results_root=tmp_path / "results"))


def test_records_of_another_kernel_are_not_joined(tmp_path: Path):
    from dataset_builder.sources.verification import read_results, solution_rows
    from mkb_eval import problems as P

    res = tmp_path / "results" / "h200"
    res.mkdir(parents=True)
    p = P.find(28)
    from mkb_eval.records import Env, Timing, VerificationRecord

    rec = VerificationRecord(status="ok", problem_id=28, problem=p.name, problem_hash=p.hash, dsl="tirx",
                             kernel_sha256="f" * 64, tier="gpu", size="full", env=Env(gpu="NVIDIA H200"),
                             timing=Timing(kernel_ms=0.1)).to_dict()
    (res / "verification.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "tier": "cpu"}) + "\n")
    rows = [r for r in solution_rows([p], read_results(tmp_path / "results")) if r["dsl"] == "tirx"]
    assert len(rows) == 1 and rows[0]["verified"] is False and rows[0]["gpu"] is None
    assert rows[0]["note"] == ("no GPU verification record for this kernel and problem version "
                               "(1 record(s) of other kernel or problem versions not used)")
    shutil.rmtree(tmp_path / "results")
