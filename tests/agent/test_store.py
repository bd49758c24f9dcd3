"""The run folder: one writer, torn-line repair, archived artifacts, model pinning."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from mkb_eval.agent.store import RunStore, StoreError
from tests.helpers import attempt

ROOT = Path(__file__).resolve().parents[2]


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    with RunStore(tmp_path / "run"):
        with pytest.raises(StoreError, match=r"in use by pid \d+"):
            RunStore(tmp_path / "run").open()
    with RunStore(tmp_path / "run"):   # released on close
        pass


def test_torn_last_line_is_archived_not_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = json.dumps(attempt("p28_r1_solo_tirx", "ok", 2.0))
    (run / "attempts.jsonl").write_text(good + "\n" + '{"kind": "attempt", "tri')
    with RunStore(run) as s:
        assert list(s.records()) == ["p28_r1_solo_tirx"]
        assert "torn line" in s.notes[0]
        s.append_record(attempt("p28_r1_solo_cutedsl", "ok", 3.0))
    lines = (run / "attempts.jsonl").read_text().splitlines()
    assert [json.loads(x)["trial"] for x in lines] == ["p28_r1_solo_tirx", "p28_r1_solo_cutedsl"]
    torn = list((run / "archive").glob("*torn*"))
    assert torn and torn[0].read_text() == '{"kind": "attempt", "tri'


def test_begin_trial_archives_an_earlier_folder(tmp_path: Path) -> None:
    with RunStore(tmp_path / "run") as s:
        a = s.begin_trial("p28_r1_solo_tirx")
        a.message({"role": "user", "content": "x"})
        s.begin_trial("p28_r1_solo_tirx")
        archived = list((tmp_path / "run" / "archive").glob("*__p28_r1_solo_tirx"))
        assert archived and (archived[0] / "transcript.jsonl").is_file()
        assert not (s.trial_dir("p28_r1_solo_tirx") / "transcript.jsonl").exists()


def test_a_run_folder_holds_one_model(tmp_path: Path) -> None:
    with RunStore(tmp_path / "run") as s:
        s.pin_model("model-a", {"kind": "x"})
        s.check_model("model-a")
        with pytest.raises(StoreError, match="holds model 'model-a', not 'model-b'"):
            s.check_model("model-b")


def test_writes_need_the_lock(tmp_path: Path) -> None:
    s = RunStore(tmp_path / "run")
    with pytest.raises(StoreError, match="not open for writing"):
        s.append_record({"trial": "x"})


def test_every_committed_attempts_file_resumes_through_the_store(tmp_path: Path) -> None:
    """Released run folders load as a resumed run would read them: every line valid, none skipped."""
    files = sorted(ROOT.glob("results/**/attempts.jsonl"))
    assert files
    for i, f in enumerate(files):
        run = tmp_path / str(i)
        run.mkdir()
        shutil.copy(f, run / "attempts.jsonl")
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with RunStore(run) as s:
                recs = s.records()
        assert recs == {d["trial"]: d for d in lines}, f


def test_a_bad_line_is_named_skipped_and_its_trial_runs_again(tmp_path: Path) -> None:
    """A line that is no valid record warns with file:line and field; the trial it names has no record
    (an earlier good one is not reused behind it), the other trials keep theirs, and nothing raises."""
    run = tmp_path / "run"
    run.mkdir()
    good = [attempt("p28_r1_solo_tirx", "ok", 2.0), attempt("p28_r1_solo_cutedsl", "ok", 3.0)]
    bad = {**attempt("p28_r1_solo_tirx", "ok", 2.0), "status": "fast"}
    lines = [json.dumps(d) for d in good] + [json.dumps(bad), "[1, 2]", "not json"]
    (run / "attempts.jsonl").write_text("\n".join(lines) + "\n")
    with RunStore(run) as s, pytest.warns(UserWarning) as caught:
        recs = s.records()
    assert list(recs) == ["p28_r1_solo_cutedsl"]
    msgs = [str(w.message) for w in caught]
    assert any(m.startswith(f"{run / 'attempts.jsonl'}:3: ") and "status: Input should be" in m
               and "trial p28_r1_solo_tirx runs again" in m for m in msgs), msgs
    assert any(":4: " in m for m in msgs) and any(":5: malformed JSON" in m for m in msgs), msgs


def test_a_record_without_schema_version_is_refused_not_guessed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    old = {k: v for k, v in attempt("p28_r1_solo_tirx", "ok", 2.0).items() if k != "schema_version"}
    (run / "attempts.jsonl").write_text(json.dumps(old) + "\n")
    with RunStore(run) as s, pytest.warns(UserWarning, match=r":1: attempt record has schema_version 0"):
        assert s.records() == {}
