"""Record migrations: older on-disk shapes brought to the current one before strict parsing.

:func:`migrate` is the one engine every record kind uses (verification, attempt, run, invocation,
re-timing and baseline records): from a record's version, one step after another, to the current one.
This module also holds the verification record's steps.

Committed results (the curated set, sweeps, test logs) are never rewritten: a record is read as it was
written and migrated in memory by :func:`migrate_verification`, which applies :data:`MIGRATIONS` in
order, each to records of its ``from_version``. A migration states what it changes and why; it never drops data
silently: a field it removes is moved, or documented here as carrying nothing. A record that no
migration brings to shape fails strict parsing (``mkb_eval.records.parse_verification``), which names
the record and the field.

This module works on plain JSON objects and imports nothing of the package: a migration is a frozen
description of an old shape, not of the current dataclasses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MIGRATIONS", "Migration", "Step", "applied", "migrate", "migrate_verification"]

Step = Callable[[dict[str, Any]], dict[str, Any]]      # one version to the next, on a new dict


def migrate(d: Any, key: str, current: int, steps: Mapping[int, Step], what: str, where: str) -> Any:
    """``d`` brought to version ``current`` of its ``key`` (absent: 0) by the steps from its version
    on, one after another (a new dict; ``d`` is left alone). ValueError for a version with no step
    (a newer toolkit's record, or one no toolkit wrote); a non-object is returned as is for the model to refuse."""
    if not isinstance(d, dict):
        return d
    version = d.get(key, 0)
    while isinstance(version, bool) or version != current:          # True == 1 in Python, not a version
        step = steps.get(version) if isinstance(version, int) and not isinstance(version, bool) else None
        if step is None:
            raise ValueError(f"{where}: {what} has {key} {version!r}; this toolkit reads {current}"
                             + (f" (and migrates {', '.join(map(str, sorted(steps)))})" if steps else ""))
        d = step(dict(d))
        version = d.get(key, 0)
    return d


@dataclass(frozen=True)
class Migration:
    from_version: int
    name: str
    apply: Callable[[dict[str, Any]], None]        # in place, on a copy; a version's last one sets the next


# Fields added while schema_version was 1: a record written before a field existed lacks it. Each gets
# the value its dataclass default gives, which says "not measured" (None, no windows, 0 calls; no
# sandbox facts: the worker had none). Any other missing field is not an older shape: parsing refuses it.
_V1_LATER_FIELDS: dict[str, Any] = {"sandbox": {}}                    # commit aed83df (2026-11-29)
_V1_LATER_TIMING: dict[str, Any] = {
    "host_call_ms": None,                                             # d9b0f34 (2026-11-30)
    "cpu_probe_ms": None,                                             # b6a3a67
    "worker_event_ms": None, "attested_ms": None, "attested_windows_ms": [], "window_calls": 0,
    "eager_event_ms": None, "eager_attested_ms": None,                # acbc610 (attested windows)
    "prewindow_excess_ms": [],                                        # 5819657
    "window_span_ms": [], "window_commit_ms": [],                     # e121539
}
# What the GPU tests wrote beside a record's fields (tests/harness/test_gpu.py, ``keep``): which test,
# the known-bad kernel's file and the status it expected, the repetition.
_V1_TEST_LABELS = ("test", "kernel", "expected", "run")


def _v1_fill_later_fields(d: dict[str, Any]) -> None:
    """v1 → v1: the fields added during version 1, absent from the records written before them, set to
    their "not measured" values (the values the reader gave them before this module existed)."""
    for k, v in _V1_LATER_FIELDS.items():
        d.setdefault(k, copy.deepcopy(v))
    if isinstance(d.get("timing"), dict):
        for k, v in _V1_LATER_TIMING.items():
            d["timing"].setdefault(k, copy.deepcopy(v))


def _v1_kernels_to_artifacts(d: dict[str, Any]) -> None:
    """v1 → v2: ``kernels`` leaves the record. It held the CUPTI names of the kernels the timed calls
    launched until commit 01b0f6e replaced CUPTI by stream timing; every record since has ``[]``, which
    carries nothing and is removed. A non-empty list moves to ``artifacts.cupti_kernels``."""
    if "kernels" not in d:
        return
    names = d.pop("kernels")
    if names:
        if not isinstance(d.get("artifacts"), dict):
            d["kernels"] = names                   # left in place: parsing names the field it cannot place
            return
        d["artifacts"]["cupti_kernels"] = names


def _v1_test_labels(d: dict[str, Any]) -> None:
    """v1 → v2: the GPU tests' tags, written beside the record's own fields, move into ``labels`` (new in
    version 2: where any caller's tags go)."""
    tags = {k: d.pop(k) for k in _V1_TEST_LABELS if k in d}
    if tags:
        d["labels"] = {**tags, **d["labels"]} if isinstance(d.get("labels"), dict) else tags


def _v1_to_v2(d: dict[str, Any]) -> None:
    """v1 → v2: the version, and ``labels`` (new in version 2) empty where no tag moved into it."""
    d["schema_version"] = 2
    d.setdefault("labels", {})


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "v1_fill_later_fields", _v1_fill_later_fields),
    Migration(1, "v1_kernels_to_artifacts", _v1_kernels_to_artifacts),
    Migration(1, "v1_test_labels", _v1_test_labels),
    Migration(1, "v1_to_v2", _v1_to_v2),                # the last of version 1: sets version 2
)


def applied(d: dict[str, Any], current: int, where: str = "record") -> tuple[dict[str, Any], list[str]]:
    """The verification record in the ``current`` shape (``d`` itself when it is current, else a migrated
    copy: ``d`` is never changed) and the names of the migrations that changed it; :func:`migrate`'s
    ValueError naming ``where`` for a version the migrations do not lead from."""
    names: list[str] = []

    def step_from(version: int) -> Step:
        def step(rec: dict[str, Any]) -> dict[str, Any]:
            out = copy.deepcopy(rec)                  # the named migrations change nested parts in place
            for m in MIGRATIONS:
                if m.from_version == version:
                    before = copy.deepcopy(out)
                    m.apply(out)
                    if out != before:
                        names.append(m.name)
            return out
        return step

    steps = {v: step_from(v) for v in sorted({m.from_version for m in MIGRATIONS})}
    return migrate(d, "schema_version", current, steps, "verification record", where), names


def migrate_verification(d: dict[str, Any], current: int, where: str = "record") -> dict[str, Any]:
    """:func:`applied`'s record alone."""
    return applied(d, current, where)[0]
