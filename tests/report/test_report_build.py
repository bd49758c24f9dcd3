"""`mkb report`: files, self-containment, hand-computed cells, n/a for missing arms, bad input, determinism."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from mkb_hand_records import REPO_ROOT, hand_records, rec

from mkb_eval.metrics import SchemaVersionError
from mkb_eval.report import build_report
from mkb_eval.report.__main__ import main

FAST = {"n_resamples": 200}


def row(md: str, first: str) -> list[str]:
    """Cells of the first markdown table row whose first cell is `first`."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r}")


def test_report_files_and_hand_cells(make_run: Callable[..., Path]) -> None:
    run = make_run(hand_records())
    paths = build_report(run, **FAST)
    assert set(paths) == {"markdown", "html", "json", "plot_lift_by_problem", "plot_standing", "plot_ladders"}
    assert all(p.is_file() and p.parent.parent in (run, run / "report") for p in paths.values())
    md = paths["markdown"].read_text(encoding="utf-8")
    # overall: 9 of 12 units, 5 problems, source passed 6/9, skill used 8/9, S 44.4 -> 35.6, lift -8.9,
    # T 3/9, H 2/9, sign test 1.000 (see tests/metrics/test_metric_hand_tables.py)
    cells = row(md, "overall")
    assert cells[:7] == ["overall", "9 / 12", "5", "66.7%", "88.9%", "44.4", "35.6"]
    assert cells[7].startswith("-8.9 [") and cells[8].startswith("33.3% [") and cells[9].startswith("22.2% [")
    assert cells[10].startswith("-41.2% [") and cells[11] == "1.000"
    assert row(md, "cutedsl2tirx")[:7] == ["cutedsl2tirx", "5 / 6", "5", "60.0%", "100.0%", "44.0", "48.0"]
    # an all-unresolved family renders n/a everywhere, never 0
    assert row(md, "kv_cache") == ["kv_cache", "0 / 2", "0"] + ["n/a"] * 9
    # an all-fail family renders real zeros
    assert row(md, "quantization")[:9] == ["quantization", "2 / 2", "1", "0.0%", "100.0%", "0.0", "0.0",
                                           "+0.0 [+0.0, +0.0]", "0.0% [0.0, 0.0]"]
    assert row(md, "solo_cutedsl") == ["solo_cutedsl", "6", "4", "0", "0", "0", "66.7%", "66.7%", "50.0",
                                       "50.0%", "1.76x"]
    assert "| m | p62 | tirx2cutedsl | r1 | missing |" in md
    assert "| m | p25 | cutedsl2tirx | r1 | error |" in md
    assert "**ΔGM**" in md and "![R@t ladders per arm](plots/ladders.png)" in md
    results = json.loads(paths["json"].read_text())
    assert results["overall"]["paired"]["helped"] == 3


def test_html_is_self_contained(make_run: Callable[..., Path]) -> None:
    paths = build_report(make_run(hand_records()), **FAST)
    page = paths["html"].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)  # nothing fetched from anywhere
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3
    assert all(base64.b64decode(i).startswith(b"\x89PNG\r\n\x1a\n") for i in images)
    assert '<td class="num na">n/a</td>' in page


def test_missing_arms_give_na_not_zero(make_run: Callable[..., Path]) -> None:
    solos = [r for r in hand_records()[1:] if r["arm"].startswith("solo_")]
    paths = build_report(make_run(solos), **FAST)
    md = paths["markdown"].read_text(encoding="utf-8")
    assert row(md, "overall") == ["overall", "0 / 12", "0"] + ["n/a"] * 9
    assert row(md, "cutedsl2tirx_skill") == ["cutedsl2tirx_skill", "0", "0", "0", "0", "0"] + ["n/a"] * 5
    assert row(md, "solo_tirx")[6] == "80.0%"  # the solos are still scored at attempt level
    results = json.loads(paths["json"].read_text())
    assert results["overall"]["lift"]["S"] is None and results["overall"]["paired"]["help_rate"] is None


def test_one_direction_only(make_run: Callable[..., Path]) -> None:
    recs = [r for r in hand_records()[1:] if r["arm"] != "tirx2cutedsl_skill"]
    md = build_report(make_run(recs), **FAST)["markdown"].read_text(encoding="utf-8")
    assert row(md, "tirx2cutedsl") == ["tirx2cutedsl", "0 / 6", "0"] + ["n/a"] * 9
    assert row(md, "cutedsl2tirx")[1] == "5 / 6"


def test_empty_run(make_run: Callable[..., Path]) -> None:
    paths = build_report(make_run([]), **FAST)
    assert "Units: 0 resolved of 0" in paths["markdown"].read_text(encoding="utf-8")


def test_torn_line_is_reported(make_run: Callable[..., Path]) -> None:
    recs: list = hand_records()
    recs.insert(2, '{"schema_version": 1, "trial": "p01_r1_solo')
    with pytest.warns(UserWarning, match="attempts.jsonl:3"):
        paths = build_report(make_run(recs), **FAST)
    assert "attempts.jsonl:3: malformed JSON" in paths["html"].read_text(encoding="utf-8")


def test_newer_schema_is_refused(make_run: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run([rec(1, "solo_cutedsl", "ok", 2.0), rec(1, "solo_tirx", "ok", 1.0, schema_version=3)])
    with pytest.raises(SchemaVersionError, match="attempts.jsonl:2: attempt record has schema_version 3"):
        build_report(run)
    assert main([str(run)]) == 2
    assert "schema_version 3" in capsys.readouterr().err
    assert not (run / "report").exists()


def test_rebuild_is_bit_identical(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(hand_records())
    a = build_report(run, tmp_path / "a", **FAST)
    b = build_report(run, tmp_path / "b", **FAST)
    for kind in a:
        assert a[kind].read_bytes() == b[kind].read_bytes(), kind


def test_python_dash_m(make_run: Callable[..., Path]) -> None:
    run = make_run(hand_records())
    out = subprocess.run([sys.executable, "-m", "mkb_eval.report", str(run), "--resamples", "50"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"html: {run / 'report' / 'report.html'}" in out.stdout
    assert (run / "report" / "plots" / "standing.png").is_file()
    missing = subprocess.run([sys.executable, "-m", "mkb_eval.report", str(run / "nope")],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no attempts file" in missing.stderr
