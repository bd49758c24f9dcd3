"""Report plots as PNG bytes (matplotlib's Agg canvas through ``Figure``; no pyplot global state).

Empty data draws an explicit "no resolved units" panel rather than an empty axis, so a missing arm is
visible; every arm has its own colour, marker and line style.
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
DIR_HATCH = {"cutedsl2tirx": "", "tirx2cutedsl": "//"}
# every arm its own colour, marker and line style, so base and skill differ in each (also in grey print)
ARM_STYLE = {
    "solo_cutedsl": ("#1f77b4", "-", "o"),
    "solo_tirx": ("#ff7f0e", "-", "s"),
    "cutedsl2tirx_skill": ("#2ca02c", "--", "^"),
    "tirx2cutedsl_skill": ("#9467bd", "--", "D"),
}
NA_COLOR = "#777777"


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _na(ax: Any, text: str = "no resolved units") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=NA_COLOR, fontsize=11,
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _pct_label(ratio: float) -> str:
    d = 100.0 * (ratio - 1.0)
    if abs(d) < 1e-9:
        return "0%"
    return f"{d:+.1f}%" if d < -99.0 else f"{d:+,.0f}%"


def lift_by_problem(problems: Sequence[Mapping[str, Any]], n_resolved: int | None = None,
                    n_units: int | None = None) -> bytes:
    """Per problem and direction, one row each: ΔGM (log-scaled paired speedup ratio) left, lift of S right.

    Horizontal bars keep problem labels readable from 2 problems to all 74; a pair without a
    resolved unit gets a grey cross at zero (legend: n/a), a value of zero a dot, so neither reads
    as a missing bar. With no resolved unit at all both panels say so instead of drawing axes.
    """
    pids = sorted({r["problem_id"] for r in problems})
    resolved = sum(r["n_resolved"] for r in problems) if n_resolved is None else n_resolved
    units = sum(r["n_units"] for r in problems) if n_units is None else n_units
    height = max(3.2, 0.36 * len(pids) + 1.6)
    fig = Figure(figsize=(11.0, height), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    fig.suptitle("Paired lift by problem and direction (skill vs base)")
    if not pids or resolved == 0:
        why = f"no resolved units ({units} unit(s), none with both a skill and a base outcome)" if units else \
            "no units: the run has no skill-arm trials with their base"
        _na(ax1, why)
        _na(ax2, why)
        return _png(fig)
    width = 0.4
    ys = {p: i for i, p in enumerate(reversed(pids))}        # first problem on top
    na_drawn = False
    for j, d in enumerate(DIRECTIONS):
        rows = {r["problem_id"]: r for r in problems if r["direction"] == d}
        pos = [ys[p] + (0.5 - j) * width for p in pids]
        gm = [rows.get(p, {}).get("delta_gm") for p in pids]
        ls = [rows.get(p, {}).get("lift_S") for p in pids]
        for ax, vals, conv in ((ax1, gm, lambda v: math.log10(1.0 + v / 100.0)), (ax2, ls, lambda v: v)):
            xs = [0.0 if v is None else conv(v) for v in vals]
            ax.barh(pos, xs, width, color=DIR_COLORS[d], hatch=DIR_HATCH[d], edgecolor="white", linewidth=0.4,
                    label=d)
            zero = [(y) for y, v, x in zip(pos, vals, xs, strict=True) if v is not None and abs(x) < 1e-12]
            if zero:
                ax.plot([0.0] * len(zero), zero, "o", color=DIR_COLORS[d], markersize=3.5, linestyle="none")
            na = [y for y, v in zip(pos, vals, strict=True) if v is None]
            if na:
                ax.plot([0.0] * len(na), na, "x", color=NA_COLOR, markersize=4.5, linestyle="none",
                        label="_nolegend_" if na_drawn else "n/a (no resolved unit)")
                na_drawn = True
    for ax in (ax1, ax2):                 # zero (and the n/a crosses on it) never sits on the frame
        lo, hi = ax.get_xlim()
        pad = 0.06 * max(hi - lo, 1e-9)
        ax.set_xlim(min(lo, -pad), max(hi, pad))
    lo, hi = ax1.get_xlim()
    ticks = [float(k) for k in range(math.ceil(lo), math.floor(hi) + 1)]
    if len(ticks) < 3:
        ticks = sorted({*ticks, math.log10(0.5), 0.0, math.log10(2.0)})
    ax1.set_xticks(ticks)
    ax1.set_xticklabels([_pct_label(10.0**t) for t in ticks], fontsize=8)
    for ax in (ax1, ax2):
        ax.axvline(0, color="black", linewidth=0.8)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(y=0.5 / max(1, len(pids)))
    ax1.set_xlabel("ΔGM (log scale)")
    ax2.set_xlabel("lift of S (points)")
    ax1.set_yticks(list(ys.values()))
    ax1.set_yticklabels([f"p{p:02d}" for p in ys], fontsize=8 if len(pids) > 30 else 9)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False, fontsize=8)
    return _png(fig)


def standing(groups: Mapping[str, Mapping[str, Any]]) -> bytes:
    """Helped / neutral / harmed shares within each source standing, one panel per group."""
    names = list(groups)
    fig = Figure(figsize=(4.2 * len(names), 3.4), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
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
        ax.set_ylim(-0.6, len(order) - 0.4)          # n/a labels of the outer rows stay inside the frame
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels([f"source {st}\nn = {table[st]['n']}" for st in order], fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.set_xticklabels(["0", "25%", "50%", "75%", "100%"])
        ax.set_title(name)
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab, strict=True):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle("Skill vs base outcome by source standing (source tier vs base tier)")
    return _png(fig)


def ladders(results: Mapping[str, Any]) -> bytes:
    """R@t per arm: per direction over resolved units (source/base/skill), and over all attempts per arm."""
    fig = Figure(figsize=(13.0, 4.6), layout="constrained")
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
    for ax, (title, series) in zip(axes, panels, strict=True):
        drawn = False
        for i, (label, arm, lad) in enumerate(series):
            color, style, marker = ARM_STYLE[arm]
            ys = [lad[k] for k in RATE_KEYS]
            if any(y is None for y in ys):
                ax.plot([], [], color=color, linestyle=style, marker=marker, label=label + ": n/a")
                continue
            # coinciding series (e.g. all at 0) stay visible: hollow markers, each smaller than the one before
            ax.plot(xs, ys, color=color, linestyle=style, marker=marker, markerfacecolor="white",
                    markeredgewidth=1.4, markersize=10 - 2.2 * i, linewidth=1.8 - 0.3 * i, label=label)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no resolved units", ha="center", va="center", transform=ax.transAxes, color=NA_COLOR)
        ax.set_xticks(xs)
        ax.set_xticklabels(RATE_KEYS)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7.5, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)
    axes[0].set_ylabel("share attaining")
    fig.suptitle("R@t ladders per arm")
    return _png(fig)
