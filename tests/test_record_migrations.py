"""Verification record migrations: every committed record loads through the strict parser, each migration
does what it says, and a record no migration can bring to shape fails naming where and which field."""

from __future__ import annotations

import copy
import json
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mkb_eval.record_migrations import MIGRATIONS, applied
from mkb_eval.records import (
    SCHEMA_VERSION,
    VERIFICATION_SCHEMA_PATH,
    Artifacts,
    Env,
    VerificationRecord,
    artifacts_from_worker,
    parse_verification,
    stage_key_rule,
)

ROOT = Path(__file__).resolve().parents[1]


def _committed() -> list[tuple[str, dict[str, Any]]]:
    """(file:line, object) of every verification record in a tracked JSON or JSONL file."""
    try:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.jsonl", "*.json"], capture_output=True,
                                 text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    out = []
    for name in tracked:
        text = (ROOT / name).read_text(encoding="utf-8")
        objs = ([(n, json.loads(x)) for n, x in enumerate(text.splitlines(), 1) if x.strip()]
                if name.endswith(".jsonl") else [(1, json.loads(text))])
        recs = [(f"{name}:{n}", o) for n, o in objs if isinstance(o, dict) and o.get("kind") == "verification"]
        assert not recs or len(recs) == len(objs), f"{name}: a record file with lines of another kind"
        out += recs
    return out


def test_every_committed_verification_record_parses():
    """Found through git, so a record file committed later is covered too; each record parses (migrated),
    its current shape is valid by the exported schema, writes back the same keys and reads back equal."""
    recs = _committed()
    assert len(recs) >= 361 and any(w.startswith("results/h200/verification.jsonl:") for w, _ in recs)
    schema = json.loads(VERIFICATION_SCHEMA_PATH.read_text())
    valid = jsonschema.validators.validator_for(schema)(schema)
    for where, d in recs:
        before = copy.deepcopy(d)
        rec = parse_verification(d, where)
        assert d == before, f"{where}: parsing changed the object read"
        out = rec.to_dict()
        valid.validate(out)
        assert parse_verification(json.loads(json.dumps(out)), where) == rec
        for part in ("timing", "stages_s"):
            assert out[part] == {**d[part], **out[part]} and set(d[part]) <= set(out[part]), where
        for part in ("correctness", "artifacts", "sandbox", "env"):   # the keys set, null ones not written
            assert out[part] == {k: v for k, v in d[part].items() if v is not None}, (where, part)
        bad = [k for k in out["stages_s"] if stage_key_rule(k) is None]
        assert not bad, f"{where}: stages_s keys outside the documented rules: {bad}"


def _v1(**kw: Any) -> dict[str, Any]:
    """A version-1 record as the harness wrote it (``kernels`` empty, no ``labels``)."""
    d = VerificationRecord(status="ok", problem_id=28, problem="28_x", problem_hash="h", dsl="tirx",
                           kernel_sha256="k", tier="gpu", size="full").to_dict()
    del d["labels"]
    return {**d, "schema_version": 1, "kernels": [], **kw}


def test_the_migrations_are_an_ordered_chain_to_the_current_version():
    assert [m.name for m in MIGRATIONS] == ["v1_fill_later_fields", "v1_kernels_to_artifacts", "v1_test_labels",
                                            "v1_to_v2"]
    assert SCHEMA_VERSION == 2 and all(m.apply.__doc__ for m in MIGRATIONS)
    cur = VerificationRecord(status="ok", problem_id=1, problem="p", problem_hash="h", dsl="tirx", kernel_sha256="k",
                             tier="gpu", size="full").to_dict()
    assert applied(cur, SCHEMA_VERSION) == (cur, [])


def test_v1_fill_later_fields_fills_only_the_fields_added_in_version_1():
    d = _v1()
    del d["sandbox"]
    for k in ("host_call_ms", "cpu_probe_ms", "attested_ms", "attested_windows_ms", "window_calls",
              "prewindow_excess_ms", "window_span_ms", "window_commit_ms"):
        del d["timing"][k]
    out, names = applied(d, SCHEMA_VERSION)
    assert "v1_fill_later_fields" in names and out["sandbox"] == {} and out["timing"]["window_calls"] == 0
    assert out["timing"]["attested_windows_ms"] == [] and out["timing"]["attested_ms"] is None
    assert "sandbox" not in d, "the record read is left as it was"
    rec = parse_verification(d)
    assert rec.timing.host_call_ms is None and rec.sandbox.to_dict() == {}
    assert "v1_fill_later_fields" not in applied(_v1(), SCHEMA_VERSION)[1]       # nothing missing: untouched
    for field, named in (("problem_hash", "problem_hash"), ("timing", "timing")):
        d = _v1()
        del d[field]
        with pytest.raises(ValueError, match=rf"^f.jsonl:3: verification record lacks {named}"):
            parse_verification(d, "f.jsonl:3")
    d = _v1()
    del d["timing"]["kernel_ms"]                     # there from the start: not an older shape
    with pytest.raises(ValueError, match=r"^f.jsonl:4: verification record lacks timing.kernel_ms"):
        parse_verification(d, "f.jsonl:4")


def test_v1_kernels_to_artifacts_removes_the_empty_list_and_moves_names():
    out, names = applied(_v1(), SCHEMA_VERSION)
    assert "kernels" not in out and "v1_kernels_to_artifacts" in names and out["artifacts"] == {}
    rec = parse_verification(_v1(kernels=["kernel_cutlass_a_0", "merge_1"]))
    assert rec.artifacts.cupti_kernels == ["kernel_cutlass_a_0", "merge_1"]
    assert rec.to_dict()["artifacts"] == {"cupti_kernels": ["kernel_cutlass_a_0", "merge_1"]}
    with pytest.raises(ValueError, match=r"^x:9: .*kernels"):                   # nowhere to move them: refused
        parse_verification(_v1(kernels=["k"], artifacts=None), "x:9")


def test_v1_test_labels_moves_the_gpu_tests_tags_into_labels():
    d = _v1(test="wrong", kernel="zeros.py", expected="incorrect", run=2)
    out, names = applied(d, SCHEMA_VERSION)
    assert out["labels"] == {"test": "wrong", "kernel": "zeros.py", "expected": "incorrect", "run": 2}
    assert not {"test", "kernel", "expected", "run"} & set(out) and "v1_test_labels" in names
    assert parse_verification(d).labels["expected"] == "incorrect"
    assert "v1_test_labels" not in applied(_v1(), SCHEMA_VERSION)[1]


def test_v1_to_v2_sets_the_version_and_empty_labels():
    out, names = applied(_v1(), SCHEMA_VERSION)
    assert out["schema_version"] == 2 and out["labels"] == {} and names[-1] == "v1_to_v2"


def test_a_record_no_migration_brings_to_shape_names_where_and_the_field():
    with pytest.raises(ValueError, match=r"^r.jsonl:7: verification record has schema_version 0; .*migrates 1"):
        parse_verification(_v1(schema_version=0), "r.jsonl:7")
    with pytest.raises(ValueError, match=r"^r.jsonl:8: verification record has schema_version 3"):
        parse_verification(_v1(schema_version=3), "r.jsonl:8")
    with pytest.raises(ValueError, match=r"^r.jsonl:9: not a valid .*correctness.colour"):
        parse_verification(_v1(correctness={"colour": "red"}), "r.jsonl:9")
    with pytest.raises(ValueError, match=r"^r.jsonl:10: not a valid .*env.gpu_count"):
        parse_verification(_v1(env={"gpu_count": "many"}), "r.jsonl:10")
    v2 = {**applied(_v1(), SCHEMA_VERSION)[0], "kernels": []}                  # version 2 has no kernels
    with pytest.raises(ValueError, match=r"^r.jsonl:11: not a valid .*kernels"):
        parse_verification(v2, "r.jsonl:11")
    v2 = applied(_v1(), SCHEMA_VERSION)[0]
    del v2["labels"]
    with pytest.raises(ValueError, match=r"^r.jsonl:12: verification record lacks labels"):
        parse_verification(v2, "r.jsonl:12")


def test_parts_write_only_what_was_set_under_the_same_key_names():
    rec = VerificationRecord(status="incorrect", problem_id=1, problem="p", problem_hash="h", dsl="tirx",
                             kernel_sha256="k", tier="gpu", size="full")
    rec.correctness.draws_passed, rec.correctness.max_error = 2, 0.5
    rec.stages_s["judge_correctness_compare"] = 0.01
    d = rec.to_dict()
    assert d["correctness"] == {"draws_passed": 2, "max_error": 0.5} and d["artifacts"] == d["env"] == {}
    assert set(d) == {f.name for f in fields(VerificationRecord)} and "kernels" not in d
    assert parse_verification(d) == rec


def test_the_worker_artifacts_report_is_typed_and_a_malformed_one_kept_as_the_error():
    arts = artifacts_from_worker({"cuda_sources": 2, "cuda_source_bytes": 9, "nvcc": [{"cubin_bytes": 5},
                                                                                     {"skipped": "nvcc not found"}]})
    assert arts.nvcc is not None and arts.nvcc[1].skipped == "nvcc not found"
    assert arts.to_dict()["nvcc"] == [{"cubin_bytes": 5}, {"skipped": "nvcc not found"}]
    bad = artifacts_from_worker({"cubins": "lots", "evil": 1})
    assert isinstance(bad, Artifacts) and bad.error and "cubins" in bad.error and "evil" in bad.error
    assert artifacts_from_worker(["not", "a", "dict"]).error


def test_describe_fills_only_env_fields():
    from mkb_eval.env import describe

    assert set(describe(gpu=False)) <= {f.name for f in fields(Env)}
    assert Env(**describe(gpu=False)).torch
