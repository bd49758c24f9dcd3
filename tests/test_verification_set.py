"""The curated verification set: it is the one full sweep at the shipped hashes, and stale records show.

The committed ``results/h200/verification.jsonl`` must keep matching the shipped kernels and
problems record by record: a changed kernel or problem fails here until it is verified again on
the GPU and the set is re-curated (``scripts/curate_verification.py``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mkb_eval import problems as P
from mkb_eval import verification_set as V

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_set_verifies_every_shipped_kernel_at_its_current_hashes():
    shipped = V.shipped_hashes(P.load_all())
    recs = V.read_set(V.set_path("h200"))
    rep = V.match(recs, shipped)
    assert rep.complete, rep.describe()
    assert len(recs) == len(shipped) == 148 and len(rep.ok) == 148
    src = V.read_source(V.set_path("h200"))
    assert src["records"] == 148 and src["ok"] == 148 and src["history_commit"]
    assert [(r["problem_id"], r["dsl"]) for r in recs] == sorted(shipped)


def _rec(p: P.Problem, dsl: str, created: str, **kw) -> dict:
    from mkb_eval.records import VerificationRecord

    sha = V.shipped_hashes([p])[(p.id, dsl)][1]
    rec = VerificationRecord(status="ok", problem_id=p.id, problem=p.name, problem_hash=p.hash, dsl=dsl,
                             kernel_sha256=sha, tier="gpu", size="full", created_at=created).to_dict()
    return {**rec, **kw}


def test_choose_takes_the_newest_full_sweep_and_names_stale_records():
    probs = [P.find(28), P.find(36)]
    shipped = V.shipped_hashes(probs)
    old = [_rec(p, d, "2026-01-01") for p in probs for d in P.DSLS]
    new = [_rec(p, d, "2026-02-01") for p in probs for d in P.DSLS]
    stale = new[:-1] + [{**new[-1], "kernel_sha256": "0" * 64, "created_at": "2026-03-01"}]
    partial = new[:2]
    cands = [V.parse_candidate(n, "".join(json.dumps(r) + "\n" for r in rs) + "{torn")
             for n, rs in (("old", old), ("new", new), ("stale", stale), ("partial", partial))]
    best, rep = V.choose(cands, shipped)
    assert best.name == "new" and rep.complete and len(rep.ok) == 4
    srep = V.match(stale, shipped)
    assert not srep.complete and [m.key for m in srep.mismatched] == [(36, "tirx")]
    assert "kernel sha256 000000000000 != shipped" in srep.describe()
    assert V.match(partial, shipped).missing == ((36, "cutedsl"), (36, "tirx"))
    with pytest.raises(ValueError, match="no candidate is a full sweep.*stale: 3/4 shipped kernels matched"):
        V.choose([cands[2], cands[3]], shipped)


def test_read_set_refuses_a_torn_line(tmp_path: Path):
    path = tmp_path / "verification.jsonl"
    path.write_text(json.dumps(_rec(P.find(28), "tirx", "x")) + "\n{torn\n")
    with pytest.raises(ValueError, match=r"verification.jsonl:2: not JSON"):
        V.read_set(path)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_benchmark_history_packs_what_left_the_tree_deterministically(tmp_path: Path):
    hist = _load("benchmark_history")
    repo = tmp_path / "repo"
    (repo / "results" / "h200" / "bench").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "results" / "h200" / "bench" / "sweep.jsonl").write_text('{"a": 1}\n')
    (repo / "results" / "h200" / "README.md").write_text("kept\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "history")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    _git(repo, "rm", "-q", "results/h200/bench/sweep.jsonl")
    files = hist.history_files(repo, commit)
    assert [f.path for f in files] == ["results/h200/bench/sweep.jsonl"]
    a = hist.pack(files, commit, hist.commit_time(repo, commit))
    assert a == hist.pack(files, commit, hist.commit_time(repo, commit))
    out = tmp_path / "h.tar.gz"
    assert hist.main(["--repo", str(repo), "--commit", commit, "--out", str(out)]) == 0
    with tarfile.open(out) as tar:
        manifest = json.load(tar.extractfile("MANIFEST.json"))
        assert tar.extractfile("results/h200/bench/sweep.jsonl").read() == b'{"a": 1}\n'
    assert manifest["commit"] == commit and manifest["files"][0]["bytes"] == 9
    assert hist.main(["--repo", str(repo), "--commit", "f" * 40, "--out", str(out)]) == 2


def test_curate_writes_the_chosen_lines_verbatim_with_their_source(tmp_path: Path):
    cur = _load("curate_verification")
    probs = [P.find(28)]
    root = tmp_path / "problems"
    root.mkdir()
    import shutil

    shutil.copytree(probs[0].path, root / probs[0].family / probs[0].name)
    lines = [json.dumps(_rec(probs[0], d, "2026-02-01"), separators=(",", ":")) for d in reversed(P.DSLS)]
    src = tmp_path / "sweep.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "results" / "h200" / "verification.jsonl"
    assert cur.main(["--files", str(src), "--root", str(root), "--out", str(out)]) == 0
    assert out.read_text().splitlines() == list(reversed(lines))      # sorted by (problem, DSL), bytes kept
    meta = json.loads(out.with_name(V.SOURCE_FILE).read_text())
    assert meta["chosen"] == str(src) and meta["records"] == 2 and meta["ok"] == 2


def test_mkb_results_without_a_file_reads_the_curated_set(capsys):
    from mkb_eval.cli import main

    assert main(["results", "--json"]) == 0
    out = capsys.readouterr().out
    assert "| cutedsl | 74/74 |" in out and "| tirx | 74/74 |" in out
