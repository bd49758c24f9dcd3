"""The typed attempt record: committed records validate and round-trip, errors name the field, the exported
JSON Schema is current and accepts what the model accepts."""

import json
from pathlib import Path

import jsonschema
import pytest

from mkb_eval import attempt_record as A

ROOT = Path(__file__).resolve().parents[1]
RELEASED = sorted(ROOT.glob("results/**/attempts.jsonl"))


def _records():
    return [json.loads(line) for f in RELEASED for line in f.read_text().splitlines() if line.strip()]


def test_committed_attempt_records_validate_and_round_trip():
    recs = _records()
    assert RELEASED and len(recs) >= 88
    for d in recs:
        assert A.parse(d, "committed").to_json() == d


def test_a_bad_record_is_refused_with_the_fields_named():
    d = _records()[0]
    with pytest.raises(ValueError, match=r"status: Input should be"):
        A.parse({**d, "status": "fast"})
    with pytest.raises(ValueError, match=r"final_kernel_sha256: Field required"):
        A.parse({k: v for k, v in d.items() if k != "final_kernel_sha256"})
    with pytest.raises(ValueError, match=r"colour: Extra inputs are not permitted"):
        A.parse({**d, "colour": "red"})
    with pytest.raises(ValueError, match=r"usage.turns"):
        A.parse({**d, "usage": {**d["usage"], "turns": -1}})
    with pytest.raises(ValueError, match=r"^where: .*schema_version"):
        A.parse({**d, "schema_version": 2}, "where")


def test_the_committed_schema_is_current_and_agrees_with_the_model():
    assert A.SCHEMA_PATH.read_text() == A.schema_text(), "regenerate: python -m mkb_eval.attempt_record"
    schema = json.loads(A.SCHEMA_PATH.read_text())
    d = _records()[0]
    jsonschema.validate(d, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**d, "arm": "solo_cuda"}, schema)


def test_the_datasets_attempt_columns_take_their_types_from_the_schema():
    from dataset_builder.features import FEATURES

    f = FEATURES["attempts"]
    want = {"problem_id": "int32", "replicate": "int32", "schema_version": "int32", "speedup": "float64",
            "kernel_ms": "float64", "skipped": "bool", "status": "string", "direction": "string", "error": "string"}
    assert {k: f[k].dtype for k in want} == want
    props = A.json_schema()["properties"]
    assert all(k in props for k in want)
