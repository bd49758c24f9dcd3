"""Rows of ``solutions`` and ``baselines``: shipped kernels joined with the curated GPU verification sets.

Records come from ``<results>/<gpu>/verification.jsonl``, the curated set of each GPU model
(``mkb_eval.verification_set``: one full sweep, chosen by ``scripts/curate_verification.py``).
Only GPU-tier verification records count. A record is joined to a solution only when it
verified that exact kernel (``kernel_sha256``) on that exact problem version (``problem_hash``):
anything else would claim a measurement the shipped file never had.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from dataset_builder.sources.problems import layout_path
from dataset_builder.versioning import source_sha256
from mkb_eval import verification_set as V
from mkb_eval.problems import DSLS, Problem

RECORDS_FILE = V.VERIFICATION_FILE


@dataclass(frozen=True)
class GpuRecords:
    """The curated verification records of one GPU model, in file order, and where they came from."""

    gpu: str
    path: Path
    records: tuple[dict[str, Any], ...]
    source: dict[str, Any] = field(default_factory=dict)


def read_results(results_root: Path) -> list[GpuRecords]:
    """Every ``<results_root>/<gpu>/verification.jsonl``, sorted by GPU folder name.

    A torn or non-object line fails the build (the builder never drops a line silently); a
    record of another kind or tier is left out.
    """
    if not results_root.is_dir():
        raise BuildError(f"{results_root}: results folder not found")
    out = []
    for path in sorted(results_root.glob(f"*/{RECORDS_FILE}")):
        try:
            recs = V.read_set(path)
            source = V.read_source(path)
        except ValueError as e:
            raise BuildError(f"{e}; fix the set (scripts/curate_verification.py) before building") from None
        out.append(GpuRecords(gpu=path.parent.name, path=path, records=tuple(V.gpu_records(recs)), source=source))
    return out


def _latest(records: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    last = None
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            last = r
    return last


def _timing(rec: dict[str, Any] | None) -> dict[str, Any]:
    t = (rec or {}).get("timing") or {}
    keys = ("kernel_ms", "kernel_device_ms", "kernel_cv", "eager_ms", "compile_ms", "speedup",
            "speedup_vs_compile", "sol_ms", "sol_fraction")
    return {k: t.get(k) for k in keys}


def solution_rows(problems: Sequence[Problem], results: Sequence[GpuRecords]) -> list[dict[str, Any]]:
    """One row per (problem, DSL, GPU with a matching record); one null row for an unmeasured solution."""
    rows = []
    for p in sorted(problems, key=lambda p: p.id):
        for dsl in DSLS:
            path = p.solution_path(dsl)
            if not path.is_file():
                continue
            data = path.read_bytes()          # read once: the source and its hash always agree
            sha = source_sha256(data)
            base = {
                "problem_id": p.id, "problem": p.name, "dsl": dsl,
                "kernel_path": layout_path(p, "solutions", f"{dsl}.py"),
                "kernel_source": data.decode("utf-8"),
                "kernel_sha256": sha, "problem_hash": p.hash,
            }
            joined = 0
            others = 0
            for g in results:
                rec = _latest(g.records, problem_id=p.id, dsl=dsl, problem_hash=p.hash, kernel_sha256=sha)
                others += sum(1 for r in g.records if r["problem_id"] == p.id and r["dsl"] == dsl
                              and (r["problem_hash"], r["kernel_sha256"]) != (p.hash, sha))
                if rec is None:
                    continue
                joined += 1
                env = rec.get("env") or {}
                rows.append({
                    **base, "gpu": g.gpu, "gpu_name": env.get("gpu"),
                    "verified": rec["status"] == "ok", "status": rec["status"],
                    "message": rec.get("message"), "tier": rec["tier"], "size": rec.get("size"),
                    **_timing(rec),
                    "n_timed": (rec.get("timing") or {}).get("n_timed"),
                    "draws_passed": (rec.get("correctness") or {}).get("draws_passed"),
                    "created_at": rec.get("created_at"),
                    "env_json": json.dumps(env, sort_keys=True),
                    "record_json": json.dumps(rec, sort_keys=True),
                    "note": None,
                })
            if not joined:
                note = "no GPU verification record for this kernel and problem version"
                if others:
                    note += f" ({others} record(s) of other kernel or problem versions not used)"
                rows.append({
                    **base, "gpu": None, "gpu_name": None, "verified": False, "status": None, "message": None,
                    "tier": None, "size": None, **_timing(None), "n_timed": None, "draws_passed": None,
                    "created_at": None, "env_json": None, "record_json": None, "note": note,
                })
    return rows


def _median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _compile_note(used: Sequence[dict[str, Any]]) -> str | None:
    flags = sorted({f for r in used for f in (r.get("flags") or []) if f.startswith("compile_baseline")})
    if any((r.get("timing") or {}).get("compile_ms") is not None for r in used):
        return None
    return ("torch.compile failed on this GPU (" + ", ".join(flags) + ")") if flags else "no torch.compile time recorded"


def baseline_rows(problems: Sequence[Problem], results: Sequence[GpuRecords]) -> list[dict[str, Any]]:
    """One row per (problem, GPU): eager and torch.compile medians over the latest record per DSL, the
    SOL time, and the shipped solutions' end-to-end and device times when their record matches."""
    rows = []
    for p in sorted(problems, key=lambda p: p.id):
        shipped = V.shipped_hashes([p])
        for g in results:
            used = [r for dsl in DSLS
                    if (r := _latest(g.records, problem_id=p.id, dsl=dsl, problem_hash=p.hash)) is not None
                    and (r.get("timing") or {}).get("eager_ms") is not None]
            if not used:
                continue
            eager = [float(r["timing"]["eager_ms"]) for r in used]
            comp = [float(r["timing"]["compile_ms"]) for r in used if r["timing"].get("compile_ms") is not None]
            sizes = sorted({str(r.get("size")) for r in used})
            if len(sizes) != 1:
                raise BuildError(f"{g.path}: problem {p.id} baselines measured at different sizes {sizes}")
            kernel: dict[str, Any] = {}
            for dsl in DSLS:
                rec = next((r for r in used if r["dsl"] == dsl), None)
                ok = (rec is not None and rec.get("status") == "ok"
                      and shipped.get((p.id, dsl)) == (rec["problem_hash"], rec["kernel_sha256"]))
                t = (rec or {}).get("timing") or {}
                kernel[f"{dsl}_kernel_ms"] = t.get("kernel_ms") if ok else None
                kernel[f"{dsl}_device_ms"] = t.get("kernel_device_ms") if ok else None
            rows.append({
                "problem_id": p.id, "problem": p.name, "problem_hash": p.hash, "gpu": g.gpu,
                "gpu_name": (used[0].get("env") or {}).get("gpu"), "size": sizes[0],
                "eager_ms": _median(eager), "compile_ms": _median(comp), "compile_note": _compile_note(used),
                "sol_ms": float(p.sol.sol_ms), "sol_bound": str(p.sol.bound), **kernel,
                "eager_ms_samples": eager, "compile_ms_samples": comp, "n_records": len(used),
                "torch_versions": sorted({str((r.get("env") or {}).get("torch")) for r in used}),
                "records_file": f"results/{g.gpu}/{RECORDS_FILE}",
            })
    return rows
