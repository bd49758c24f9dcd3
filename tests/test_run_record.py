"""The run folder's typed records (run.json, invocations.jsonl, retime.jsonl): round trips, strict refusal of
each kind of bad field at the writer and the reader, ordered migrations of older lines (the committed A/A run
folder's among them, nothing dropped), and a resumed run over a folder written before the typed records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mkb_eval import run_record as R
from mkb_eval.agent.store import RunStore, StoreError

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = {name: sorted(ROOT.glob(f"results/**/{name}")) for name in ("invocations.jsonl", "retime.jsonl")}
SHA = "ab" * 32


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _invocation(**over: Any) -> dict[str, Any]:
    d = {"schema_version": 1, "kind": "invocation", "started_at": "2026-12-01T00:00:00+00:00", "model": "m",
         "backend": {"kind": "replay"}, "problems": [28], "arms": ["solo_tirx"], "replicates": 1, "device": "cpu",
         "tier": "cpu", "budget": {"submissions": 1, "max_tokens_per_turn": 8, "max_total_tokens": 8, "wall_s": 1.0,
                                   "max_corrections": 1},
         "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 8, "seed": 0}, "rerun_stale": False,
         "plan": {"run": 1, "rerun": 0, "stale": 0, "reuse": 0}, "commit": "0" * 40, "dirty": False}
    return {**d, **over}


def _window(**over: Any) -> dict[str, Any]:
    return {"label": "solo_tirx", "round": 0, "position": 0, "kernel_ms": 1.0, "attested_ms": 0.9,
            "worker_event_ms": 1.0, "device_ms": 0.8, "status": "ok", "message": "", "span_per_call_ms": 1.1,
            "commit_ms": 0.01, **over}


def _retime(**over: Any) -> dict[str, Any]:
    d = {"kind": "retime", "retime_version": 2, "key": SHA, "group": "p28_r1", "problem_id": 28, "replicate": 1,
         "model": "m", "tier": "gpu", "settings": {"rounds": 5, "warmup": 5, "draws": 20},
         "kernels": {"solo_tirx": {"trial": "p28_r1_solo_tirx", "dsl": "tirx", "sha256": SHA}},
         "labels": ["solo_tirx"], "windows": [_window()], "env": {"gpu": "NVIDIA H200"}, "stages_s": {"total": 1.0},
         "wall_s": 1.0, "created_at": "2026-12-01T00:00:00+00:00"}
    return {**d, **over}


def test_records_round_trip():
    for parse, d in ((R.parse_invocation, _invocation()), (R.parse_retime, _retime()),
                     (R.parse_run_meta, {"store_version": 1, "model": "m", "backend": {"kind": "x"}, "created_at": "t"})):
        assert parse(d).to_json() == d


@pytest.mark.parametrize("parse, d, match", [
    (R.parse_invocation, _invocation(colour="red"), r"colour: Extra inputs are not permitted"),
    (R.parse_invocation, _invocation(replicates="2"), r"replicates: Input should be a valid integer"),
    (R.parse_invocation, _invocation(rerun_stale=1), r"rerun_stale: Input should be a valid boolean"),
    (R.parse_invocation, _invocation(arms=["solo_cuda"]), r"arms.0: Input should be"),
    (R.parse_invocation, _invocation(commit="abc"), r"commit: String should match pattern"),
    (R.parse_invocation, {k: v for k, v in _invocation().items() if k != "plan"}, r"plan: Field required"),
    (R.parse_invocation, _invocation(budget={**_invocation()["budget"], "wall_s": 0}), r"budget.wall_s: Input should be"),
    (R.parse_retime, _retime(windows=[_window(status="fast")]), r"windows.0.status: Input should be"),
    (R.parse_retime, _retime(windows=[_window(kernel_ms="1.0")]), r"windows.0.kernel_ms: Input should be a valid number"),
    (R.parse_retime, _retime(key="abc"), r"key: String should match pattern"),
    (R.parse_retime, _retime(kernels={"solo_tirx": {"trial": "p28_r1_solo_tirx", "dsl": "cuda", "sha256": SHA}}),
     r"kernels.solo_tirx.dsl: Input should be"),
    (R.parse_retime, _retime(settings={"rounds": 1, "warmup": 5, "draws": 20}), r"settings.rounds"),
    (R.parse_retime, [], r"Input should be a valid dictionary"),
    (R.parse_run_meta, {"store_version": 1, "model": "", "backend": {}, "created_at": "t"}, r"model: String should"),
])
def test_a_bad_field_is_refused_and_named(parse, d, match):
    with pytest.raises(ValueError, match=r"^where: not a valid .*" + match):
        parse(d, "where")


def test_a_version_without_a_migration_is_refused():
    with pytest.raises(ValueError, match=r"^f:3: re-timing record has retime_version 3; this toolkit reads 2 "
                                         r"\(and migrates 1\)"):
        R.parse_retime(_retime(retime_version=3), "f:3")
    with pytest.raises(ValueError, match=r"run.json record has store_version 2; this toolkit reads 1$"):
        R.parse_run_meta({"store_version": 2, "model": "m", "backend": {}, "created_at": "t"})
    with pytest.raises(ValueError, match=r"schema_version True"):
        R.parse_invocation(_invocation(schema_version=True))


def test_migrations_run_in_order_and_leave_the_input_alone():
    seen: list[int] = []
    chain = {0: lambda d: (seen.append(0), {**d, "v": 1, "a": 1})[1],
             1: lambda d: (seen.append(1), {**d, "v": 2, "b": d["a"] + 1})[1]}
    old = {"x": 0}
    assert R.migrate(old, "v", 2, chain, "thing", "w") == {"x": 0, "v": 2, "a": 1, "b": 2}
    assert seen == [0, 1] and old == {"x": 0}
    assert R.migrate({"v": 1, "a": 5}, "v", 2, chain, "thing", "w")["b"] == 6     # starts from its own version


def test_version_1_retime_and_version_0_invocation_lines_migrate_with_nothing_dropped():
    v1 = _retime(retime_version=1, windows=[{k: v for k, v in _window().items()
                                             if k not in ("span_per_call_ms", "commit_ms")}])
    rec = R.parse_retime(v1).to_json()
    assert rec["retime_version"] == 2 and rec["windows"][0]["span_per_call_ms"] is None
    assert rec["windows"][0]["commit_ms"] is None
    v0 = {k: v for k, v in _invocation().items() if k not in ("schema_version", "commit", "dirty")}
    inv = R.parse_invocation(v0).to_json()
    assert inv["schema_version"] == 1 and inv["commit"] is None and inv["dirty"] is None
    assert all(inv[k] == v for k, v in v0.items())


def test_committed_run_records_load_through_their_migrations():
    assert COMMITTED["invocations.jsonl"] and COMMITTED["retime.jsonl"]
    for name, read, version in (("invocations.jsonl", R.read_invocations, "schema_version"),
                                ("retime.jsonl", R.read_retimes, "retime_version")):
        for path in COMMITTED[name]:
            old, new = _lines(path), [r.to_json() for r in read(path)]
            assert len(old) == len(new)
            for o, n in zip(old, new, strict=True):              # every old field kept, as it was
                assert {k: v for k, v in o.items() if k not in (version, "windows")} == \
                       {k: v for k, v in n.items() if k in o and k not in (version, "windows")}
                for ow, nw in zip(o.get("windows", []), n.get("windows", []), strict=True):
                    assert nw == {"span_per_call_ms": None, "commit_ms": None, **ow}


def test_readers_name_the_file_line_and_field(tmp_path: Path):
    path = tmp_path / "invocations.jsonl"
    path.write_text(json.dumps(_invocation()) + "\n" + json.dumps(_invocation(tier="tpu")) + "\n")
    with pytest.raises(ValueError, match=r"invocations.jsonl:2: not a valid invocation record: tier: Input should"):
        R.read_invocations(path)
    path.write_text("{not json\n" + json.dumps(_invocation()) + "\n")
    with pytest.raises(ValueError, match=r"invocations.jsonl:1: not valid JSON"):
        R.read_invocations(path)
    retime = tmp_path / "retime.jsonl"
    retime.write_text(json.dumps(_retime()) + '\n{"kind": "retime", "key": "to')       # a kill mid-write
    with pytest.warns(UserWarning, match=r"retime.jsonl:2: torn last line skipped"):
        assert [r.key for r in R.read_retimes(retime)] == [SHA]
    assert R.read_retimes(tmp_path / "absent.jsonl") == []


def test_the_store_builds_its_records_strictly(tmp_path: Path):
    run = tmp_path / "run"
    with RunStore(run) as s:
        s.pin_model("m", {"kind": "replay"})
        entry = {k: v for k, v in _invocation().items() if k not in ("schema_version", "kind", "started_at")}
        with pytest.raises(ValidationError, match="replicate"):
            s.log_invocation({**{k: v for k, v in entry.items() if k != "replicates"}, "replicate": 1})
        assert not (run / "invocations.jsonl").exists()                  # refused before anything was written
        s.log_invocation(entry)
        assert [i.plan.run for i in s.invocations()] == [1]
        assert s.run_meta() == R.RunMeta(model="m", backend={"kind": "replay"}, created_at=s.run_meta().created_at)
    (run / "run.json").write_text(json.dumps({"store_version": 1, "model": 7, "backend": {}, "created_at": "t"}))
    with pytest.raises(StoreError, match=r"run.json: not a valid run.json record: model: Input should be a valid string"):
        RunStore(run).check_model("m")


def _as_written_before(run: Path) -> None:
    """Rewrite the run folder's records as the loop wrote them before the typed records."""
    inv = run / "invocations.jsonl"
    inv.write_text("".join(json.dumps({k: v for k, v in d.items() if k != "schema_version"}) + "\n"
                           for d in _lines(inv)))
    rt = run / "retime.jsonl"
    rt.write_text("".join(json.dumps({**d, "retime_version": 1, "windows": [
        {k: v for k, v in w.items() if k not in ("span_per_call_ms", "commit_ms")} for w in d["windows"]]}) + "\n"
        for d in _lines(rt)))


def test_a_resumed_run_reads_a_folder_written_before_the_typed_records(tmp_path: Path):
    from mkb_eval.agent.launch import run_trials
    from mkb_eval.agent.retiming import done_keys
    from mkb_eval.metrics.retimed import read_retimes
    from tests.agent.fake_retime import FakeRetime
    from tests.agent.test_replay import _fake_verify, _opts

    run = tmp_path / "run"
    calls: list[dict[str, Any]] = []
    run_trials(_opts(run, "28"), verify_fn=_fake_verify(calls), retime_fn=FakeRetime())
    keys = done_keys(run)
    _as_written_before(run)
    assert all("schema_version" not in d for d in _lines(run / "invocations.jsonl"))
    again = FakeRetime()
    summary, _ = run_trials(_opts(run, "28"), verify_fn=_fake_verify(calls), retime_fn=again)
    assert summary is None and again.calls == []                 # finished trials reused, re-timing found done
    assert done_keys(run) == keys and len(read_retimes(run)) == 2
    more = FakeRetime()
    summary, _ = run_trials(_opts(run, "28,36"), verify_fn=_fake_verify(calls), retime_fn=more)
    assert summary is not None and [c["problem_id"] for c in more.calls] == [36]
    with RunStore(run) as s:
        invs = s.invocations()
    assert [i.problems for i in invs] == [[28], [28, 36]] and invs[0].schema_version == 1
    assert "schema_version" not in _lines(run / "invocations.jsonl")[0]   # the old line is left as it was
    versions = [d["retime_version"] for d in _lines(run / "retime.jsonl")]
    assert versions == [1, 2]
