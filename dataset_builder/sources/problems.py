"""Rows of the ``problems`` config, read from the problem folders."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dataset_builder.versioning import problem_entries
from mkb_eval.problems import Problem


def layout_path(problem: Problem, *parts: str) -> str:
    """Path of a file of a problem in the toolkit repo's layout (``problems/<family>/<NN>_<slug>/...``).

    Derived from the problem, not from where its folder sits on this machine, so the data holds
    no machine paths and a build from another problems root names files the same way.
    """
    return "/".join(("problems", problem.family, problem.name, *parts))


def problem_rows(problems: Sequence[Problem],
                 entries: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per problem, ordered by id; sources are stored byte for byte.

    ``entries`` are the manifest's fingerprint entries of this build (read once, so the rows and
    the manifest agree even if a solution file changes while the build runs).
    """
    entries = entries if entries is not None else problem_entries(problems)
    rows = []
    for p in sorted(problems, key=lambda p: p.id):
        entry = entries[f"{p.id:02d}"]
        rows.append({
            "problem_id": p.id,
            "problem": p.name,
            "slug": p.slug,
            "family": p.family,
            "dtype": p.dtype,
            "description": p.description,
            "docstring": p.docstring,
            "reference_path": layout_path(p, "reference.py"),
            "reference_source": p.reference_path.read_bytes().decode("utf-8"),
            "problem_yaml": (p.path / "problem.yaml").read_bytes().decode("utf-8"),
            "sizes_json": json.dumps(p.sizes, sort_keys=True),
            "tolerance_factor": p.tolerance_factor,
            "mutates": list(p.mutates),
            "provenance_source": str(p.provenance["source"]),
            "provenance_notes": str(p.provenance["notes"]),
            "license": p.license,
            "sol_flops": p.sol.flops,
            "sol_bytes": p.sol.bytes,
            "sol_rate": p.sol.rate,
            "sol_bound": p.sol.bound,
            "sol_ms": p.sol.sol_ms,
            "solution_dsls": [d for d, sha in entry["solutions"].items() if sha is not None],
            "problem_hash": p.hash,
            "fingerprint": entry["fingerprint"],
        })
    return rows
