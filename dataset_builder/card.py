"""The dataset card: YAML front matter (configs, licence, version) + the template ``templates/card.md``.

The YAML is generated from the config specs, so the configs the card declares are exactly the
files the build wrote; the prose is a data file filled with ``string.Template``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Template
from typing import Any

import re

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


AUTHORS = "the MetaKernelBench maintainers"
_ORIGINS = (
    (re.compile(r"^FlashInfer-Trace\b"), "FlashInfer-Trace workload definitions",
     "operator definitions and captured workload geometries"),
    (re.compile(r"^vLLM\b"), "vLLM kernels and their tests", "kernel semantics and test geometries"),
    (re.compile(r"^flash-linear-attention\b"), "flash-linear-attention reference recurrences",
     "naive reference recurrences, test input construction and head geometries"),
    (re.compile(r"^Public\b"), "public model configurations and architectures",
     "released model configs and architecture descriptions (sizes, heads, experts, quantization formats)"),
)


def provenance_origin(source: str) -> tuple[str, str]:
    """The source dataset a problem's provenance names, and what was taken from it."""
    for pattern, origin, what in _ORIGINS:
        if pattern.search(source.strip()):
            return origin, what
    return "other public descriptions", "workloads named by the original benchmark, on public geometries"


def _source_licenses(source: str) -> list[str]:
    return sorted(set(re.findall(r"\b(Apache-2\.0|MIT|BSD-[23]-Clause|CC-BY-[0-9.]+|Llama[ -]?\d[^,;)]*License)\b",
                                 source)))


def sources_table(problems: Sequence[Mapping[str, Any]]) -> str:
    """Source datasets grouped from each problem's provenance, with the licences named there and of the problems."""
    groups: dict[str, dict[str, Any]] = {}
    for p in problems:
        origin, what = provenance_origin(str(p["provenance_source"]))
        g = groups.setdefault(origin, {"what": what, "ids": [], "source_licenses": set(), "licenses": set()})
        g["ids"].append(int(p["problem_id"]))
        g["source_licenses"].update(_source_licenses(str(p["provenance_source"])))
        g["licenses"].add(str(p["license"]))
    rows = [(origin, g["what"], len(g["ids"]), ", ".join(f"{i:02d}" for i in sorted(g["ids"])),
             ", ".join(sorted(g["source_licenses"])) or "not stated (facts of a public release)",
             ", ".join(sorted(g["licenses"])))
            for origin, g in sorted(groups.items(), key=lambda kv: -len(kv[1]["ids"]))]
    return _table(["source", "what was taken", "problems", "ids", "licence named in the provenance",
                   "licence of the problems"], rows)


def dataset_info(specs: Sequence[ConfigSpec]) -> list[dict[str, Any]]:
    """The card's ``dataset_info`` block: every written config's features, as the Hub and ``datasets`` read them."""
    return [{"config_name": s.name, "features": s.features._to_yaml_list()} for s in specs]


def card_yaml(specs: Sequence[ConfigSpec], version: str, licenses: Sequence[str]) -> dict[str, Any]:
    """The front matter mapping: Hub metadata, the features of every written config, one ``configs:`` entry each."""
    distinct = sorted(set(licenses))
    meta: dict[str, Any] = {
        "pretty_name": "MetaKernelBench",
        "dataset_version": version,
        "license": HUB_LICENSES.get(distinct[0], "other") if len(distinct) == 1 else "other",
        "language": ["en"],
        "task_categories": ["text-generation"],
        "tags": ["gpu-kernels", "code", "benchmark", "cute-dsl", "tvm", "tirx", "knowledge-transfer"],
        "size_categories": ["n<1K"],
        "source_datasets": ["original"],
        "dataset_info": dataset_info(specs),
        "configs": [],
    }
    for i, spec in enumerate(specs):
        entry: dict[str, Any] = {"config_name": spec.name}
        if i == 0:
            entry["default"] = True
        entry["data_files"] = [{"split": spec.split, "path": f"{spec.name}/{spec.split}-*.parquet"}]
        meta["configs"].append(entry)
    return meta


def verification_text(verification: Mapping[str, Any] | None) -> str:
    """Where the solutions' and baselines' measurements come from, per GPU model."""
    if not verification:
        return "No GPU verification set was given to this build: every solution is listed with `verified = false`."
    lines = []
    for gpu, v in sorted(verification.items()):
        chosen = str(v.get("chosen") or "?").split("@")[0]
        commit = v.get("history_commit")
        lines.append(f"- `{gpu}`: `{v['file']}` (sha256 `{v['sha256'][:16]}…`), the full sweep `{chosen}`"
                     + (f" of toolkit commit `{commit[:12]}`" if commit else "") + ", chosen as the newest sweep whose "
                     "records match every shipped kernel's sha256 and problem hash.")
    return "\n".join(lines)


def render_card(specs: Sequence[ConfigSpec], rows: Mapping[str, int], version: str, hub_repo: str,
                problems: Sequence[Mapping[str, Any]], changelog: Sequence[Mapping[str, Any]],
                empty: Sequence[str] = (), verification: Mapping[str, Any] | None = None) -> str:
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
        columns_sections="\n\n".join(sections), changelog="\n\n".join(log), sources_table=sources_table(problems),
        authors=AUTHORS, verification=verification_text(verification))
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
