"""The append-only store: whole lines only, torn tails repaired and kept, bad lines reported."""

import json
import warnings

from hypothesis import given, settings
from hypothesis import strategies as st

from mkb_eval.records import VerificationRecord, append_jsonl, read_jsonl, repair_jsonl


def test_append_then_read(tmp_path):
    p = tmp_path / "r.jsonl"
    for i in range(5):
        append_jsonl(p, {"i": i})
    assert [r["i"] for r in read_jsonl(p)] == list(range(5))
    assert repair_jsonl(p) is None


def test_torn_tail_is_repaired_before_the_next_append(tmp_path):
    p = tmp_path / "r.jsonl"
    append_jsonl(p, {"i": 0})
    with open(p, "ab") as f:
        f.write(b'{"i": 1, "x": "tor')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        append_jsonl(p, {"i": 2})
    assert any("torn" in str(x.message) for x in w)
    assert [r["i"] for r in read_jsonl(p)] == [0, 2]
    assert (tmp_path / "r.jsonl.torn").read_bytes().startswith(b'{"i": 1')


def test_file_that_is_only_a_torn_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"half')
    assert repair_jsonl(p) is not None
    assert p.read_bytes() == b""


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=60), max_size=12))
def test_reading_arbitrary_bytes_never_crashes(tmp_path_factory, lines):
    p = tmp_path_factory.mktemp("fuzz") / "r.jsonl"
    p.write_bytes(b"\n".join(lines))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = list(read_jsonl(p))
    assert all(isinstance(r, dict) for r in out)


def test_verification_record_round_trip_and_version_check():
    rec = VerificationRecord(status="ok", problem_id=28, problem="28_x", problem_hash="h", dsl="tirx",
                             kernel_sha256="k", tier="gpu", size="full")
    d = json.loads(json.dumps(rec.to_dict()))
    assert VerificationRecord.from_dict(d) == rec
    d["schema_version"] = 99
    try:
        VerificationRecord.from_dict(d)
    except ValueError as e:
        assert "schema_version 99" in str(e)
    else:
        raise AssertionError("a newer schema was accepted")


def test_verification_records_parse_strictly_and_the_schema_is_current():
    """Every committed curated record parses into a VerificationRecord; a wrong type, an unknown field or status,
    another schema version is refused with the field named; the exported schema is current and agrees."""
    import json
    from pathlib import Path

    import jsonschema
    import pytest

    from mkb_eval.records import VERIFICATION_SCHEMA_PATH, VerificationRecord, parse_verification, verification_schema_text

    root = Path(__file__).resolve().parents[1]
    lines = (root / "results" / "h200" / "verification.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines if x.strip()]
    assert len(recs) == 148
    for d in recs:
        rec = parse_verification(d, "curated")
        assert isinstance(rec, VerificationRecord) and rec.timing.kernel_ms == d["timing"]["kernel_ms"]
    d = recs[0]
    with pytest.raises(ValueError, match=r"timing.kernel_ms"):
        parse_verification({**d, "timing": {**d["timing"], "kernel_ms": "fast"}}, "x")
    with pytest.raises(ValueError, match=r"colour"):
        parse_verification({**d, "colour": 1}, "x")
    with pytest.raises(ValueError, match=r"^x: unknown status 'great'"):
        parse_verification({**d, "status": "great"}, "x")
    with pytest.raises(ValueError, match=r"schema_version 99"):
        VerificationRecord.from_dict({**d, "schema_version": 99})
    path = VERIFICATION_SCHEMA_PATH
    assert path.read_text() == verification_schema_text(), "regenerate: python -m mkb_eval.attempt_record"
    schema = json.loads(path.read_text())
    jsonschema.validate(parse_verification(d, "curated").to_dict(), schema)
    old = json.loads((root / "results" / "h200" / "2026-12-01_sweep_attested" / "sweep.jsonl")
                     .read_text().splitlines()[0])                   # a version 1 record (before the typed parts)
    jsonschema.validate(parse_verification(old, "attested sweep").to_dict(), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(old, schema)                             # an older shape is migrated, not valid as it is
