import json

from mkb_eval.cli import main
from mkb_eval.records import SCHEMA_VERSION


def test_problems_list_and_show(capsys):
    assert main(["problems", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["id"] == 28 for r in rows)
    assert main(["problems", "show", "28"]) == 0
    out = capsys.readouterr().out
    assert "fused_add_rmsnorm" in out and "SOL" in out


def test_unknown_problem_is_a_clear_error(capsys):
    assert main(["problems", "show", "99"]) == 2
    assert "no problem '99'" in capsys.readouterr().err


def test_verify_cpu_tier_json(capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    rc = main(["verify", "--problem", "36", "--dsl", "tirx", "--tier", "cpu", "--json", "--out", str(out)])
    rec = json.loads(capsys.readouterr().out)
    assert rc == 0 and rec["status"] == "unverified" and rec["schema_version"] == SCHEMA_VERSION
    assert rec["problem_hash"] and rec["kernel_sha256"] and rec["env"]["tvm"]
    assert json.loads(out.read_text().splitlines()[0])["status"] == "unverified"


def test_verify_missing_kernel(capsys, tmp_path):
    assert main(["verify", "--problem", "28", "--dsl", "tirx", "--kernel", str(tmp_path / "nope.py")]) == 2
    assert "no kernel file" in capsys.readouterr().err


def test_sweep_and_results_table(capsys, tmp_path):
    out = tmp_path / "sweep.jsonl"
    args = ["verify", "--all", "--problems", "36", "--dsl", "tirx", "--tier", "cpu", "--out", str(out)]
    assert main(args) == 0
    first = out.read_text().splitlines()
    assert len(first) == 1 and json.loads(first[0])["status"] == "unverified"
    shown = capsys.readouterr().out             # where the time went, stage by stage
    assert "| compile only | 1 |" in shown and "1 evaluations in" in shown and "per minute" in shown
    assert main(args) == 0                      # resumes: nothing left to do, nothing appended
    assert out.read_text().splitlines() == first
    capsys.readouterr()
    md = tmp_path / "t.md"
    assert main(["results", str(out), "--tier", "cpu", "--md", str(md)]) == 0
    assert "36_rmsnorm_h128_qwen3_30b_bf16 | tirx | unverified" in md.read_text()


def test_parallel_sweep_gives_the_same_records(tmp_path):
    seq, par = tmp_path / "seq.jsonl", tmp_path / "par.jsonl"
    base = ["verify", "--all", "--problems", "28,36", "--dsl", "tirx", "--tier", "cpu"]
    assert main(base + ["--out", str(seq)]) == 0
    assert main(base + ["--out", str(par), "--parallel", "2"]) == 0

    def key(path):
        return sorted((r["problem_id"], r["dsl"], r["status"], r["kernel_sha256"], r["problem_hash"])
                      for r in map(json.loads, path.read_text().splitlines()))

    assert key(seq) == key(par) and len(key(par)) == 2


def test_problem_id_lists_take_ranges_and_name_a_bad_one(capsys):
    import argparse

    import pytest

    from mkb_eval.cli import problem_ids

    assert problem_ids("1-3,28") == {1, 2, 3, 28} and problem_ids("36") == {36}
    for bad in ("5-2", "a,b", "1-"):
        with pytest.raises(argparse.ArgumentTypeError, match="1-43,50"):
            problem_ids(bad)
    with pytest.raises(SystemExit):
        main(["results", "x.jsonl", "--problems", "9-1"])
    assert "problem ids must look like" in capsys.readouterr().err


def test_results_restricted_to_problem_ids(tmp_path, capsys):
    import json

    recs = tmp_path / "r.jsonl"
    base = {"kind": "verification", "tier": "gpu", "dsl": "tirx", "status": "ok", "problem_hash": "h", "flags": [],
            "timing": {"kernel_ms": 1.0, "kernel_device_ms": None, "eager_ms": 2.0, "compile_ms": None, "speedup": 2.0,
                       "speedup_vs_compile": None, "sol_fraction": None}, "env": {}}
    recs.write_text("".join(json.dumps({**base, "problem_id": i, "problem": f"{i:02d}_p"}) + "\n" for i in (28, 36)))
    assert main(["results", str(recs), "--problems", "30-40"]) == 0
    out = capsys.readouterr().out
    assert "36_p" in out and "28_p" not in out
