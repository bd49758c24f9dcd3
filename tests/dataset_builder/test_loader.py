"""mkb_eval.load_dataset: a local/packaged copy, the env var, and the Hub at a revision (network faked)."""

from pathlib import Path

import pytest

from dataset_builder.push import push_dataset
from mkb_eval import dataset as D
from tests.dataset_builder.conftest import IDS, Built


def test_local_path_and_env_var(built: Built, tmp_path: Path, monkeypatch):
    ds = D.load_dataset("problems", split="test", path=built.out, cache_dir=str(tmp_path / "c"))
    assert ds["problem_id"] == list(IDS)
    monkeypatch.setenv(D.LOCAL_ENV, str(built.out))
    dd = D.load_dataset("skills", cache_dir=str(tmp_path / "c"))
    assert list(dd) == ["train"] and len(dd["train"]) == built.result.rows["skills"]


def test_no_local_copy_says_how_to_get_one(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(D.LOCAL_ENV, raising=False)
    monkeypatch.setattr(D, "PACKAGED_DIR", tmp_path / "absent")
    with pytest.raises(D.DatasetError, match="no local MetaKernelBench dataset: pass path=, set MKB_DATASET_DIR"):
        D.load_dataset("problems")


def test_the_packaged_copy_is_used_when_present(built: Built, monkeypatch, tmp_path: Path):
    monkeypatch.delenv(D.LOCAL_ENV, raising=False)
    monkeypatch.setattr(D, "PACKAGED_DIR", built.out)
    assert D.local_folder() == built.out
    assert len(D.load_dataset("tasks", split="test", cache_dir=str(tmp_path / "c"))) == 2 * len(IDS)


def test_revision_reads_the_hub_snapshot_then_works_offline_from_the_cache(built: Built, fake_hub, tmp_path: Path,
                                                                          monkeypatch):
    from huggingface_hub import constants

    push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    ds = D.load_dataset("solutions", revision="v1.0.0", split="test", repo_id="org/metakernelbench",
                        cache_dir=str(tmp_path / "c"))
    assert len(ds) == built.result.rows["solutions"] and set(ds["dataset_version"]) == {"1.0.0"}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(fake_hub.requests)
    monkeypatch.setenv(D.REPO_ENV, "org/metakernelbench")
    ds = D.load_dataset("problems", revision="v1.0.0", split="test", cache_dir=str(tmp_path / "c"))
    assert ds["problem_id"] == list(IDS) and len(fake_hub.requests) == n          # served from the Hub cache
    with pytest.raises(D.DatasetError, match=r"org/metakernelbench@v9.9.9: not in the local Hub cache"):
        D.load_dataset("problems", revision="v9.9.9")


def test_hub_errors_are_one_line(fake_hub):
    with pytest.raises(D.DatasetError, match="org/absent: no such dataset repo"):
        D.load_dataset("problems", revision="v1.0.0", repo_id="org/absent")
    with pytest.raises(D.DatasetError, match="needs a namespace"):
        D.load_dataset("problems", revision="v1.0.0", repo_id="metakernelbench")
    with pytest.raises(D.DatasetError, match="cannot be combined with path="):
        D.load_dataset("problems", revision="v1.0.0", path=".")


def test_unknown_revision(built: Built, fake_hub):
    push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    with pytest.raises(D.DatasetError, match=r"no revision 'v2.0.0'"):
        D.load_dataset("problems", revision="v2.0.0", repo_id="org/metakernelbench")
