"""Reading attempt records: versions, defaults, torn lines, superseding, contradictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mkb_hand_records import hand_records, rec

from mkb_eval.metrics import AttemptOutcome, InputError, SchemaVersionError, outcome_from_dict, read_attempts


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "attempts.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_current_record_round_trip() -> None:
    o = outcome_from_dict(rec(28, "cutedsl2tirx_skill", "ok", 1.5))
    assert o == AttemptOutcome(problem_id=28, arm="cutedsl2tirx_skill", status="ok", replicate=1, speedup=1.5,
                               kernel_ms=1 / 1.5, eager_ms=1.0, family="mlp_norm", model="m")
    assert o.dsl == "tirx" and o.trial == "p28_r1_cutedsl2tirx_skill" and o.passed


def test_run_dir_supersedes_and_skips_torn_lines(tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in hand_records()]
    lines.insert(3, '{"schema_version": 1, "kind": "attempt", "trial": "p01_r1_so')  # torn write
    lines.insert(5, json.dumps({"schema_version": 1, "kind": "usage", "trial": "p01_r1_solo_tirx"}))  # other kind
    run = write_jsonl(tmp_path / "run", lines)
    with pytest.warns(UserWarning, match=r"attempts.jsonl:4: malformed JSON"):
        loaded = read_attempts(run)
    assert len(loaded.outcomes) == 23  # 24 records, one superseded
    assert loaded.n_records == 24 and loaded.n_superseded == 1 and loaded.n_other_kinds == 1
    assert len(loaded.warnings) == 1 and "line skipped" in loaded.warnings[0]
    p1_tirx = [o for o in loaded.outcomes if o.problem_id == 1 and o.arm == "solo_tirx"]
    assert [o.status for o in p1_tirx] == ["ok"]  # the later line wins


def test_invalid_record_is_skipped_with_its_line(tmp_path: Path) -> None:
    bad = rec(36, "solo_tirx", "ok", 3.0)
    bad["status"] = "great"
    run = write_jsonl(tmp_path / "run", [json.dumps(rec(36, "solo_cutedsl", "ok", 4.0)), json.dumps(bad)])
    with pytest.warns(UserWarning, match=r"attempts.jsonl:2: unknown status 'great'"):
        loaded = read_attempts(run)
    assert [o.arm for o in loaded.outcomes] == ["solo_cutedsl"]


def test_newer_schema_is_refused_naming_file_line_version(tmp_path: Path) -> None:
    newer = rec(1, "solo_tirx", "ok", 1.0, schema_version=2)
    run = write_jsonl(tmp_path / "run", [json.dumps(rec(1, "solo_cutedsl", "ok", 2.0)), json.dumps(newer)])
    expected = r"attempts.jsonl:2: attempt record has schema_version 2.*reads only up to 1"
    with pytest.raises(SchemaVersionError, match=expected):
        read_attempts(run)


def test_older_schema_is_read_with_defaults() -> None:
    old = {"trial": "p28_r2_tirx2cutedsl_skill", "status": "ok", "eager_ms": 3.0, "kernel_ms": 1.5}
    o = outcome_from_dict(old)
    assert (o.problem_id, o.replicate, o.arm, o.dsl) == (28, 2, "tirx2cutedsl_skill", "cutedsl")
    assert o.speedup == 2.0 and o.family == "mlp_norm" and o.model == "unknown" and o.schema_version == 0
    assert not o.skipped and o.error is None
    skipped = outcome_from_dict({"schema_version": 0, "problem_id": 5, "arm": "cutedsl2tirx_skill",
                                 "status": "skipped"})
    assert skipped.skipped and not skipped.passed and skipped.replicate == 1


def test_older_schema_missing_required_field_is_named() -> None:
    with pytest.raises(InputError, match=r"schema_version 0 record lacks arm"):
        outcome_from_dict({"problem_id": 5, "status": "ok", "speedup": 1.0})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dsl": "cutedsl"}, "contradicts arm"),
        ({"problem_id": 29}, "contradicts trial"),
        ({"speedup": None, "kernel_ms": None}, "needs speedup"),
        ({"speedup": -1.0}, "positive finite"),
        ({"speedup": float("nan")}, "positive finite"),
        ({"replicate": "1"}, "contradicts trial"),
        ({"trial": "28_solo"}, "not of the form"),
        ({"skipped": "yes"}, "true or false"),
    ],
)
def test_contradictions_are_errors(change: dict, message: str) -> None:
    d = rec(28, "solo_tirx", "ok", 0.6)
    d.update(change)
    with pytest.raises(InputError, match=message):
        outcome_from_dict(d)


def test_a_solo_cannot_be_skipped() -> None:
    with pytest.raises(InputError, match="only a skill arm"):
        outcome_from_dict(rec(28, "solo_tirx", "skipped"))


def test_failed_attempt_keeps_no_speedup() -> None:
    o = outcome_from_dict(rec(28, "solo_tirx", "incorrect", speedup=None) | {"speedup": 9.0})
    assert o.speedup is None and not o.attains(0.0)


def test_list_input_and_run_dir_agree(tmp_path: Path) -> None:
    run = write_jsonl(tmp_path / "run", [json.dumps(r) for r in hand_records()])
    assert read_attempts(run).outcomes == read_attempts(hand_records()).outcomes


def test_missing_attempts_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no attempts file"):
        read_attempts(tmp_path)


def test_skipped_status_wins_over_a_false_flag() -> None:
    assert outcome_from_dict(rec(28, "tirx2cutedsl_skill", "skipped") | {"skipped": False}).skipped
    with pytest.raises(InputError, match="only a skill arm"):
        outcome_from_dict(rec(28, "solo_tirx", "skipped") | {"skipped": False})
