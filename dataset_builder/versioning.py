"""Versions, per-problem fingerprints, and the changelog generated from fingerprint changes.

A build writes ``manifest.json`` beside the parquet files: the semver ``dataset_version``, each
problem's fingerprint (its problem hash plus the sha256 of each shipped solution), the file
hashes, and the accumulated changelog. The next build reads the previous manifest
(``--previous``), diffs the fingerprints, and prepends an entry. Because results across
problem versions are not comparable, the diff also fixes the smallest allowed version bump:
a changed or removed problem needs a major bump, an added problem a minor one, anything else
a patch; rebuilding the same version is allowed only when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dataset_builder.errors import BuildError
from mkb_eval.problems import DSLS, Problem

_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
BUMPS = ("none", "patch", "minor", "major")


@dataclass(frozen=True, order=True)
class Version:
    """A MAJOR.MINOR.PATCH version (no pre-release or build suffixes)."""

    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def tag(self) -> str:
        """The git tag of this release on the Hub: ``vX.Y.Z``."""
        return f"v{self}"


def parse_version(text: str) -> Version:
    """Parse ``X.Y.Z``; raise BuildError naming the bad string."""
    m = _SEMVER.match(str(text).strip())
    if not m:
        raise BuildError(f"dataset version {text!r} is not semver MAJOR.MINOR.PATCH (e.g. 1.0.0)")
    return Version(*(int(g) for g in m.groups()))


def bump_of(old: Version, new: Version) -> str:
    """Which part moved from ``old`` to ``new``: none, patch, minor or major (raises if it went back)."""
    if new < old:
        raise BuildError(f"dataset version {new} is lower than the previous build's {old}")
    if new.major != old.major:
        return "major"
    if new.minor != old.minor:
        return "minor"
    if new.patch != old.patch:
        return "patch"
    return "none"


def source_sha256(data: bytes) -> str:
    """sha256 of a kernel file's bytes as the verifier hashes them: text read with universal newlines."""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return hashlib.sha256(text.encode()).hexdigest()


def solution_sha256(problem: Problem, dsl: str) -> str | None:
    """sha256 of a shipped solution (``source_sha256``), None if there is none."""
    path = problem.solution_path(dsl)
    if not path.is_file():
        return None
    return source_sha256(path.read_bytes())


def fingerprint_parts(problem: Problem) -> dict[str, Any]:
    """The inputs of a problem's fingerprint: its hash and each DSL's solution hash."""
    return {"problem_hash": problem.hash, "solutions": {d: solution_sha256(problem, d) for d in DSLS}}


def fingerprint(parts: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``fingerprint_parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def problem_entries(problems: Iterable[Problem]) -> dict[str, dict[str, Any]]:
    """Manifest entries keyed by two-digit id: name, hash, solution hashes, fingerprint."""
    out = {}
    for p in sorted(problems, key=lambda p: p.id):
        parts = fingerprint_parts(p)
        out[f"{p.id:02d}"] = {"name": p.name, **parts, "fingerprint": fingerprint(parts)}
    return out


@dataclass(frozen=True)
class Diff:
    """Problems added, removed and changed (with what changed) between two manifests."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def required_bump(self) -> str:
        if self.removed or any("definition" in what for _, what in self.changed):
            return "major"
        if self.added:
            return "minor"
        if self.changed:
            return "patch"
        return "none"


def diff_problems(old: Mapping[str, Any], new: Mapping[str, Any]) -> Diff:
    """Compare the ``problems`` sections of two manifests."""
    added = tuple(sorted(k for k in new if k not in old))
    removed = tuple(sorted(k for k in old if k not in new))
    changed = []
    for k in sorted(set(old) & set(new)):
        if old[k].get("fingerprint") == new[k]["fingerprint"]:
            continue
        what = []
        if old[k].get("problem_hash") != new[k]["problem_hash"]:
            what.append("definition")
        for d in DSLS:
            a, b = (old[k].get("solutions") or {}).get(d), new[k]["solutions"].get(d)
            if a != b:
                what.append(f"{d} solution {'added' if a is None else 'removed' if b is None else 'changed'}")
        changed.append((k, tuple(what or ["fingerprint"])))
    return Diff(added, removed, tuple(changed))


def changelog_entry(version: Version, previous: Mapping[str, Any] | None, problems: Mapping[str, Any],
                    rows: Mapping[str, int], extra: Iterable[str] = ()) -> dict[str, Any]:
    """The changelog entry of this build, generated from the fingerprint diff and the row counts.

    Raises BuildError when the version does not move as far as the changes require.
    """
    if previous is None:
        return {"version": str(version), "previous": None,
                "changes": [f"initial release: {len(problems)} problems", *extra]}
    old_version = parse_version(str(previous.get("dataset_version")))
    d = diff_problems(previous.get("problems", {}), problems)
    old_rows = {name: c.get("rows") for name, c in previous.get("configs", {}).items()}
    row_changes = [f"{name}: {old_rows.get(name, 0)} -> {n} rows" for name, n in rows.items()
                   if old_rows.get(name) != n]
    bump = bump_of(old_version, version)
    needed = d.required_bump
    if bump == "none":
        if needed != "none" or row_changes:
            raise BuildError(f"version {version} was already built with different content; bump the version "
                             f"(at least a {needed if needed != 'none' else 'patch'} release)")
    elif BUMPS.index(bump) < BUMPS.index(needed):
        raise BuildError(f"these changes need at least a {needed} version bump from {old_version}, "
                         f"but {version} is a {bump} bump ({_summary(d)})")
    changes = [f"problem {k} ({problems[k]['name']}) added" for k in d.added]
    changes += [f"problem {k} ({previous['problems'][k]['name']}) removed" for k in d.removed]
    changes += [f"problem {k} ({problems[k]['name']}): {', '.join(what)}" for k, what in d.changed]
    changes += row_changes + list(extra)
    return {"version": str(version), "previous": str(old_version), "changes": changes or ["no changes"]}


def _summary(d: Diff) -> str:
    parts = []
    if d.added:
        parts.append(f"{len(d.added)} added")
    if d.removed:
        parts.append(f"{len(d.removed)} removed")
    if d.changed:
        parts.append(f"{len(d.changed)} changed")
    return ", ".join(parts) or "no problem changes"


def changelog(entry: Mapping[str, Any], previous: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """This build's entry followed by the previous build's entries (a rebuild replaces its own)."""
    older = [e for e in (previous or {}).get("changelog", []) if e.get("version") != entry["version"]]
    return [dict(entry), *older]
