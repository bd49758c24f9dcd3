"""The problem loader names exactly what is wrong in a malformed folder; the hash ignores layout."""

import shutil
from pathlib import Path

import pytest
import yaml

from mkb_eval import problems as P

GOOD = P.find(28).path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    dst = tmp_path / "mlp_norm" / GOOD.name
    shutil.copytree(GOOD, dst, ignore=shutil.ignore_patterns("solutions", "__pycache__"))
    return dst


def edit_yaml(folder: Path, **changes) -> None:
    cfg = yaml.safe_load((folder / "problem.yaml").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "problem.yaml").write_text(yaml.safe_dump(cfg))


def error_of(folder: Path) -> str:
    with pytest.raises(P.ProblemError) as e:
        P.load_problem(folder)
    return str(e.value)


def test_copy_loads(folder):
    p = P.load_problem(folder)
    assert p.id == 28 and p.family == "mlp_norm" and p.hash == P.find(28).hash


@pytest.mark.parametrize("changes,needle", [
    ({"id": None}, "missing required field 'id'"),
    ({"id": 29}, "does not match the folder number"),
    ({"id": "28"}, "field 'id' must be int"),
    ({"slug": "other_bf16"}, "does not match the folder name"),
    ({"family": "convolution"}, "family 'convolution' is not one of"),
    ({"family": "moe"}, "sits under 'mlp_norm'"),
    ({"dtype": "int4"}, "dtype 'int4' is not one of"),
    ({"dtype": "fp32"}, "must end with its dtype"),
    ({"description": "  "}, "description is empty"),
    ({"sizes": {"full": {"n": 1}}}, "sizes.smoke must be a non-empty mapping"),
    ({"sizes": {"full": {"n": 1}, "smoke": {"n": 1}, "huge": {"n": 2}}}, "unknown sizes ['huge']"),
    ({"mutates": [-1]}, "mutates must be a list"),
    ({"tolerance": {"factor": 0}}, "positive 'factor'"),
    ({"provenance": {"source": "x"}}, "provenance.notes"),
    ({"license": "CC-BY-NC-4.0"}, "not one we can ship"),
    ({"sol": {"flops": 1, "bytes": 1, "rate": "fp4_tensor", "bound": "memory"}}, "sol.rate 'fp4_tensor'"),
    ({"sol": {"flops": 1e15, "bytes": 1e3, "rate": "fp32", "bound": "memory"}}, "numbers give 'compute'"),
    ({"sol": {"bytes": 1}}, "sol needs numeric"),
    ({"colour": "blue"}, "unknown fields ['colour']"),
])
def test_malformed_yaml(folder, changes, needle):
    edit_yaml(folder, **changes)
    msg = error_of(folder)
    assert needle in msg and "problem.yaml" in msg, msg


@pytest.mark.parametrize("source,needle", [
    ("import torch\ndef reference(x): return x\ndef make_inputs(size='full', device='cuda'): return []\n",
     "missing module docstring"),
    ('"""Two\nlines."""\ndef reference(x): return x\ndef make_inputs(size, device): return []\n', "single line"),
    ('"""Doc."""\ndef make_inputs(size, device): return []\n', "missing top-level function 'reference'"),
    ('"""Doc."""\ndef reference(x): return x\ndef make_inputs(): return []\n', "must take a 'size' parameter"),
    ('"""Doc."""\ndef reference(x) return x\n', "syntax error at line 2"),
])
def test_malformed_reference(folder, source, needle):
    (folder / "reference.py").write_text(source)
    msg = error_of(folder)
    assert needle in msg and "reference.py" in msg, msg


def test_missing_files_and_bad_names(folder, tmp_path):
    (folder / "problem.yaml").unlink()
    assert "missing problem.yaml" in error_of(folder)
    bad = tmp_path / "mlp_norm" / "28-Fused"
    bad.mkdir()
    assert "folder name must be" in error_of(bad)
    (folder.parent / "x").write_text("")
    assert "not a directory" in error_of(folder.parent / "x")


def test_invalid_yaml_text(folder):
    (folder / "problem.yaml").write_text("id: [1,\n")
    assert "invalid YAML" in error_of(folder)


def test_load_all_lists_every_broken_folder(folder, tmp_path):
    other = tmp_path / "mlp_norm" / "36_rmsnorm_h128_qwen3_30b_bf16"
    shutil.copytree(P.find(36).path, other, ignore=shutil.ignore_patterns("solutions", "__pycache__"))
    edit_yaml(folder, license="proprietary")
    edit_yaml(other, dtype="fp64")
    with pytest.raises(P.ProblemError) as e:
        P.load_all(tmp_path)
    assert "28_" in str(e.value) and "36_" in str(e.value)


def test_hash_ignores_comments_and_layout():
    src = '"""Doc."""\nimport torch\n\n\ndef f(x):\n    return x + 1   # add one\n'
    variant = '"""Doc."""\n# a comment\nimport torch\ndef f( x ):\n\n        return x+1\n'
    changed = '"""Doc."""\nimport torch\n\n\ndef f(x):\n    return x + 2\n'
    fstr = 'x = 1\ny = f"a{x:>4} b"  # c\n'
    assert P.normalize_source(src) == P.normalize_source(variant)
    assert P.normalize_source(src) != P.normalize_source(changed)
    assert 'f"a{x:>4} b"' in P.normalize_source(fstr)
    assert P.problem_hash(src, {"a": 1}) != P.problem_hash(src, {"a": 2})


def test_find_by_id_name_and_slug():
    assert P.find(28).id == P.find("28").id == P.find("fused_add_rmsnorm_h4096_llama31_8b_bf16").id == 28
    with pytest.raises(P.ProblemError, match="no problem '99'"):
        P.find(99)
