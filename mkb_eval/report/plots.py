"""Report plots as PNG bytes (matplotlib's Agg canvas through ``Figure``; no pyplot global state).

Empty data draws an explicit "n/a" panel rather than an empty axis, so a missing arm is visible.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from mkb_eval.metrics.inputs import ARMS, DIRECTIONS
from mkb_eval.metrics.ladder import RATE_KEYS
from mkb_eval.metrics.units import direction_arms

COLORS = {"helped": "#2e7d32", "neutral": "#9e9e9e", "harmed": "#c62828"}
DIR_COLORS = {"cutedsl2tirx": "#1f77b4", "tirx2cutedsl": "#ff7f0e"}
ARM_STYLE = {
    "solo_cutedsl": ("#1f77b4", "-"),
    "solo_tirx": ("#ff7f0e", "-"),
    "cutedsl2tirx_skill": ("#ff7f0e", "--"),
    "tirx2cutedsl_skill": ("#1f77b4", "--"),
}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _na(ax: Any, text: str = "n/a: no resolved units") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#777777", fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])


def _pct_label(ratio: float) -> str:
    d = 100.0 * (ratio - 1.0)
    if abs(d) < 1e-9:
        return "0%"
    return f"{d:+.1f}%" if d < -99.0 else f"{d:+,.0f}%"


def lift_by_problem(problems: Sequence[Mapping[str, Any]]) -> bytes:
    """Per problem and direction: ΔGM (log-scaled paired speedup ratio) above, lift of S below."""
    pids = sorted({r["problem_id"] for r in problems})
    fig = Figure(figsize=(max(7.0, 0.55 * len(pids) + 2.5), 6.2), layout="constrained")
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    if not pids or all(r["n_resolved"] == 0 for r in problems):
        _na(ax1)
        _na(ax2)
        return _png(fig)
    width = 0.38
    for j, d in enumerate(DIRECTIONS):
        rows = {r["problem_id"]: r for r in problems if r["direction"] == d}
        xs = [i + (j - 0.5) * width for i in range(len(pids))]
        gm = [rows.get(p, {}).get("delta_gm") for p in pids]
        ls = [rows.get(p, {}).get("lift_S") for p in pids]
        y1 = [0.0 if v is None else math.log10(1.0 + v / 100.0) for v in gm]
        y2 = [0.0 if v is None else v for v in ls]
        ax1.bar(xs, y1, width, color=DIR_COLORS[d], label=d)
        ax2.bar(xs, y2, width, color=DIR_COLORS[d], label=d)
        for x, v in zip(xs, gm):
            if v is None:
                ax1.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90, color="#777777")
        for x, v in zip(xs, ls):
            if v is None:
                ax2.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90, color="#777777")
    lo, hi = ax1.get_ylim()
    ticks = [float(k) for k in range(math.ceil(lo), math.floor(hi) + 1)]
    if len(ticks) < 3:
        ticks = sorted({*ticks, math.log10(0.5), math.log10(2.0)})
    ax1.set_yticks(ticks)
    ax1.set_yticklabels([_pct_label(10.0**t) for t in ticks])
    for ax in (ax1, ax2):
        ax.axhline(0, color="black", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
    ax1.set_ylabel("ΔGM (log scale)")
    ax2.set_ylabel("lift of S (points)")
    ax1.set_title("Paired lift by problem and direction (skill vs base)")
    ax1.legend(loc="upper left", fontsize=8, frameon=False)
    ax2.set_xticks(range(len(pids)))
    ax2.set_xticklabels([f"p{p:02d}" for p in pids], rotation=90 if len(pids) > 20 else 0)
    return _png(fig)


def standing(groups: Mapping[str, Mapping[str, Any]]) -> bytes:
    """Helped / neutral / harmed shares within each source standing, one panel per group."""
    names = list(groups)
    fig = Figure(figsize=(4.2 * len(names), 3.4), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        table = groups[name]
        order = ["below", "same", "above"]
        if all(table[st]["n"] == 0 for st in order):
            _na(ax)
            ax.set_title(name)
            continue
        labeled: set[str] = set()
        for y, st in enumerate(order):
            v = table[st]
            n = v["n"]
            if n == 0:
                ax.text(0.5, y, "n/a (n = 0)", ha="center", va="center", color="#777777", fontsize=9)
                continue
            left = 0.0
            for k in ("helped", "neutral", "harmed"):
                w = v[k] / n
                ax.barh(y, w, left=left, color=COLORS[k], label="_nolegend_" if k in labeled else k)
                labeled.add(k)
                if w >= 0.12:
                    ax.text(left + w / 2, y, f"{100 * w:.0f}%", ha="center", va="center", color="white", fontsize=8)
                left += w
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels([f"source {st}\nn = {table[st]['n']}" for st in order], fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.set_xticklabels(["0", "25%", "50%", "75%", "100%"])
        ax.set_title(name)
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle("Skill vs base outcome by source standing (source tier vs base tier)")
    return _png(fig)


def ladders(results: Mapping[str, Any]) -> bytes:
    """R@t per arm: per direction over resolved units (source/base/skill), and over all attempts per arm."""
    fig = Figure(figsize=(13.0, 3.8), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    xs = list(range(len(RATE_KEYS)))
    panels: list[tuple[str, list[tuple[str, str, Mapping[str, Any]]]]] = []
    for d in DIRECTIONS:
        g = results["by_direction"][d]
        src, base, skill = direction_arms(d)
        panels.append((f"{d} (resolved units, n={g['n_resolved']})",
                       [(f"source {src}", src, g["source"]), (f"base {base}", base, g["base"]),
                        (f"skill {skill}", skill, g["skill"])]))
    panels.append(("all attempts per arm", [(f"{a} (n={results['arms'][a]['n_attempts']})", a, results["arms"][a])
                                           for a in ARMS]))
    for ax, (title, series) in zip(axes, panels):
        drawn = False
        for label, arm, lad in series:
            ys = [lad[k] for k in RATE_KEYS]
            if any(y is None for y in ys):
                label += ": n/a"
                ax.plot([], [], color=ARM_STYLE[arm][0], linestyle=ARM_STYLE[arm][1], label=label)
                continue
            marker = "s" if label.startswith("source") else "o"
            ax.plot(xs, ys, color=ARM_STYLE[arm][0], linestyle=ARM_STYLE[arm][1], marker=marker, label=label)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes, color="#777777")
        ax.set_xticks(xs)
        ax.set_xticklabels(RATE_KEYS)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, frameon=False, loc="upper right")
    axes[0].set_ylabel("share attaining")
    fig.suptitle("R@t ladders per arm")
    return _png(fig)
