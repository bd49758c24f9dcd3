"""Rows of ``reference_outputs`` and the check that a CPU run reproduces their hashes.

The references run in a child process (``reference_worker``); this module starts it, reads
what it wrote, and turns it into rows. ``reproduce`` runs the references again and compares
every hash with the stored rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from mkb_eval.problems import Problem

PUBLIC_SEEDS = (0, 1, 2)
_PKG_ROOT = Path(__file__).resolve().parents[2]


def _run_worker(ids: Sequence[int], seeds: Sequence[int], problems_root: Path | None, work: Path,
                timeout_s: float) -> dict[str, Any]:
    import json

    cmd = [sys.executable, "-m", "dataset_builder.sources.reference_worker", "--out", str(work),
           "--seeds", ",".join(str(s) for s in seeds), "--ids", ",".join(str(i) for i in ids)]
    if problems_root is not None:
        cmd += ["--problems-root", str(problems_root)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PKG_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise BuildError(f"reference run on CPU took longer than {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BuildError(f"reference run on CPU exited with {proc.returncode}: {tail[0]}")
    index: dict[str, Any] = json.loads((work / "index.json").read_text())
    return index


def reference_rows(problems: Sequence[Problem], seeds: Sequence[int] = PUBLIC_SEEDS,
                   problems_root: Path | None = None, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """One row per (problem, seed), ordered by id then seed, with every output tensor's bytes."""
    if not seeds:
        raise BuildError("reference_outputs needs at least one public seed")
    by_id = {p.id: p for p in problems}
    with tempfile.TemporaryDirectory(prefix="mkb-refs-") as tmp:
        work = Path(tmp)
        index = _run_worker(sorted(by_id), list(seeds), problems_root, work, timeout_s)
        rows = []
        for res in sorted(index["results"], key=lambda r: (r["problem_id"], r["seed"])):
            p = by_id[res["problem_id"]]
            ok = "error" not in res
            outputs = []
            for e in res.get("outputs", []):
                outputs.append({"path": e["path"], "dtype": e["dtype"], "shape": e["shape"],
                                "sha256": e["sha256"], "data": (work / e["file"]).read_bytes()})
            rows.append({
                "problem_id": p.id, "problem": p.name, "problem_hash": p.hash, "seed": res["seed"],
                "size": "smoke", "ok": ok, "error": res.get("error"), "structure": res.get("structure"),
                "outputs": outputs, "sha256": res.get("sha256"), "torch_version": index["torch_version"],
                "cpu_capability": index["cpu_capability"], "num_threads": index["num_threads"],
            })
    return rows


@dataclass(frozen=True)
class Mismatch:
    """A stored reference output that a fresh CPU run did not reproduce."""

    problem_id: int
    seed: int
    reason: str

    def __str__(self) -> str:
        return f"problem {self.problem_id:02d} seed {self.seed}: {self.reason}"


def reproduce(stored: Iterable[Mapping[str, Any]], problems: Sequence[Problem],
              problems_root: Path | None = None) -> list[Mismatch]:
    """Re-run the references for the stored (problem, seed) pairs; list every hash that differs."""
    stored = list(stored)
    by_id = {p.id: p for p in problems}
    wanted = sorted({int(r["problem_id"]) for r in stored})
    unknown = [i for i in wanted if i not in by_id]
    if unknown:
        raise BuildError(f"reference_outputs holds problems {unknown} that are not in the problem set")
    seeds = sorted({int(r["seed"]) for r in stored})
    fresh = {(r["problem_id"], r["seed"]): r for r in reference_rows([by_id[i] for i in wanted], seeds, problems_root)}
    out = []
    for r in stored:
        key = (int(r["problem_id"]), int(r["seed"]))
        f = fresh[key]
        if r["problem_hash"] != by_id[key[0]].hash:
            out.append(Mismatch(*key, "the problem changed since these outputs were stored"))
        elif r["ok"] != f["ok"]:
            out.append(Mismatch(*key, f"stored ok={r['ok']} but the fresh run gave ok={f['ok']} ({f['error']})"))
        elif r["sha256"] != f["sha256"]:
            paths = [a["path"] for a, b in zip(r["outputs"], f["outputs"], strict=False) if a["sha256"] != b["sha256"]]
            out.append(Mismatch(*key, f"sha256 differs (tensors {paths or 'structure'}; stored with torch "
                                      f"{r['torch_version']} {r['cpu_capability']}, fresh with "
                                      f"{f['torch_version']} {f['cpu_capability']})"))
    return out
