"""Report tables: built once from the results dict, rendered to markdown and to HTML.

Every cell goes through one formatter per kind of number, and None always renders as "n/a", so a
missing arm or an empty group can never read as a zero.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mkb_eval.metrics.inputs import ARMS, DIRECTIONS
from mkb_eval.metrics.ladder import LADDER_KEYS
from mkb_eval.metrics.units import direction_arms

NA = "n/a"


def pct(x: float | None, digits: int = 1) -> str:
    """A share as a percentage: 0.4286 -> "42.9%"."""
    return NA if x is None else f"{100.0 * x:.{digits}f}%"


def signed(x: float | None, digits: int = 1, unit: str = "") -> str:
    """A difference with its sign: +7.1, -3.0 pp, +1,234.5%."""
    return NA if x is None else f"{x:+,.{digits}f}{unit}"


def num(x: float | None, digits: int = 1) -> str:
    return NA if x is None else f"{x:.{digits}f}"


def ratio(x: float | None) -> str:
    """A speedup: 1.23x."""
    return NA if x is None else f"{x:.2f}x"


def pvalue(x: float | None) -> str:
    return NA if x is None else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def ci(interval: Sequence[float] | None, fmt: str = "signed", scale: float = 1.0) -> str:
    """A bootstrap interval as "[lo, hi]" in the same units as its point estimate."""
    if interval is None:
        return NA
    spec = "+,.1f" if fmt == "signed" else ",.1f"
    lo, hi = (format(scale * v, spec) for v in interval)
    return f"[{lo}, {hi}]"


def with_ci(point: str, interval: str) -> str:
    return point if interval == NA else f"{point} {interval}"


_NUMERIC = re.compile(r"^([+-]?[\d.,]+(%| pp|x)?( \[.*\])?|\d+ / \d+( / \d+)?|n/a)$")


def is_numeric_column(cells: Sequence[str]) -> bool:
    """Right-align a column when every cell is a number (or n/a) and at least one is not n/a."""
    return any(c != NA for c in cells) and all(_NUMERIC.match(c) for c in cells)


@dataclass
class Table:
    """A titled table of preformatted cells, with an optional note under it."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def numeric(self) -> list[bool]:
        """Which columns hold numbers (right-aligned)."""
        return [bool(self.rows) and is_numeric_column([r[i] for r in self.rows]) for i in range(len(self.headers))]

    def markdown(self) -> str:
        def esc(c: str) -> str:
            return c.replace("|", "\\|")

        lines = [f"### {self.title}", "", "| " + " | ".join(map(esc, self.headers)) + " |"]
        lines.append("|" + "|".join("---:" if num else "---" for num in self.numeric()) + "|")
        lines += ["| " + " | ".join(map(esc, r)) + " |" for r in self.rows]
        if self.note:
            lines += ["", f"_{self.note}_"]
        return "\n".join(lines) + "\n"

    def html(self) -> str:
        e = html.escape
        num = self.numeric()

        def cls(i: int, c: str = "") -> str:
            names = [n for n, on in (("num", num[i]), ("na", c == NA)) if on]
            return f' class="{" ".join(names)}"' if names else ""

        head = "".join(f"<th{cls(i)}>{e(h)}</th>" for i, h in enumerate(self.headers))
        body = "".join(
            "<tr>" + "".join(f"<td{cls(i, c)}>{e(c)}</td>" for i, c in enumerate(r)) + "</tr>" for r in self.rows
        )
        note = f'<p class="note">{e(self.note)}</p>' if self.note else ""
        return f"<h3>{e(self.title)}</h3><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"


HEADLINE = ["group", "resolved / units", "problems", "source passed", "skill used", "base S", "skill S",
            "lift S [95% CI]", "T help [95% CI]", "H harm [95% CI]", "ΔGM [95% CI]", "sign test p"]


def headline_row(name: str, g: Mapping[str, Any]) -> list[str]:
    """One line of the headline table for a group."""
    p, c = g["paired"], g.get("ci") or {}
    return [
        name,
        f"{g['n_resolved']} / {g['n_units']}",
        str(g["n_problems"]),
        pct(g["source_coverage"]),
        pct(g["skill_coverage"]),
        num(g["base"]["S"]),
        num(g["skill"]["S"]),
        with_ci(signed(g["lift"]["S"]), ci(c.get("lift_S"))),
        with_ci(pct(p["help_rate"]), ci(c.get("help_rate"), "plain", 100.0)),
        with_ci(pct(p["harm_rate"]), ci(c.get("harm_rate"), "plain", 100.0)),
        with_ci(signed(p["delta_gm"], unit="%"), ci(c.get("delta_gm"))),
        pvalue(p["sign_test_p"]),
    ]


def headline_table(results: Mapping[str, Any]) -> Table:
    rows = [headline_row("overall", results["overall"])]
    rows += [headline_row(d, results["by_direction"][d]) for d in DIRECTIONS]
    return Table(
        "Paired transfer by direction",
        HEADLINE,
        rows,
        "lift S in S points (0-100); T, H shares of resolved units; ΔGM geometric-mean paired speedup ratio - 1 "
        "(failures floored); CIs: percentile bootstrap over problems.",
    )


def family_table(results: Mapping[str, Any]) -> Table:
    rows = [headline_row(f, g) for f, g in results["by_family"].items()]
    return Table("Paired transfer by family", ["family", *HEADLINE[1:]], rows)


def model_table(results: Mapping[str, Any]) -> Table:
    rows = [headline_row(m, g) for m, g in results["by_model"].items()]
    return Table("Paired transfer by model", ["model", *HEADLINE[1:]], rows)


def ladder_table(results: Mapping[str, Any]) -> Table:
    """R@t and S of source, base and skill, and the lift, per direction (resolved units)."""
    rows = []
    for d in DIRECTIONS:
        g = results["by_direction"][d]
        src, base, skill = direction_arms(d)
        for label, arm in (("source", src), ("base", base), ("skill", skill)):
            lad = g[label]
            rows.append([d, f"{label} ({arm})", *(pct(lad[k]) for k in LADDER_KEYS[:-1]), num(lad["S"])])
        lad = g["lift"]
        rows.append([d, "lift (skill - base)", *(signed(None if lad[k] is None else 100.0 * lad[k], unit=" pp")
                                                for k in LADDER_KEYS[:-1]), signed(lad["S"])])
    return Table("R@t ladders per direction (resolved units; skipped skill = base)",
                 ["direction", "arm", *LADDER_KEYS], rows)


def standing_table(results: Mapping[str, Any]) -> Table:
    """Helped / harmed / neutral by where the source stood relative to the base."""
    rows = []
    for name, g in [("overall", results["overall"])] + [(d, results["by_direction"][d]) for d in DIRECTIONS]:
        for st, v in g["standing"].items():
            n = v["n"]
            rows.append([name, st, str(n), pct(v["help_rate"]), pct(v["harm_rate"]),
                         pct(None if n == 0 else v["neutral"] / n)])
    return Table("Outcomes by source standing (source tier vs base tier)",
                 ["group", "source vs base", "n", "helped", "harmed", "neutral"], rows)


def verdict_table(results: Mapping[str, Any]) -> Table:
    """The original's with_skill and by_source_verdict contrasts, per direction and overall."""
    rows = []
    for name, g in [("overall", results["overall"])] + [(d, results["by_direction"][d]) for d in DIRECTIONS]:
        for label, c in (("all resolved", g), ("with skill", g["with_skill"]),
                         ("source passed", g["by_source_verdict"]["passed"]),
                         ("source failed", g["by_source_verdict"]["failed"])):
            n = c["n_resolved"] if "n_resolved" in c else c["n"]
            p = c["paired"]
            rows.append([name, label, str(n), num(c["base"]["S"]), num(c["skill"]["S"]), signed(c["lift"]["S"]),
                         pct(p["help_rate"]), pct(p["harm_rate"]), signed(p["delta_gm"], unit="%")])
    return Table("Contrasts by skill use and source verdict",
                 ["group", "subset", "n", "base S", "skill S", "lift S", "T", "H", "ΔGM"], rows)


def arm_table(results: Mapping[str, Any]) -> Table:
    """Attempt-level rates per arm over all its attempts (not only resolved units)."""
    rows = []
    for arm in ARMS:
        a = results["arms"][arm]
        rows.append([arm, str(a["n_attempts"]), str(a["n_passed"]), str(a["n_skipped"]), str(a["n_errors"]),
                     str(a["n_unverified"]), pct(a["pass_rate"]), pct(a["R@1"]), num(a["S"]), pct(a["fast_1"]),
                     ratio(a["geomean_speedup"])])
    return Table("Attempts per arm (all attempts without infrastructure error)",
                 ["arm", "attempts", "passed", "skipped", "infra errors", "unverified", "pass rate", "R@1", "S",
                  "fast_1", "geomean speedup (passed)"], rows)


def problem_table(results: Mapping[str, Any]) -> Table:
    rows = []
    for r in results["problems"]:
        rows.append([f"p{r['problem_id']:02d}", r["family"], r["direction"], f"{r['n_resolved']} / {r['n_units']}",
                     num(r["base_S"]), num(r["skill_S"]), signed(r["lift_S"]),
                     f"{r['helped']} / {r['harmed']} / {r['neutral']}", signed(r["delta_gm"], unit="%")])
    return Table("Per problem and direction",
                 ["problem", "family", "direction", "resolved / units", "base S", "skill S", "lift S",
                  "helped / harmed / neutral", "ΔGM"], rows)


def unresolved_table(results: Mapping[str, Any]) -> Table:
    rows = [[u["model"], f"p{u['problem_id']:02d}", u["direction"], f"r{u['replicate']}", u["unresolved_reason"]]
            for u in results["units"] if not u["resolved"]]
    return Table("Unresolved units (left out of every paired metric)",
                 ["model", "problem", "direction", "replicate", "reason"], rows)


TIER_NOTE = {"gpu": "GPU tier: kernels ran, were checked and timed",
             "cpu": "CPU tier: reference at smoke size, static policy and compile-only checks; 'unverified' = "
                    "compiled but never run, so no pass and no speedup"}


def tier_status_table(records: Sequence[Mapping[str, Any]]) -> Table:
    """Per arm: the verification tier(s) its final records used and how many ended in each status."""
    statuses = [st for st in (*STATUS_ORDER, *sorted({str(r.get("status")) for r in records}))
                if any(str(r.get("status")) == st for r in records)]
    statuses = list(dict.fromkeys(statuses))
    rows = []
    for arm in ARMS:
        mine = [r for r in records if r.get("arm") == arm]
        tiers: dict[str, int] = {}
        for r in mine:
            t = str(r.get("tier") or "not recorded")
            tiers[t] = tiers.get(t, 0) + 1
        rows.append([arm, ", ".join(f"{t} {n}" for t, n in sorted(tiers.items())) or NA, str(len(mine)),
                     *(str(sum(1 for r in mine if str(r.get("status")) == st)) for st in statuses),
                     str(sum(1 for r in mine if r.get("error")))])
    used = sorted({str(r.get("tier") or "not recorded") for r in records})
    return Table("Verification tier and final status per arm", ["arm", "tier", "attempts", *statuses, "infra errors"],
                 rows, "; ".join(TIER_NOTE.get(t, f"{t}: tier not recorded") for t in used))


STATUS_ORDER = ("ok", "incorrect", "compile_error", "runtime_error", "timeout", "crashed", "policy_violation",
                "no_dsl_kernel", "unverified", "skipped")


def all_tables(results: Mapping[str, Any], records: Sequence[Mapping[str, Any]] = ()) -> list[Table]:
    """The report's tables, in reading order (``records``: the raw final attempt records, for tiers)."""
    tables = [headline_table(results), ladder_table(results), standing_table(results), verdict_table(results),
              family_table(results)]
    if len(results["by_model"]) > 1:
        tables.append(model_table(results))
    tables.append(arm_table(results))
    if records:
        tables.append(tier_status_table(records))
    tables.append(problem_table(results))
    if any(not u["resolved"] for u in results["units"]):
        tables.append(unresolved_table(results))
    return tables
