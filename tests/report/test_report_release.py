"""The report explains itself: tiers and statuses per arm, no empty axes, arms told apart, readable from 4 to 148
units, and the HTML renders in headless Chromium (a screenshot)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from mkb_eval.report import plots
from mkb_eval.report.build import build_report
from mkb_eval.report.screenshot import find_browser, screenshot
from tests.report.synth import records, write_run

FAST = {"n_resamples": 100}


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """Every figure a plot function renders, kept for inspection."""
    seen: list[Figure] = []
    real = plots._png
    monkeypatch.setattr(plots, "_png", lambda fig: (seen.append(fig), real(fig))[1])
    return seen


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_tier_and_status_per_arm(tmp_path: Path) -> None:
    recs = records([28, 36], tier="cpu", seed=3)
    md = build_report(write_run(tmp_path / "cpu", recs), **FAST)["markdown"].read_text()
    assert "- Verification tier: cpu (8 attempts); on the CPU tier no kernel runs" in md
    table = md.split("### Verification tier and final status per arm", 1)[1].split("###", 1)[0]
    for arm in ("solo_cutedsl", "solo_tirx", "cutedsl2tirx_skill", "tirx2cutedsl_skill"):
        mine = [r for r in recs if r["arm"] == arm]
        cells = next(line for line in table.splitlines() if line.startswith(f"| {arm} |")).split(" | ")
        assert cells[1] == "cpu 2" and cells[2] == "2"
        header = next(line for line in table.splitlines() if line.startswith("| arm |")).strip("| ").split(" | ")
        for st in {r["status"] for r in recs}:
            assert cells[header.index(st)] == str(sum(r["status"] == st for r in mine))
    assert "'unverified' = compiled but never run" in table


def test_no_resolved_unit_says_so_instead_of_empty_axes(figures: list[Figure]) -> None:
    plots.lift_by_problem([{"problem_id": 28, "direction": "cutedsl2tirx", "n_units": 1, "n_resolved": 0,
                            "delta_gm": None, "lift_S": None}], 0, 1)
    assert all(any("no resolved units" in t for t in [t.get_text() for t in ax.texts]) for ax in figures[-1].axes)
    assert all(not ax.patches for ax in figures[-1].axes)


def test_base_and_skill_differ_in_colour_and_marker(tmp_path: Path, figures: list[Figure]) -> None:
    styles = list(plots.ARM_STYLE.values())
    assert len({c for c, _, _ in styles}) == 4 and len({m for _, _, m in styles}) == 4
    build_report(write_run(tmp_path / "r", records([28, 36], tier="cpu")), **FAST)   # every arm at 0: all overlap
    ladder = next(f for f in figures if f.get_suptitle() == "R@t ladders per arm")
    for ax in ladder.axes:
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith(("base", "skill", "solo", "cutedsl2", "tirx2"))]
        assert len({ln.get_color() for ln in lines}) == len(lines) == len({ln.get_marker() for ln in lines})
        assert len({ln.get_markersize() for ln in lines}) == len(lines)      # coinciding markers nest, not hide


@pytest.mark.parametrize("ids", [[28, 36], list(range(1, 75))])
def test_lift_plot_is_readable_at_4_and_148_units(ids: list[int], tmp_path: Path, figures: list[Figure]) -> None:
    build_report(write_run(tmp_path / "r", records(ids, seed=1)), **FAST)
    fig = next(f for f in figures if f.get_suptitle().startswith("Paired lift"))
    ax1, ax2 = fig.axes[:2]
    labels = [t.get_text() for t in ax1.get_yticklabels()]
    assert labels == [f"p{p:02d}" for p in reversed(ids)]             # every problem named, bottom up: first on top
    w, h = fig.get_size_inches()
    assert w <= 12 and h / len(ids) >= 0.3                            # rows of at least 0.3 in, width bounded
    for ax in (ax1, ax2):
        lo, hi = ax.get_xlim()
        assert lo < 0 < hi                                            # the zero line and n/a crosses are inside
        for ln in ax.get_lines():
            assert all(lo < x < hi for x in ln.get_xdata())


def test_standing_na_labels_stay_inside_the_frame(figures: list[Figure]) -> None:
    empty = {"n": 0, "helped": 0, "harmed": 0, "neutral": 0, "help_rate": None, "harm_rate": None}
    full = {"n": 2, "helped": 1, "harmed": 1, "neutral": 0, "help_rate": 0.5, "harm_rate": 0.5}
    plots.standing({"overall": {"below": empty, "same": full, "above": empty}})
    ax = figures[-1].axes[0]
    lo, hi = ax.get_ylim()
    assert all(lo < t.get_position()[1] < hi for t in ax.texts)


def test_the_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    if find_browser() is None:
        if os.environ.get("CI"):
            pytest.fail("no headless Chromium in CI (.ci/run installs chromium-headless-shell)")
        pytest.skip("no headless Chromium here (apt-get install chromium-headless-shell, or set MKB_CHROMIUM)")
    html = build_report(write_run(tmp_path / "r", records([28, 36], seed=1)), **FAST)["html"]
    png = screenshot(html, tmp_path / "report.png", width=1200, height=1100)
    from matplotlib.image import imread

    img = imread(png)
    assert img.shape[:2] == (1100, 1200) and float(img[..., :3].std()) > 0.05       # a page, not a blank
    keep = os.environ.get("MKB_REPORT_SCREENSHOT")                                    # CI keeps it as an artifact
    if keep:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, keep)
