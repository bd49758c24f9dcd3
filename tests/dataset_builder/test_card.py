"""The card as the Hub reads it: valid YAML front matter, configs listed, licences, columns, changelog."""

from pathlib import Path

import datasets
import pytest
import yaml
from huggingface_hub import DatasetCard

from dataset_builder.features import config_specs
from mkb_eval import problems as P
from mkb_eval.dataset import read_manifest
from tests.dataset_builder.conftest import IDS, Built


def test_the_hub_card_parser_reads_configs_licence_and_version(built: Built):
    card = DatasetCard.load(built.out / "README.md")
    data = card.data.to_dict()
    assert [c["config_name"] for c in data["configs"]] == list(config_specs())
    assert data["configs"][0].get("default") is True and sum(bool(c.get("default")) for c in data["configs"]) == 1
    assert data["license"] == "apache-2.0" and data["pretty_name"] == "MetaKernelBench"
    assert data["dataset_version"] == "1.0.0" == read_manifest(built.out)["dataset_version"]
    for c in data["configs"]:
        spec = config_specs()[c["config_name"]]
        assert c["data_files"] == [{"split": spec.split, "path": f"{spec.name}/{spec.split}-*.parquet"}]
    assert card.text.lstrip().startswith("# MetaKernelBench")


def test_datasets_sees_the_same_configs_and_splits(built: Built):
    assert datasets.get_dataset_config_names(str(built.out)) == list(config_specs())
    for name, spec in config_specs().items():
        assert datasets.get_dataset_split_names(str(built.out), name) == [spec.split]


def test_the_body_lists_licences_columns_loading_and_changelog(built: Built):
    text = (built.out / "README.md").read_text()
    body = text.split("\n---\n", 1)[1]
    for i in IDS:
        p = P.find(i)
        assert f"| {p.id:02d} | {p.name} | {p.family} | {p.dtype} | {p.license} |" in body
    for name, spec in config_specs().items():
        assert f"### `{name}`" in body
        for col in spec.columns:
            assert f"| `{col}` |" in body, (name, col)
        assert f"| `{name}` | {spec.split} | {built.result.rows[name]} |" in body
    assert 'load_dataset("MetaKernelBench/metakernelbench", "problems", split="test", revision="v1.0.0")' in body
    assert "### 1.0.0\n\n- initial release: 4 problems" in body
    assert "arXiv:2610.05014" in body and "$" not in body.replace("$ ", "")   # every placeholder filled


def test_the_front_matter_is_plain_yaml(built: Built):
    text = (built.out / "README.md").read_text()
    front = yaml.safe_load(text[4:text.index("\n---\n", 4)])
    assert isinstance(front, dict) and set(front) >= {"configs", "license", "dataset_version", "pretty_name"}


def test_configs_yaml_and_features_cannot_drift(monkeypatch, tmp_path: Path):
    from dataset_builder import features as F
    from dataset_builder.errors import BuildError

    bad = tmp_path / "configs.yaml"
    bad.write_text(F.SCHEMA_FILE.read_text().replace("    docstring: one-line docstring of reference.py\n", ""))
    monkeypatch.setattr(F, "SCHEMA_FILE", bad)
    F.config_specs.cache_clear()
    try:
        with pytest.raises(BuildError, match=r"'problems' columns differ .* \(undocumented \['docstring'\]"):
            F.config_specs()
    finally:
        F.config_specs.cache_clear()


def test_the_card_declares_features_sources_authors_and_measurements(built: Built):
    card = DatasetCard.load(built.out / "README.md")
    info = {c["config_name"]: c["features"] for c in card.data.to_dict()["dataset_info"]}
    assert list(info) == list(config_specs())
    for name, spec in config_specs().items():
        assert datasets.Features._from_yaml_list(info[name]) == spec.features
    body = card.text
    assert "## Source datasets and licences" in body and "| FlashInfer-Trace workload definitions |" in body
    assert "## Authors" in body and "@misc{metakernelbench_dataset" in body
    assert "`h200`: `results/h200/verification.jsonl`" in body


def test_plain_datasets_load_dataset_works_on_the_hub_as_the_card_says(built: Built, fake_hub, tmp_path: Path,
                                                                        monkeypatch):
    from dataset_builder.push import push_dataset

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)       # the fake Hub answers; nothing leaves

    push_dataset(built.out, "MetaKernelBench/metakernelbench", "v1.0.0", push=True, token="hf_test")
    solutions = datasets.load_dataset("MetaKernelBench/metakernelbench", "solutions", split="test", revision="v1.0.0",
                                      cache_dir=str(tmp_path / "c"))
    verified = solutions.filter(lambda r: r["verified"] and r["gpu"] == "h200")
    assert len(verified) == len(solutions) == built.result.rows["solutions"]
    baselines = datasets.load_dataset("MetaKernelBench/metakernelbench", "baselines", split="test", revision="v1.0.0",
                                      cache_dir=str(tmp_path / "c"))
    assert sorted(baselines["problem_id"]) == list(IDS)
    text = (built.out / "README.md").read_text()
    assert ('solutions = load_dataset("MetaKernelBench/metakernelbench", "solutions", split="test", revision="v1.0.0")'
            in text)
