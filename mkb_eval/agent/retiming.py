"""Paired re-timing of a run's final kernels: interleaved rounds, stored append-only, resumable.

Submission-time times are taken minutes apart, beside other work, and differed by up to 33% for
the same kernel on the H200; a paired comparison needs its two sides timed together. So when all
selected trials of a (problem, replicate) are finished, their final kernels (both solos and both
skill arms: every unit's source, base and skill) are re-timed together by
``mkb_eval.harness.retime.retime``: interleaved rounds on one GPU, one timing window per kernel per
round, the order alternated round by round. One re-timing serves both directions' units, so each
kernel has one re-timed time however many units it is part of.
On a GPU the re-timings start when the run's verifications are done, and their timed rounds take
the host quiet one group at a time (:mod:`mkb_eval.harness.quiet`).

Each result is one line of ``<run>/retime.jsonl`` (a :class:`mkb_eval.run_record.RetimeRecord`) keyed
by the group and its kernels' hashes; a group already there (same kernels, rounds and tier) is not
re-timed again, so a run killed in the middle of re-timing resumes with the groups that were not
finished. A group whose re-timing fails (an exception of the harness) gets no line and is tried again
by the next run. Only kernels that passed (``ok``) or could not be judged on this tier
(``unverified``) are re-timed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval import run_record as R
from mkb_eval.harness.quiet import QuietHost
from mkb_eval.records import append_jsonl

RETIME_FILE = "retime.jsonl"
RETIME_VERSION = R.RETIME_VERSION
RETIMABLE = ("ok", "unverified")
DEFAULT_ROUNDS = 5
GROUPS_PER_GPU = 4          # re-timings in flight per GPU: their start and checks overlap, their timed rounds take turns
CORES_PER_GROUP = 4         # a group starts and compiles up to four workers at once


@dataclass(frozen=True)
class RetimeKernel:
    """One final kernel of a group: its arm (the label in the re-timing), trial, DSL, file and hash."""

    label: str
    trial: str
    dsl: str
    path: Path
    sha256: str


@dataclass(frozen=True)
class RetimeGroup:
    """The final kernels of one (problem, replicate) that are re-timed together."""

    problem_id: int
    replicate: int
    kernels: tuple[RetimeKernel, ...]

    @property
    def id(self) -> str:
        return f"p{self.problem_id:02d}_r{self.replicate}"

    def key(self, rounds: int, tier: str) -> str:
        parts = [self.id, f"rounds={rounds}", f"tier={tier}"] + [f"{k.label}:{k.sha256}" for k in self.kernels]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class RetimeSettings:
    """How the run re-times (recorded with every result)."""

    rounds: int = DEFAULT_ROUNDS
    warmup: int = 5
    draws: int = 20

    def __post_init__(self) -> None:
        if self.rounds < 2:
            raise ValueError(f"re-timing needs at least 2 rounds for an interval, got {self.rounds}")
        if self.warmup < 0 or self.draws < 1:
            raise ValueError("re-timing needs warmup >= 0 and draws >= 1")


def _sha_file(path: Path) -> str:
    return hashlib.sha256(path.read_text(errors="replace").encode()).hexdigest()


def group_from_records(run_dir: Path, problem_id: int, replicate: int,
                       records: Iterable[Mapping[str, Any]]) -> tuple[RetimeGroup | None, list[str]]:
    """The group of these trial records (its retimable final kernels) and notes on what was left out.

    A group needs a unit's base and skill kernels (same DSL) to be worth re-timing; otherwise None.
    """
    from mkb_eval.vocab import ARM_DSL, DIRECTIONS
    from mkb_eval.metrics.units import direction_arms

    notes: list[str] = []
    kernels: dict[str, RetimeKernel] = {}
    for rec in records:
        arm, trial = rec.get("arm"), rec.get("trial")
        if arm not in ARM_DSL or not isinstance(trial, str) or rec.get("error") or rec.get("skipped"):
            continue
        if rec.get("status") not in RETIMABLE:
            continue
        path = Path(run_dir) / "trials" / trial / "kernel.py"
        if not path.is_file():
            notes.append(f"{trial}: no final kernel.py in the run folder; not re-timed")
            continue
        sha = _sha_file(path)
        if rec.get("final_kernel_sha256") not in (None, sha):
            notes.append(f"{trial}: kernel.py differs from the recorded final kernel; not re-timed")
            continue
        kernels[arm] = RetimeKernel(arm, trial, ARM_DSL[arm], path, sha)
    pairs = [d for d in DIRECTIONS if all(a in kernels for a in direction_arms(d)[1:])]
    if not pairs:
        return None, notes
    return RetimeGroup(problem_id, replicate, tuple(kernels[a] for a in sorted(kernels))), notes


def _plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def result_entry(group: RetimeGroup, result: Any, settings: RetimeSettings, tier: str, model: str,
                 wall_s: float) -> dict[str, Any]:
    """The line stored for one re-timing (the RetimeResult's windows, env and stage times as JSON), built as a
    :class:`~mkb_eval.run_record.RetimeRecord`: a window or field the record does not know fails here."""
    return R.RetimeRecord.model_validate({
        "key": group.key(settings.rounds, tier), "group": group.id, "problem_id": group.problem_id,
        "replicate": group.replicate, "model": model, "tier": getattr(result, "tier", tier), "settings": asdict(settings),
        "kernels": {k.label: {"trial": k.trial, "dsl": k.dsl, "sha256": k.sha256} for k in group.kernels},
        "labels": list(getattr(result, "labels", [k.label for k in group.kernels])),
        "windows": _plain(list(getattr(result, "windows", []))),
        "env": _plain(getattr(result, "env", {})), "stages_s": _plain(getattr(result, "stages_s", {})),
        "wall_s": round(wall_s, 3), "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }).to_json()


def done_keys(run_dir: Path) -> set[str]:
    """Keys of the re-timings stored in the run folder (read strictly, older versions migrated)."""
    return {r.key for r in R.read_retimes(Path(run_dir) / RETIME_FILE)}


RetimeFn = Callable[..., Any]


class Retimer:
    """Re-times groups as they become ready, or, with ``defer``, once :meth:`start` (or :meth:`wait`) is
    called: a run on the GPU defers them until its verifications are done, so nothing but other
    re-timings shares the host with them, and the re-timings share one :class:`QuietHost`, so their
    timed rounds run with the host quiet (the A/A on the H200: end-to-end times beside compiling
    workers varied 2-13% over a kernel's rounds).

    ``retime_fn`` defaults to ``mkb_eval.harness.retime.retime`` (imported when first needed);
    tests inject a fake with the same signature. On the GPU tier each re-timing takes the least
    busy GPU's lane, whose exclusive hold the re-timing takes for its timed rounds.
    """

    def __init__(self, run_dir: Path, problems: Mapping[int, P.Problem], tier: str, *, model: str,
                 settings: RetimeSettings | None = None, lanes: Any = None, pool: Any = None, limits: Any = None,
                 retime_fn: RetimeFn | None = None, log: Callable[[str], None] = print, defer: bool = False) -> None:

        self.run_dir, self.problems, self.tier, self.model = Path(run_dir), problems, tier, model
        self.settings = settings or RetimeSettings()
        self.lanes, self.warm, self.limits = lanes, pool, limits
        self._fn = retime_fn
        self.log = log
        self._done = done_keys(self.run_dir)
        self._inflight: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self.quiet = QuietHost() if tier == "gpu" else None
        self._deferred: dict[str, RetimeGroup] | None = {} if defer else None
        n = len(lanes) if lanes is not None else 1
        # a group's workers start, compile and pass their sanity draw as busy work: a few groups in flight
        # overlap that; their timed rounds then take the quiet host one group at a time
        cap = max(2, (os.cpu_count() or 1) // CORES_PER_GROUP)
        self._pool = ThreadPoolExecutor(max_workers=min(max(1, n) * GROUPS_PER_GPU, cap),
                                        thread_name_prefix="mkb-retime")
        self.stored = 0
        self.skipped_done = 0
        self.failed: list[str] = []
        self.gpu_s = 0.0

    def _retime_fn(self) -> RetimeFn:
        if self._fn is None:
            from mkb_eval.harness.retime import retime

            self._fn = retime
        return self._fn

    def submit(self, group: RetimeGroup) -> bool:
        """Queue ``group`` unless its result is stored or queued already; returns whether it was queued."""
        key = group.key(self.settings.rounds, self.tier)
        with self._lock:
            if key in self._done:
                self.skipped_done += 1
                return False
            if key in self._inflight or (self._deferred is not None and key in self._deferred):
                return False
            if self._deferred is not None:
                self._deferred[key] = group
            else:
                self._inflight[key] = self._pool.submit(self._run, group, key)
        return True

    def start(self) -> int:
        """Start the deferred re-timings (and re-time later groups as they come); how many started."""
        with self._lock:
            pending, self._deferred = self._deferred or {}, None
            for key, group in pending.items():
                self._inflight[key] = self._pool.submit(self._run, group, key)
        return len(pending)

    def _run(self, group: RetimeGroup, key: str) -> None:
        import time

        problem = self.problems[group.problem_id]
        kernels = {k.label: (k.dsl, k.path) for k in group.kernels}
        s = self.settings
        seed = int(key[:8], 16)
        t0 = time.perf_counter()
        try:
            fn = self._retime_fn()
            if self.lanes is not None:
                with self.lanes.least_busy() as lane:
                    result = fn(problem, kernels, rounds=s.rounds, warmup=s.warmup, draws=s.draws, gpu=lane.index,
                                lane=lane, limits=self.limits, pool=self.warm, seed=seed, quiet=self.quiet)
            else:
                result = fn(problem, kernels, rounds=s.rounds, warmup=s.warmup, draws=s.draws, gpu=0, lane=None,
                            limits=self.limits, pool=self.warm, seed=seed, quiet=self.quiet)
        except ModuleNotFoundError as e:       # a checkout without the harness's re-timing
            self.failed.append(f"{group.id}: {e}")
            if len(self.failed) == 1:
                self.log(f"no paired re-timing ({e}); passed pairs stay unresolved under the paired verdict")
            with self._lock:
                self._inflight.pop(key, None)
            return
        except Exception as e:  # noqa: BLE001 - the harness's failure: nothing stored, the next run retries
            self.failed.append(f"{group.id}: {type(e).__name__}: {e}")
            self.log(f"re-timing {group.id} failed ({type(e).__name__}: {e}); it is re-timed by the next run")
            self.log(traceback.format_exc(limit=3))
            with self._lock:
                self._inflight.pop(key, None)
            return
        wall = time.perf_counter() - t0
        entry = result_entry(group, result, s, self.tier, self.model, wall)
        with self._lock:
            append_jsonl(self.run_dir / RETIME_FILE, entry)
            self._done.add(key)
            self._inflight.pop(key, None)
            self.stored += 1
            self.gpu_s += wall

    def wait(self) -> None:
        """Start what was deferred, then block until every queued re-timing has ended (stored or failed)."""
        self.start()
        while True:
            with self._lock:
                futs = list(self._inflight.values())
            if not futs:
                return
            for f in futs:
                f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def ready_groups(keys: Iterable[Any], records: Mapping[str, Mapping[str, Any]]) -> dict[tuple[int, int], list[str]]:
    """Selected trials by (problem, replicate), for the groups whose trials all have a finished record."""
    by: dict[tuple[int, int], list[str]] = {}
    for k in keys:
        by.setdefault((k.problem_id, k.replicate), []).append(k.id)
    return {g: ids for g, ids in by.items()
            if all(t in records and not records[t].get("error") for t in ids)}


def queue_ready(retimer: Retimer, store: Any, keys: Iterable[Any], groups: set[tuple[int, int]] | None,
                note: Callable[[str], None]) -> int:
    """Queue every ready group (of ``groups``, or all); returns how many were queued."""
    records = store.records()
    n = 0
    for (pid, rep), ids in ready_groups(keys, records).items():
        if groups is not None and (pid, rep) not in groups:
            continue
        group, notes = group_from_records(store.root, pid, rep, [records[t] for t in ids])
        for msg in notes:
            note(msg)
        if group is not None and retimer.submit(group):
            n += 1
    return n
