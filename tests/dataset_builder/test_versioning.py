import json
import shutil
from pathlib import Path

import pytest

from dataset_builder.build import BuildOptions, build_dataset
from dataset_builder.errors import BuildError
from dataset_builder.versioning import (
    Version,
    bump_of,
    changelog,
    changelog_entry,
    diff_problems,
    parse_version,
)
from mkb_eval import problems as P
from mkb_eval.dataset import read_manifest


def test_semver_parsing_and_bumps():
    assert parse_version("1.2.3") == Version(1, 2, 3) and Version(1, 2, 3).tag == "v1.2.3"
    for bad in ("1.2", "v1.2.3", "1.2.3-rc1", "01.2.3", ""):
        with pytest.raises(BuildError, match="not semver"):
            parse_version(bad)
    assert [bump_of(Version(1, 2, 3), parse_version(v)) for v in ("1.2.3", "1.2.4", "1.3.0", "2.0.0")] == [
        "none", "patch", "minor", "major"]
    with pytest.raises(BuildError, match="lower than the previous"):
        bump_of(Version(1, 2, 3), Version(1, 2, 2))


def _entry(h: str, sols: dict) -> dict:
    return {"name": "x", "problem_hash": h, "solutions": sols, "fingerprint": h + json.dumps(sols, sort_keys=True)}


def test_diff_names_what_changed_and_the_bump_it_needs():
    old = {"01": _entry("a", {"cutedsl": "k", "tirx": None}), "02": _entry("b", {"cutedsl": None, "tirx": None})}
    assert diff_problems(old, old).required_bump == "none"
    sol = {**old, "01": _entry("a", {"cutedsl": "k2", "tirx": "t"})}
    d = diff_problems(old, sol)
    assert d.changed == (("01", ("cutedsl solution changed", "tirx solution added")),) and d.required_bump == "patch"
    assert diff_problems(old, {**old, "03": _entry("c", {})}).required_bump == "minor"
    assert diff_problems(old, {"01": old["01"]}).required_bump == "major"
    assert diff_problems(old, {**old, "02": _entry("b2", {"cutedsl": None, "tirx": None})}).required_bump == "major"


def test_changelog_entry_enforces_the_bump_and_accumulates():
    probs = {"01": _entry("a", {"cutedsl": "k", "tirx": None})}
    prev = {"dataset_version": "1.0.0", "problems": probs, "configs": {"problems": {"rows": 1}},
            "changelog": [{"version": "1.0.0", "previous": None, "changes": ["initial release: 1 problems"]}]}
    assert changelog_entry(Version(1, 0, 0), prev, probs, {"problems": 1})["changes"] == ["no changes"]
    changed = {"01": _entry("a2", {"cutedsl": "k", "tirx": None})}
    with pytest.raises(BuildError, match=r"need at least a major version bump from 1.0.0, but 1.1.0 is a minor"):
        changelog_entry(Version(1, 1, 0), prev, changed, {"problems": 1})
    with pytest.raises(BuildError, match="already built with different content"):
        changelog_entry(Version(1, 0, 0), prev, probs, {"problems": 1, "attempts": 5})
    e = changelog_entry(Version(1, 0, 1), prev, probs, {"problems": 1, "attempts": 5})
    assert e == {"version": "1.0.1", "previous": "1.0.0", "changes": ["attempts: 0 -> 5 rows"]}
    assert [x["version"] for x in changelog(e, prev)] == ["1.0.1", "1.0.0"]


def _copy_problems(root: Path, ids: tuple[int, ...]) -> Path:
    for i in ids:
        src = P.find(i).path
        shutil.copytree(src, root / src.parent.name / src.name)
    return root


def test_a_rebuild_after_problem_changes_writes_a_generated_changelog(tmp_path: Path):
    root = _copy_problems(tmp_path / "problems", (28, 36))
    v1 = tmp_path / "v1" / "metakernelbench"
    opts = BuildOptions(out=v1, version="1.0.0", configs=("problems",), problems_root=root, runs=())
    build_dataset(opts)

    ref = P.find(36, root).reference_path
    ref.write_text(ref.read_text() + "\nUNUSED_CONSTANT = 1\n")            # a definition change
    _copy_problems(root, (25,))
    v2 = tmp_path / "v2" / "metakernelbench"
    with pytest.raises(BuildError, match="need at least a major version bump"):
        build_dataset(BuildOptions(**{**opts.__dict__, "out": v2, "version": "1.1.0", "previous": v1}))
    assert not v2.exists()                                     # a refused build leaves nothing behind
    res = build_dataset(BuildOptions(**{**opts.__dict__, "out": v2, "version": "2.0.0", "previous": v1}))
    n25, n36 = P.find(25, root).name, P.find(36, root).name
    assert res.changelog_entry == {"version": "2.0.0", "previous": "1.0.0", "changes": [
        f"problem 25 ({n25}) added", f"problem 36 ({n36}): definition", "problems: 2 -> 3 rows"]}
    m = read_manifest(v2)
    assert [e["version"] for e in m["changelog"]] == ["2.0.0", "1.0.0"]
    old_hash = read_manifest(v1)["problems"]["36"]["problem_hash"]
    assert m["problems"]["36"]["problem_hash"] == P.find(36, root).hash != old_hash
    card = (v2 / "README.md").read_text()
    assert "### 2.0.0 (from 1.0.0)" in card and f"- problem 36 ({n36}): definition" in card and "### 1.0.0" in card
    assert "dataset_version: 2.0.0" in card


def test_the_previous_build_may_be_replaced_in_place(tmp_path: Path):
    root = _copy_problems(tmp_path / "problems", (36,))
    out = tmp_path / "metakernelbench"
    opts = BuildOptions(out=out, version="1.0.0", configs=("problems",), problems_root=root)
    build_dataset(opts)
    sol = P.find(36, root).solution_path("tirx")
    sol.write_text(sol.read_text() + "\n# tuned\n")
    res = build_dataset(BuildOptions(**{**opts.__dict__, "version": "1.0.1", "previous": out}))
    assert res.changelog_entry["changes"] == [f"problem 36 ({P.find(36, root).name}): tirx solution changed"]
    assert read_manifest(out)["dataset_version"] == "1.0.1"
    assert sorted(p.name for p in out.parent.iterdir()) == ["metakernelbench", "problems"]   # no staging left


def test_solution_hash_matches_the_verifiers_text_hash(tmp_path: Path):
    import hashlib

    from dataset_builder.versioning import source_sha256

    f = tmp_path / "k.py"
    f.write_bytes(b"def solve(*x):\r\n    return x[0]\r\n")
    assert source_sha256(f.read_bytes()) == hashlib.sha256(f.read_text(errors="replace").encode()).hexdigest()
