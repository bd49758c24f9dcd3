"""The typed baseline cache entry: committed caches load through the migration, the writer refuses a bad
entry, a reader names a bad line and never uses it, and the exported schema agrees with the model."""

import json
import warnings
from pathlib import Path

import jsonschema
import pytest

from mkb_eval import baseline_record as B
from mkb_eval.harness.judge import baseline_cached, baseline_key, read_baseline_cache, store_baseline

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted(ROOT.glob("results/**/*baselines.jsonl"))
ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}


def test_every_committed_cache_loads_every_line_through_the_migration():
    assert COMMITTED
    for f in COMMITTED:
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            entries = B.read_baselines(f)
        assert len(entries) == len({d["key"] for d in lines}) == len(lines), f
        for d in lines:                                   # version 0: {key, ms, error}, nothing lost
            e = entries[d["key"]]
            assert (e.ms, e.error, e.schema_version, e.kind) == (d["ms"], d["error"], 1, "baseline")


def test_the_writer_builds_the_entry_and_refuses_a_bad_one(tmp_path: Path):
    key = baseline_key("aa", "full", ENV)
    store_baseline(tmp_path, "eager", key, 1.5, None)
    store_baseline(tmp_path, "compile", key, None, "InductorError: x")
    assert json.loads((tmp_path / "eager_baselines.jsonl").read_text()) == {
        "schema_version": 1, "kind": "baseline", "key": key, "ms": 1.5, "error": None}
    assert read_baseline_cache(tmp_path / "compile_baselines.jsonl")[key].error == "InductorError: x"
    for ms, err in ((None, None), (1.0, "both"), (-1.0, None), (float("nan"), None)):
        with pytest.raises(ValueError):
            store_baseline(tmp_path, "eager", key, ms, err)
    with pytest.raises(ValueError, match="key"):
        store_baseline(tmp_path, "eager", "no-key", 1.0, None)
    assert len((tmp_path / "eager_baselines.jsonl").read_text().splitlines()) == 1   # nothing appended


def test_a_bad_line_is_named_and_skipped_and_its_key_is_timed_again(tmp_path: Path):
    from mkb_eval import problems as P

    p28 = P.find(28)
    key = baseline_key(p28.hash, "full", ENV)
    path = tmp_path / "compile_baselines.jsonl"
    path.write_text("\n".join([json.dumps({"key": key, "ms": "0.5", "error": None}),         # a string time
                               json.dumps({"key": key, "ms": 0.5, "error": None, "extra": 1}),
                               json.dumps({"key": key, "ms": 0.5, "error": None, "schema_version": 9})]) + "\n")
    with pytest.warns(UserWarning) as caught:
        got = baseline_cached(p28, "full", ENV, tmp_path, lambda: 2.0)
    assert got == (2.0, False, None)                      # a miss: measured, never the unchecked 0.5
    msgs = [str(w.message) for w in caught]
    assert any(m.startswith(f"{path}:1: ") and "ms: Input should be a valid number" in m for m in msgs), msgs
    assert any(f"{path}:2: " in m and "extra: Extra inputs" in m for m in msgs), msgs
    assert any(f"{path}:3: " in m and "schema_version 9" in m for m in msgs), msgs
    with pytest.warns(UserWarning):
        assert read_baseline_cache(path)[key].ms == 2.0   # the appended entry answers from now on


def test_the_committed_schema_is_current_and_agrees_with_the_model():
    assert B.SCHEMA_PATH.read_text() == B.schema_text(), "regenerate: python -m mkb_eval.schemas"
    schema = json.loads(B.SCHEMA_PATH.read_text())
    key = baseline_key("aa", "full", ENV)
    good = [B.BaselineEntry(key=key, ms=1.0, error=None).to_json(), B.BaselineEntry(key=key, ms=None, error="x").to_json()]
    for d in good:
        jsonschema.validate(d, schema)
    for d in ({**good[0], "error": "x"}, {**good[1], "error": None}, {**good[0], "ms": 0}, {**good[0], "key": "a|b"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(d, schema)
        with pytest.raises(ValueError):
            B.parse_baseline(d)
