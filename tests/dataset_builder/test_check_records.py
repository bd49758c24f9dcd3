"""``mkb dataset check`` fails a build whose records do not belong to the checkout's kernels and problems."""

from __future__ import annotations

import shutil
from pathlib import Path

from dataset_builder.check import check_records
from mkb_eval import cli
from mkb_eval import problems as P
from mkb_eval.dataset import check_folder
from tests.dataset_builder.conftest import IDS, Built


def _copy_problems(tmp_path: Path) -> Path:
    root = tmp_path / "problems"
    for i in IDS:
        p = P.find(i)
        shutil.copytree(p.path, root / p.family / p.name)
    return root


def test_a_fresh_build_checks_against_its_checkout(built: Built, capsys):
    info = check_folder(built.out, verify_hashes=True)
    res = check_records(info.configs, P.load_all())
    assert res.findings == () and res.solutions == res.verified == 8 and res.baselines == 4
    assert cli.main(["dataset", "check", str(built.out)]) == 0
    assert "solutions 8/8 verified, baselines 4 rows: records match" in capsys.readouterr().out


def test_a_changed_kernel_or_problem_fails_the_check(built: Built, tmp_path: Path, capsys):
    root = _copy_problems(tmp_path)
    p28 = next(root.glob("*/28_*"))
    (p28 / "solutions" / "tirx.py").write_text((p28 / "solutions" / "tirx.py").read_text() + "\n# edited\n")
    p36 = next(root.glob("*/36_*"))
    (p36 / "problem.yaml").write_text((p36 / "problem.yaml").read_text().replace("description: >", "description: >\n  Edited."))
    res = check_records(check_folder(built.out).configs, P.load_all(root))
    assert any(f.startswith("solutions p28 tirx: built from kernel") and f.endswith("rebuild") for f in res.findings)
    assert sum(f.startswith("solutions p36") for f in res.findings) == 2
    assert any(f.startswith("baselines p36: measured for problem") for f in res.findings)
    assert not any("p28 cutedsl" in f or "p01" in f for f in res.findings)
    assert cli.main(["--root", str(root), "dataset", "check", str(built.out)]) == 1
    out = capsys.readouterr().out
    assert "RECORD solutions p28 tirx" in out and "records do not all match" in out
