"""The dataset card: YAML front matter (configs, licence, version) + the template ``templates/card.md``.

The YAML is generated from the config specs, so the configs the card declares are exactly the
files the build wrote; the prose is a data file filled with ``string.Template``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Template
from typing import Any

import yaml

from dataset_builder.features import ConfigSpec

TEMPLATE = Path(__file__).resolve().parent / "templates" / "card.md"
HUB_LICENSES = {"Apache-2.0": "apache-2.0", "MIT": "mit"}


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ").strip()


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def card_yaml(specs: Sequence[ConfigSpec], version: str, licenses: Sequence[str]) -> dict[str, Any]:
    """The front matter mapping: Hub metadata plus one ``configs:`` entry per written config."""
    distinct = sorted(set(licenses))
    meta: dict[str, Any] = {
        "pretty_name": "MetaKernelBench",
        "dataset_version": version,
        "license": HUB_LICENSES.get(distinct[0], "other") if len(distinct) == 1 else "other",
        "language": ["en"],
        "task_categories": ["text-generation"],
        "tags": ["gpu-kernels", "code", "benchmark", "cute-dsl", "tvm", "tirx", "knowledge-transfer"],
        "size_categories": ["n<1K"],
        "configs": [],
    }
    for i, spec in enumerate(specs):
        entry: dict[str, Any] = {"config_name": spec.name}
        if i == 0:
            entry["default"] = True
        entry["data_files"] = [{"split": spec.split, "path": f"{spec.name}/{spec.split}-*.parquet"}]
        meta["configs"].append(entry)
    return meta


def render_card(specs: Sequence[ConfigSpec], rows: Mapping[str, int], version: str, hub_repo: str,
                problems: Sequence[Mapping[str, Any]], changelog: Sequence[Mapping[str, Any]],
                empty: Sequence[str] = ()) -> str:
    """The full README.md of the dataset folder."""
    front = yaml.safe_dump(card_yaml(specs, version, [p["license"] for p in problems]), sort_keys=False,
                           allow_unicode=True)
    configs_table = _table(["config", "split", "rows", "what"],
                           [(f"`{s.name}`", s.split, rows[s.name], s.description) for s in specs])
    license_table = _table(["id", "problem", "family", "dtype", "licence", "provenance"],
                           [(f"{p['problem_id']:02d}", p["problem"], p["family"], p["dtype"], p["license"],
                             p["provenance_source"]) for p in problems])
    if empty:
        configs_table += ("\n\nNo rows in this version (so not declared above): "
                          + ", ".join(f"`{n}`" for n in empty) + ".")
    sections = []
    for s in specs:
        sections.append(f"### `{s.name}`\n\n" + _table(["column", "type", "meaning"], [
            (f"`{c}`", _type_name(s.features[c]), doc) for c, doc in s.columns.items()]))
    log = []
    for e in changelog:
        head = f"### {e['version']}" + (f" (from {e['previous']})" if e.get("previous") else "")
        log.append(head + "\n\n" + "\n".join(f"- {c}" for c in e["changes"]))
    body = Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        version=version, tag=f"v{version}", hub_repo=hub_repo, n_problems=rows.get("problems", len(problems)),
        n_tasks=rows.get("tasks", 2 * len(problems)), configs_table=configs_table, license_table=license_table,
        columns_sections="\n\n".join(sections), changelog="\n\n".join(log))
    return f"---\n{front}---\n\n{body}"


def _type_name(feature: Any) -> str:
    import datasets

    if isinstance(feature, datasets.Value):
        return str(feature.dtype)
    if isinstance(feature, datasets.List):
        return f"list<{_type_name(feature.feature)}>"
    if isinstance(feature, dict):
        return "struct<" + ", ".join(f"{k}: {_type_name(v)}" for k, v in feature.items()) + ">"
    return type(feature).__name__
