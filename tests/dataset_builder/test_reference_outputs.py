"""A reference run on CPU reproduces the stored hashes; stored bytes decode to the reference's outputs."""

import hashlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dataset_builder.sources.reference_outputs import reproduce
from dataset_builder.sources.reference_worker import flatten, row_digest, tensor_bytes
from mkb_eval import problems as P
from mkb_eval.dataset import DatasetError, decode_tensor
from mkb_eval.harness.judge import Judge
from mkb_eval.harness.tolerance import run_reference
from tests.dataset_builder.conftest import IDS, Built


def _rows(built: Built) -> list[dict]:
    return pq.read_table(built.out / "reference_outputs" / "test-00000-of-00001.parquet").to_pylist()


def test_rows_cover_every_problem_and_public_seed(built: Built):
    rows = _rows(built)
    assert [(r["problem_id"], r["seed"]) for r in rows] == [(i, s) for i in IDS for s in (0, 1, 2)]
    for r in rows:
        assert r["ok"] and r["error"] is None and r["num_threads"] == 1 and r["size"] == "smoke"
        for e in r["outputs"]:
            assert hashlib.sha256(e["data"]).hexdigest() == e["sha256"]
        assert r["sha256"] == row_digest(r["structure"], r["outputs"])
    assert len({r["sha256"] for r in rows}) == len(rows)              # seeds give different outputs


def test_a_fresh_cpu_run_reproduces_every_hash(built: Built):
    assert reproduce(_rows(built), [P.find(i) for i in IDS]) == []


def test_a_changed_output_is_reported(built: Built):
    rows = _rows(built)
    rows[0] = {**rows[0], "sha256": "0" * 64}
    [bad] = reproduce(rows, [P.find(i) for i in IDS])
    assert (bad.problem_id, bad.seed) == (IDS[0], 0) and "sha256 differs" in bad.reason


def test_stored_bytes_decode_to_the_reference_outputs(built: Built):
    row = next(r for r in _rows(built) if r["problem_id"] == 28 and r["seed"] == 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        judge = Judge(P.find(28), "smoke", "cpu")
        structure, leaves = flatten(run_reference(judge.module.reference, judge.inputs(1)))
    finally:
        torch.set_num_threads(threads)
    assert structure == row["structure"] == "tensor"
    [(path, expected)] = leaves
    [entry] = row["outputs"]
    got = decode_tensor(entry)
    assert entry["path"] == path and got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_tuple_outputs_keep_their_structure(built: Built):
    row = next(r for r in _rows(built) if r["problem_id"] == 1)
    assert row["structure"] == "tuple[tensor,tensor]"
    assert [e["path"] for e in row["outputs"]] == ["output[0]", "output[1]"]
    assert [decode_tensor(e).dtype for e in row["outputs"]] == [torch.bfloat16, torch.float32]


def test_tensor_bytes_round_trip_every_dtype():
    for t in (torch.randn(3, 5).to(torch.bfloat16), torch.randn(4).to(torch.float8_e4m3fn),
              torch.tensor([True, False]), torch.arange(6, dtype=torch.int64).reshape(2, 3),
              torch.randn(2, 3).t(), torch.empty(0, 4)):
        entry = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": tensor_bytes(t)}
        back = decode_tensor(entry)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_decode_refuses_inconsistent_entries():
    with pytest.raises(DatasetError, match="unknown tensor dtype"):
        decode_tensor({"dtype": "float99", "shape": [1], "data": b"\0"})
    with pytest.raises(DatasetError, match="3 bytes for shape"):
        decode_tensor({"dtype": "float32", "shape": [1], "data": b"\0\0\0", "path": "output"})


def test_a_non_tensor_output_is_named():
    with pytest.raises(TypeError, match=r"output\[1\] is a float"):
        flatten((torch.zeros(1), 1.0))


def test_tasks_config_fails_clearly_without_the_prompt_renderer(monkeypatch):
    import sys

    from dataset_builder.errors import BuildError
    from dataset_builder.sources.tasks import task_rows

    monkeypatch.setitem(sys.modules, "mkb_eval.agent.prompts", None)      # as if the module did not exist
    with pytest.raises(BuildError, match=r"config 'tasks' needs mkb_eval.agent.prompts.render_task"):
        task_rows([P.find(28)])


def test_task_rows_keep_what_the_renderer_returns_and_refuse_an_empty_prompt():
    from types import SimpleNamespace

    from dataset_builder.errors import BuildError
    from dataset_builder.sources.tasks import task_rows

    rows = task_rows([P.find(28)], lambda p, d: SimpleNamespace(text=f"{p.name} in {d}\n", sha256="s", version=3))
    assert [(r["task_id"], r["prompt"], r["prompt_version"]) for r in rows] == [
        (f"{P.find(28).name}_cutedsl", f"{P.find(28).name} in cutedsl\n", "3"),
        (f"{P.find(28).name}_tirx", f"{P.find(28).name} in tirx\n", "3")]
    with pytest.raises(BuildError, match="returned an empty prompt"):
        task_rows([P.find(28)], lambda p, d: SimpleNamespace(text=" ", sha256="s", version=1))


def test_the_worker_runs_in_a_child_and_records_a_failing_reference(tmp_path: Path):
    import shutil

    from dataset_builder.sources.reference_outputs import reference_rows

    root = tmp_path / "problems"
    src = P.find(36).path
    dest = root / src.parent.name / src.name
    shutil.copytree(src, dest)
    ref = dest / "reference.py"
    failing = "def reference(*_a, **_k):\n    raise RuntimeError('boom')\n\n\ndef _unused("
    ref.write_text(ref.read_text().replace("def reference(", failing))
    [row] = reference_rows([P.find(36, root)], seeds=(0,), problems_root=root)
    assert row["ok"] is False and row["outputs"] == [] and row["sha256"] is None
    assert row["error"].startswith("RuntimeError: boom")
