"""Every exported JSON Schema is what its model gives now (``python -m mkb_eval.schemas`` regenerates them), and
the schemas accept the committed records their models accept and refuse what the models refuse."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from mkb_eval import run_record as R
from mkb_eval import schemas
from mkb_eval import skill_record as S

ROOT = Path(__file__).resolve().parents[1]


def test_every_committed_schema_is_current():
    files = schemas.schema_files()
    names = sorted(p.name for p in files if p.parent == R.SCHEMAS)
    assert names == ["attempt.schema.json", "baseline.schema.json", "invocation.schema.json", "retime.schema.json",
                     "run.schema.json", "skill.schema.json", "skill_row.schema.json", "verification.schema.json"]
    assert schemas.CORPUS_SKILL_SCHEMA in files
    assert schemas.stale() == [], "regenerate: python -m mkb_eval.schemas"
    assert sorted(p.name for p in R.SCHEMAS.glob("*.json")) == names        # no schema left without its model


def _schema(name: str) -> dict:
    return json.loads((R.SCHEMAS / name).read_text())


def test_the_run_schemas_accept_the_migrated_committed_records():
    for path in ROOT.glob("results/**/retime.jsonl"):
        for rec in R.read_retimes(path):
            jsonschema.validate(rec.to_json(), _schema("retime.schema.json"))
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({**rec.to_json(), "tier": "tpu"}, _schema("retime.schema.json"))
    for path in ROOT.glob("results/**/invocations.jsonl"):
        for inv in R.read_invocations(path):
            jsonschema.validate(inv.to_json(), _schema("invocation.schema.json"))


def test_the_front_matter_schema_agrees_with_the_model():
    schema = json.loads(schemas.CORPUS_SKILL_SCHEMA.read_text())
    meta = {"model": "m", "problem": 28, "direction": "cutedsl2tirx", "source_verdict": "ok", "sha256": "a" * 64,
            "dataset_version": "1.0.0", "outcome": {"verdict": "helped", "skill_speedup": 2.0}}
    jsonschema.validate(meta, schema)
    S.parse_front_matter(meta)
    for bad in ({**meta, "replicate": None}, {**meta, "colour": 1}, {**meta, "outcome": {"verdict": "won"}},
                {**meta, "outcome": {"verdict": "helped", "base_status": None}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(ValueError):
            S.parse_front_matter(bad)
