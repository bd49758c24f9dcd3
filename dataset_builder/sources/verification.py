"""Rows of ``solutions`` and ``baselines``: shipped kernels joined with GPU verification records.

Records come from ``<results>/<gpu>/verify.jsonl`` (append-only; a later line supersedes an
earlier one). Only GPU-tier verification records count. A record is joined to a solution only
when it verified that exact kernel (``kernel_sha256``) on that exact problem version
(``problem_hash``): anything else would claim a measurement the shipped file never had.
"""

from __future__ import annotations

import json
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from dataset_builder.sources.problems import layout_path
from dataset_builder.versioning import source_sha256
from mkb_eval.problems import DSLS, Problem
from mkb_eval.records import read_jsonl

RECORDS_FILE = "verify.jsonl"
_REQUIRED = ("problem_id", "dsl", "problem_hash", "kernel_sha256", "status", "tier")


@dataclass(frozen=True)
class GpuRecords:
    """The verification records of one results folder, in file order."""

    gpu: str
    path: Path
    records: tuple[dict[str, Any], ...]


def read_results(results_root: Path) -> list[GpuRecords]:
    """Every ``<results_root>/<gpu>/verify.jsonl``, sorted by GPU folder name.

    A torn or non-object line fails the build (the builder never drops a line silently); a
    record of another kind or tier is left out.
    """
    if not results_root.is_dir():
        raise BuildError(f"{results_root}: results folder not found")
    out = []
    for path in sorted(results_root.glob(f"*/{RECORDS_FILE}")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recs = list(read_jsonl(path))
        if caught:
            raise BuildError(f"{path}: {caught[0].message}; fix or remove the line before building")
        keep = []
        for n, r in enumerate(recs, 1):
            if r.get("kind") != "verification" or r.get("tier") != "gpu":
                continue
            missing = [k for k in _REQUIRED if k not in r]
            if missing:
                raise BuildError(f"{path}: record {n} lacks {', '.join(missing)}")
            keep.append(r)
        out.append(GpuRecords(gpu=path.parent.name, path=path, records=tuple(keep)))
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


def baseline_rows(problems: Sequence[Problem], results: Sequence[GpuRecords]) -> list[dict[str, Any]]:
    """One row per (problem, GPU) with eager times: medians over the latest record per DSL."""
    rows = []
    for p in sorted(problems, key=lambda p: p.id):
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
            rows.append({
                "problem_id": p.id, "problem": p.name, "problem_hash": p.hash, "gpu": g.gpu,
                "gpu_name": (used[0].get("env") or {}).get("gpu"), "size": sizes[0],
                "eager_ms": _median(eager), "compile_ms": _median(comp),
                "eager_ms_samples": eager, "compile_ms_samples": comp, "n_records": len(used),
                "torch_versions": sorted({str((r.get("env") or {}).get("torch")) for r in used}),
            })
    return rows
