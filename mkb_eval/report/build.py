"""``mkb report <run dir>``: score a run and write markdown, a self-contained HTML page and JSON.

The HTML embeds its plots as base64 PNGs and its CSS inline, so the single file can be mailed or
attached to an issue. The markdown links the same PNGs from ``plots/`` next to it.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from mkb_eval.metrics.definitions import LEGEND
from mkb_eval.metrics.inputs import read_attempts
from mkb_eval.metrics.paired import FLOOR, NEUTRAL_BAND, NOISE_MARGIN
from mkb_eval.metrics.stats import N_RESAMPLES, SEED
from mkb_eval.metrics.summary import score
from mkb_eval.report import plots
from mkb_eval.report.tables import Table, all_tables

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;max-width:1500px;color:#222;
padding:0 1rem;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
h3{margin:1.6rem 0 .4rem;font-size:1.05rem}
table{border-collapse:collapse;font-size:.82rem;margin:.3rem 0;display:block;overflow-x:auto}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:left;white-space:nowrap}
th{background:#f4f6f8}.num{text-align:right;font-variant-numeric:tabular-nums}
tbody tr:nth-child(even){background:#fafafa}td.na{color:#999}
.note{font-size:.8rem;color:#555;margin:.2rem 0 1rem}.meta{color:#555;font-size:.9rem}
img{max-width:100%;border:1px solid #eee;margin:.5rem 0}
.warn{background:#fff8e1;border:1px solid #ffe082;padding:.5rem 1rem;font-size:.85rem}
dl{font-size:.85rem}dt{font-weight:600;margin-top:.4rem}dd{margin-left:1.2rem}
"""

_PLOTS = (
    ("lift_by_problem", "Paired lift by problem and direction"),
    ("standing", "Help and harm by relative standing"),
    ("ladders", "R@t ladders per arm"),
)


def _plots(results: dict[str, Any]) -> dict[str, bytes]:
    groups = {"overall": results["overall"]["standing"]}
    groups.update({d: g["standing"] for d, g in results["by_direction"].items()})
    return {
        "lift_by_problem": plots.lift_by_problem(results["problems"], results["overall"]["n_resolved"],
                                                 results["overall"]["n_units"]),
        "standing": plots.standing(groups),
        "ladders": plots.ladders(results),
    }


def noise_floor_line(nf: dict[str, Any] | None) -> str:
    """The A/A noise floor by the verdict's timer, and whether the A/A and A/B tests passed on this GPU."""
    if not nf or nf.get("ratio_p95_abs_dev") is None:
        return "A/A noise floor on this GPU: not measured (run scripts/aa_ab.py)"
    pct = {k: "n/a" if nf.get(k) is None else f"{100 * nf[k]:.1f}%" for k in ("false_help", "false_harm")}
    text = (f"A/A noise floor on this GPU by this timer: 95% of identical pairs within "
            f"±{100 * nf['ratio_p95_abs_dev']:.2f}% over {nf['units']} of {nf.get('units_total')} units, false help "
            f"{pct['false_help']}, false harm {pct['false_harm']} ({nf['source']})")
    if nf.get("passed"):
        return text + "; the A/A and A/B tests pass"
    return (text + "; the A/A and A/B tests do not pass (" + "; ".join(nf.get("failures") or ["unknown"])
            + "), so this GPU's helped and harmed counts are not backed by them")


def verdict_line(results: dict[str, Any]) -> str:
    """What decided helped / harmed: the paired verdict (band, rounds, timer, A/A floor) or the original."""
    p = results["params"]
    if p.get("verdict") != "paired":
        return (f"Verdict: original (the benchmark's definition: tiers, then submission-time kernel times with a "
                f"{p['margin']:g} margin; no paired re-timing in this run).")
    timer = {"kernel_ms": "end-to-end time (kernel_ms, the benchmark's time; device time shown beside it)",
             "attested_ms": "parent-attested time (attested_ms, the calls back to back under the parent's clock)",
             "device_ms": "device time (device_ms, the GPU's work without the host call path)"}[p["timer"]]
    floor = noise_floor_line(p.get("noise_floor"))
    rounds = ", ".join(str(r) for r in p.get("rounds") or []) or "none"
    return (f"Verdict: paired (helped / harmed only when the 95% t interval of the re-timed speedup ratio lies "
            f"outside the neutral band ±{100 * p['band']:g}%; {rounds} interleaved rounds; {timer}). {floor}.")


def final_records(run_dir: Path) -> list[dict[str, Any]]:
    """The latest raw record per (model, trial) of ``attempts.jsonl`` (torn lines skipped: the metrics warn)."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    path = run_dir / "attempts.jsonl"
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("trial"):
            latest[(str(rec.get("model")), str(rec["trial"]))] = rec
    return list(latest.values())


def tier_line(records: list[dict[str, Any]]) -> str:
    tiers: dict[str, int] = {}
    for r in records:
        t = str(r.get("tier") or "not recorded")
        tiers[t] = tiers.get(t, 0) + 1
    text = ", ".join(f"{t} ({n} attempts)" for t, n in sorted(tiers.items())) or "none"
    if "cpu" in tiers:
        text += "; on the CPU tier no kernel runs: 'unverified' is neither a pass nor a speedup"
    return f"Verification tier: {text}."


def _summary_lines(run_dir: Path, results: dict[str, Any], records: list[dict[str, Any]] | None = None) -> list[str]:
    o = results["overall"]
    p = results["params"]
    return [
        tier_line(records or []),
        verdict_line(results),
        f"Run: `{run_dir.name}`; models: {', '.join(results['models']) or 'none'}; "
        f"{results['n_records']} attempt records ({results['n_superseded']} superseded).",
        f"Units: {o['n_resolved']} resolved of {o['n_units']} ({o['n_unresolved_missing']} missing an attempt, "
        f"{o['n_unresolved_error']} with an infrastructure error"
        + (f", {o['n_unresolved_unverified']} unverified (no GPU), {o['n_unresolved_not_retimed']} passed pairs "
           "without a re-timing" if "n_unresolved_unverified" in o else "")
        + f") over {o['n_problems']} problems.",
        f"Parameters: noise margin {p['margin']:g}, failure floor {p['floor']:g}, "
        f"{p['n_resamples']} bootstrap resamples of problems (seed {p['seed']}), {p['confidence']:.0%} intervals.",
    ]


def render_markdown(run_dir: Path, results: dict[str, Any], tables: list[Table], plot_files: dict[str, str],
                    records: list[dict[str, Any]] | None = None) -> str:
    """The markdown report; plots are linked by relative path."""
    out = [f"# MetaKernelBench report: {run_dir.name}", ""]
    out += [f"- {line}" for line in _summary_lines(run_dir, results, records)]
    if results["warnings"]:
        out += ["", "## Input warnings", ""] + [f"- {w}" for w in results["warnings"]]
    out += ["", "## Plots", ""]
    out += [f"![{title}]({plot_files[key]})\n" for key, title in _PLOTS]
    out += ["## Tables", ""] + [t.markdown() for t in tables]
    out += ["## Definitions", ""] + [f"- **{k}**: {v}" for k, v in LEGEND.items()]
    return "\n".join(out) + "\n"


def render_html(run_dir: Path, results: dict[str, Any], tables: list[Table], pngs: dict[str, bytes],
                records: list[dict[str, Any]] | None = None) -> str:
    """One self-contained HTML page: inline CSS, plots as data URIs, no scripts, no external links."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>MetaKernelBench report: {e(run_dir.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>MetaKernelBench report: {e(run_dir.name)}</h1>",
    ]
    parts += [f'<p class="meta">{e(line).replace("`", "")}</p>' for line in _summary_lines(run_dir, results, records)]
    if results["warnings"]:
        items = "".join(f"<li>{e(w)}</li>" for w in results["warnings"])
        parts.append(f'<div class="warn"><strong>Input warnings</strong><ul>{items}</ul></div>')
    parts.append("<h2>Plots</h2>")
    for key, title in _PLOTS:
        data = base64.b64encode(pngs[key]).decode("ascii")
        parts.append(f'<h3>{e(title)}</h3><img alt="{e(title)}" src="data:image/png;base64,{data}">')
    parts.append("<h2>Tables</h2>")
    parts += [t.html() for t in tables]
    parts.append("<h2>Definitions</h2><dl>")
    parts += [f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in LEGEND.items()]
    parts.append("</dl></body></html>")
    return "\n".join(parts) + "\n"


def build_report(
    run_dir: Path,
    out_dir: Path | None = None,
    *,
    margin: float = NOISE_MARGIN,
    floor: float = FLOOR,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
    verdict: str | None = None,
    band: float = NEUTRAL_BAND,
    timer: str = "kernel_ms",
) -> dict[str, Path]:
    """Score ``run_dir/attempts.jsonl`` and write report.md, report.html, results.json and plots/.

    ``out_dir`` defaults to ``run_dir/report``. Returns the written paths by kind ("markdown",
    "html", "json", and "plot_<name>" for each PNG). A record of a newer schema raises
    SchemaVersionError; a missing attempts file raises FileNotFoundError. With a ``retime.jsonl`` in the
    run folder the verdict is the paired one (unless ``verdict="original"``), else the original.
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    from mkb_eval.metrics.retimed import noise_floor, run_gpu, run_timings

    timings = run_timings(run_dir, timer) if verdict != "original" else None
    results = score(read_attempts(run_dir), margin=margin, floor=floor, n_resamples=n_resamples, seed=seed,
                    verdict=verdict, timings=timings, band=band, timer=timer,
                    noise_floor=noise_floor(run_gpu(run_dir), timer=timer))
    records = final_records(run_dir)
    tables = all_tables(results, records)
    pngs = _plots(results)

    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    plot_files: dict[str, str] = {}
    for key, data in pngs.items():
        path = out_dir / "plots" / f"{key}.png"
        path.write_bytes(data)
        paths[f"plot_{key}"] = path
        plot_files[key] = f"plots/{key}.png"
    paths["json"] = out_dir / "results.json"
    paths["json"].write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths["markdown"] = out_dir / "report.md"
    paths["markdown"].write_text(render_markdown(run_dir, results, tables, plot_files, records), encoding="utf-8")
    paths["html"] = out_dir / "report.html"
    paths["html"].write_text(render_html(run_dir, results, tables, pngs, records), encoding="utf-8")
    return paths
