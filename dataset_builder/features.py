"""The seven configs of the dataset: explicit ``datasets.Features`` plus their documentation.

Features are code (they are the schema the parquet files carry and ``datasets`` reads back);
the split name, the prose description and the description of every column are data in
``schema/configs.yaml``, which the card renders. ``config_specs()`` joins the two and refuses a
column documented but not typed, or typed but not documented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import datasets
import yaml

from dataset_builder.errors import BuildError

V = datasets.Value
L = datasets.List

CONFIG_NAMES = ("problems", "tasks", "solutions", "baselines", "reference_outputs", "attempts", "skills")
SCHEMA_FILE = Path(__file__).resolve().parent / "schema" / "configs.yaml"

_TIMING = {
    "kernel_ms": V("float64"),
    "kernel_device_ms": V("float64"),
    "kernel_cv": V("float64"),
    "eager_ms": V("float64"),
    "compile_ms": V("float64"),
    "speedup": V("float64"),
    "speedup_vs_compile": V("float64"),
    "sol_ms": V("float64"),
    "sol_fraction": V("float64"),
}

_JSON_VALUE = {"integer": "int32", "number": "float64", "string": "string", "boolean": "bool"}


def _feature(name: str, prop: dict[str, Any], record: str) -> Any:
    """The column of one JSON Schema property: a scalar (nullable or not) or a list of scalars."""
    alts = [prop] if "type" in prop else prop.get("anyOf", [])
    alts = [a for a in alts if a.get("type") not in (None, "null")]
    if len(alts) == 1 and alts[0]["type"] == "array":
        return L(_feature(name, alts[0].get("items", {}), record))
    if len(alts) != 1 or alts[0]["type"] not in _JSON_VALUE:
        raise BuildError(f"{record} field {name!r} has no single scalar JSON type ({prop}); "
                         "it cannot be a dataset column as it is")
    return V(_JSON_VALUE[alts[0]["type"]])


def _from_schema(schema: dict[str, Any], names: Sequence[str], record: str) -> dict[str, Any]:
    props = schema["properties"]
    return {name: _feature(name, props[name], record) for name in names}


def _from_attempt_record(*names: str) -> dict[str, Any]:
    """Columns copied from the attempt record, typed from its exported JSON Schema
    (:mod:`mkb_eval.attempt_record`): a field whose type changes there changes the column with it."""
    from mkb_eval.attempt_record import json_schema

    return _from_schema(json_schema(), names, "attempt record")


def _from_skill_row() -> dict[str, Any]:
    """Every column of the skills config but ``dataset_version``, in order, typed from the skill row's
    schema (:class:`mkb_eval.skill_record.SkillRow`, which the builder validates each row against)."""
    from mkb_eval.skill_record import row_schema

    schema = row_schema()
    return _from_schema(schema, list(schema["properties"]), "skill row")


FEATURES: dict[str, datasets.Features] = {
    "problems": datasets.Features({
        "problem_id": V("int32"),
        "problem": V("string"),
        "slug": V("string"),
        "family": V("string"),
        "dtype": V("string"),
        "description": V("string"),
        "docstring": V("string"),
        "reference_path": V("string"),
        "reference_source": V("string"),
        "problem_yaml": V("string"),
        "sizes_json": V("string"),
        "tolerance_factor": V("float64"),
        "mutates": L(V("int32")),
        "provenance_source": V("string"),
        "provenance_notes": V("string"),
        "license": V("string"),
        "sol_flops": V("float64"),
        "sol_bytes": V("float64"),
        "sol_rate": V("string"),
        "sol_bound": V("string"),
        "sol_ms": V("float64"),
        "solution_dsls": L(V("string")),
        "problem_hash": V("string"),
        "fingerprint": V("string"),
        "dataset_version": V("string"),
    }),
    "tasks": datasets.Features({
        "task_id": V("string"),
        "problem_id": V("int32"),
        "problem": V("string"),
        "dsl": V("string"),
        "prompt": V("string"),
        "prompt_sha256": V("string"),
        "prompt_version": V("string"),
        "problem_hash": V("string"),
        "dataset_version": V("string"),
    }),
    "solutions": datasets.Features({
        "problem_id": V("int32"),
        "problem": V("string"),
        "dsl": V("string"),
        "kernel_path": V("string"),
        "kernel_source": V("string"),
        "kernel_sha256": V("string"),
        "problem_hash": V("string"),
        "gpu": V("string"),
        "gpu_name": V("string"),
        "verified": V("bool"),
        "status": V("string"),
        "message": V("string"),
        "tier": V("string"),
        "size": V("string"),
        **_TIMING,
        "n_timed": V("int32"),
        "draws_passed": V("int32"),
        "created_at": V("string"),
        "env_json": V("string"),
        "record_json": V("string"),
        "note": V("string"),
        "dataset_version": V("string"),
    }),
    "baselines": datasets.Features({
        "problem_id": V("int32"),
        "problem": V("string"),
        "problem_hash": V("string"),
        "gpu": V("string"),
        "gpu_name": V("string"),
        "size": V("string"),
        "eager_ms": V("float64"),
        "compile_ms": V("float64"),
        "compile_note": V("string"),
        "sol_ms": V("float64"),
        "sol_bound": V("string"),
        "cutedsl_kernel_ms": V("float64"),
        "cutedsl_device_ms": V("float64"),
        "tirx_kernel_ms": V("float64"),
        "tirx_device_ms": V("float64"),
        "eager_ms_samples": L(V("float64")),
        "compile_ms_samples": L(V("float64")),
        "n_records": V("int32"),
        "torch_versions": L(V("string")),
        "records_file": V("string"),
        "dataset_version": V("string"),
    }),
    "reference_outputs": datasets.Features({
        "problem_id": V("int32"),
        "problem": V("string"),
        "problem_hash": V("string"),
        "seed": V("int64"),
        "size": V("string"),
        "ok": V("bool"),
        "error": V("string"),
        "structure": V("string"),
        "outputs": L({
            "path": V("string"),
            "dtype": V("string"),
            "shape": L(V("int64")),
            "sha256": V("string"),
            "data": V("binary"),
        }),
        "sha256": V("string"),
        "torch_version": V("string"),
        "cpu_capability": V("string"),
        "num_threads": V("int32"),
        "dataset_version": V("string"),
    }),
    "attempts": datasets.Features({
        "run": V("string"),
        **_from_attempt_record("model", "trial", "problem_id", "problem", "family", "replicate", "arm", "dsl",
                               "direction", "status"),
        "passed": V("bool"),
        **_from_attempt_record("skipped", "speedup", "kernel_ms", "eager_ms", "error", "skill_sha256",
                               "schema_version"),
        "kernel_source": V("string"),
        "kernel_sha256": V("string"),
        "skill_md": V("string"),
        "record_json": V("string"),
        "dataset_version": V("string"),
    }),
    "skills": datasets.Features({
        **_from_skill_row(),
        "dataset_version": V("string"),
    }),
}


@dataclass(frozen=True)
class ConfigSpec:
    """One config: its split, features, prose and per-column documentation, parquet row-group size."""

    name: str
    split: str
    features: datasets.Features
    description: str
    columns: dict[str, str]
    row_group_size: int

    @property
    def data_file(self) -> str:
        """Path of the single parquet shard inside the dataset folder."""
        return f"{self.name}/{self.split}-00000-of-00001.parquet"


@cache
def config_specs() -> dict[str, ConfigSpec]:
    """Every config, in card order; raises BuildError if the schema file and the features disagree."""
    doc = yaml.safe_load(SCHEMA_FILE.read_text(encoding="utf-8"))
    specs: dict[str, ConfigSpec] = {}
    for name in CONFIG_NAMES:
        entry = doc.get(name)
        if not isinstance(entry, dict):
            raise BuildError(f"{SCHEMA_FILE}: no entry for config '{name}'")
        columns = {str(k): str(v).strip() for k, v in (entry.get("columns") or {}).items()}
        typed = list(FEATURES[name])
        if list(columns) != typed:
            missing = [c for c in typed if c not in columns]
            extra = [c for c in columns if c not in typed]
            raise BuildError(f"{SCHEMA_FILE}: config '{name}' columns differ from its features "
                             f"(undocumented {missing}, unknown {extra}, or a different order)")
        specs[name] = ConfigSpec(name=name, split=str(entry["split"]), features=FEATURES[name],
                                 description=str(entry["description"]).strip(), columns=columns,
                                 row_group_size=int(entry.get("row_group_size", 10_000)))
    return specs
