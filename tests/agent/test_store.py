"""The run folder: one writer, torn-line repair, archived artifacts, model pinning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mkb_eval.agent.store import RunStore, StoreError


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    with RunStore(tmp_path / "run"):
        with pytest.raises(StoreError, match=r"in use by pid \d+"):
            RunStore(tmp_path / "run").open()
    with RunStore(tmp_path / "run"):   # released on close
        pass


def test_torn_last_line_is_archived_not_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = json.dumps({"kind": "attempt", "trial": "p28_r1_solo_tirx", "status": "ok"})
    (run / "attempts.jsonl").write_text(good + "\n" + '{"kind": "attempt", "tri')
    with RunStore(run) as s:
        assert list(s.records()) == ["p28_r1_solo_tirx"]
        assert "torn line" in s.notes[0]
        s.append_record({"kind": "attempt", "trial": "p28_r1_solo_cutedsl", "status": "ok"})
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
