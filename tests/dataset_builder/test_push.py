"""Push with huggingface_hub against an in-memory Hub (only the HTTP transport is fake)."""

from pathlib import Path

import pytest

from dataset_builder.errors import BuildError
from dataset_builder.push import plan_push, push_dataset
from tests.dataset_builder.conftest import Built


def test_a_dry_run_touches_no_network(built: Built, fake_hub):
    plan = push_dataset(built.out, "org/metakernelbench", "v1.0.0")
    assert fake_hub.requests == [] and not plan.pushed and plan.commit is None
    assert plan.files[:2] == ("README.md", "manifest.json") and len(plan.files) == 2 + len(built.result.files)
    assert "dry run; add --push to upload" in plan.describe()


def test_push_uploads_the_planned_files_and_tags_that_commit(built: Built, fake_hub):
    plan = push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    repo = fake_hub.repos["org/metakernelbench"]
    oid, files = repo.commits[-1]
    assert plan.pushed and plan.commit == oid and repo.tags == {"v1.0.0": oid}
    assert sorted(files) == sorted(plan.files)
    assert all(files[f] == (built.out / f).read_bytes() for f in plan.files)
    assert ("POST", "/api/datasets/org/metakernelbench/tag/" + oid) in fake_hub.requests


def test_a_release_is_immutable(built: Built, fake_hub):
    push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    n = len(fake_hub.repos["org/metakernelbench"].commits)
    with pytest.raises(BuildError, match=r"already has tag v1.0.0; a release is immutable"):
        push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    assert len(fake_hub.repos["org/metakernelbench"].commits) == n


def test_stale_parquet_of_a_dropped_config_is_deleted(built: Built, fake_hub, copy_of: Path):
    from dataclasses import replace

    from dataset_builder.build import build_dataset

    push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    smaller = build_dataset(replace(built.options, out=copy_of, version="1.1.0", previous=built.out,
                                    configs=("problems", "tasks", "solutions", "baselines", "reference_outputs",
                                             "skills")))
    assert "attempts" not in smaller.rows
    push_dataset(copy_of, "org/metakernelbench", "v1.1.0", push=True, token="hf_test")
    repo = fake_hub.repos["org/metakernelbench"]
    assert not any(p.startswith("attempts/") for p in repo.commits[-1][1])
    assert any(p.startswith("attempts/") for p in repo.files_at("v1.0.0")[1])   # the old release keeps it


def test_plan_faults(built: Built, copy_of: Path):
    with pytest.raises(BuildError, match="must be '<org>/<name>'"):
        plan_push(built.out, "metakernelbench", "v1.0.0")
    with pytest.raises(BuildError, match=r"tag 'v1.0.1' does not match the folder's dataset_version 1.0.0"):
        plan_push(built.out, "org/metakernelbench", "v1.0.1")
    f = copy_of / "skills" / "train-00000-of-00001.parquet"
    f.write_bytes(f.read_bytes() + b"x")
    with pytest.raises(BuildError, match=r"skills/train-00000-of-00001.parquet"):
        plan_push(copy_of, "org/metakernelbench", "v1.0.0")


def test_offline_push_is_refused_clearly(built: Built, fake_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(BuildError, match="HF_HUB_OFFLINE is set"):
        push_dataset(built.out, "org/metakernelbench", "v1.0.0", push=True, token="hf_test")
    assert "org/metakernelbench" not in fake_hub.repos
