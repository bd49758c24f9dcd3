"""The run folder: append-only records, per-trial artifacts, one writer at a time, crash recovery.

Layout of a run folder::

    run.json            the model this folder belongs to (a run folder holds one model)
    invocations.jsonl   one line per ``mkb run`` (arguments, plan counts, versions)
    retime.jsonl        paired re-timings of final kernels (``mkb_eval.agent.retiming``)
    attempts.jsonl      one record per finished trial, in the metrics' attempt format plus extras
    skills/<trial>.md   the exact text attached to each skill trial (header + source SKILL.md)
    trials/<trial>/     transcript.jsonl, submissions/NN_kernel.py + NN_verification.json,
                        kernel.py (final), SKILL.md (last written), attempt.json (the record)
    archive/            earlier artifacts of trials that are run again, and torn record tails
    .lock               flock held by the one writer (released by the kernel when it dies)

A record is appended only when its trial is finished, with one ``write`` and an fsync, so a
killed run leaves finished trials intact, unfinished ones without a record (run again next
time, their partial folders archived), and at most a torn last line, which is moved to
``archive/`` before anything new is appended. Nothing is ever rewritten in place.

``run.json``, ``invocations.jsonl`` and ``retime.jsonl`` hold the typed records of
:mod:`mkb_eval.run_record` (built strictly when written, migrated and validated when read); the
attempt records are :class:`mkb_eval.attempt_record.AttemptRecord`, and ``records()`` validates every
line (:func:`mkb_eval.attempt_record.read_attempts`, older shapes migrated first, so a folder written by
an older loop still resumes). A line that is not a valid record is skipped with a warning naming the
file, the line and the field, and the trial it names counts as not finished (it runs again): the
plan never reuses an outcome it cannot read, and one bad line never stops a run.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from mkb_eval import run_record as R
from mkb_eval.attempt_record import read_attempts
from mkb_eval.records import append_jsonl

STORE_VERSION = R.STORE_VERSION
INVOCATIONS = "invocations.jsonl"


class StoreError(RuntimeError):
    """The run folder cannot be used (locked, another model's, unreadable); one-line message."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temp file and a rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class TrialArtifacts:
    """The folder of one trial: transcript, submitted kernels and their verification records."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "submissions").mkdir(parents=True, exist_ok=True)

    def message(self, entry: dict[str, Any]) -> None:
        append_jsonl(self.root / "transcript.jsonl", {"at": _now(), **entry})

    def kernel_path(self, k: int) -> Path:
        return self.root / "submissions" / f"{k:02d}_kernel.py"

    def submission(self, k: int, kernel: str) -> Path:
        path = self.kernel_path(k)
        write_text_atomic(path, kernel)
        return path

    def verification(self, k: int, record: dict[str, Any]) -> None:
        write_json_atomic(self.root / "submissions" / f"{k:02d}_verification.json", record)

    def skill(self, text: str) -> None:
        write_text_atomic(self.root / "SKILL.md", text)

    def final(self, kernel: str | None, record: dict[str, Any]) -> None:
        if kernel is not None:
            write_text_atomic(self.root / "kernel.py", kernel)
        write_json_atomic(self.root / "attempt.json", record)


class RunStore:
    """One run folder, opened by one writer (``with RunStore(path) as store``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.attempts_path = self.root / "attempts.jsonl"
        self._lock_fd: int | None = None
        self.notes: list[str] = []

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> RunStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Take the writer lock and repair a torn last record line; raises StoreError when locked."""
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"run folder {self.root} exists and is not a folder")
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreError(f"run folder {self.root} is in use by pid {holder}; wait for it or use "
                                 "another --run-dir") from None
            raise StoreError(f"cannot lock run folder {self.root}: {e}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        self._repair_torn_tail()

    def close(self) -> None:
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, 0)
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _require_lock(self) -> None:
        if self._lock_fd is None:
            raise StoreError(f"run folder {self.root} is not open for writing")

    def _repair_torn_tail(self) -> None:
        """A line without its newline is a write cut short by a kill: move it to archive/, keep the rest."""
        p = self.attempts_path
        if not p.is_file() or p.stat().st_size == 0:
            return
        with open(p, "rb+") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            cut = data.rfind(b"\n") + 1
            torn = data[cut:]
            keep = self.root / "archive" / f"{_stamp()}__torn_attempts_line.txt"
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_bytes(torn)
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        self.notes.append(f"attempts.jsonl ended with a torn line ({len(torn)} bytes) from an interrupted run; "
                          f"moved to {keep.relative_to(self.root)}")

    # -- run identity ----------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        """A run folder holds one model: refuse another one (read-only, before anything runs)."""
        meta = self.run_meta()
        if meta is not None and meta.model != model:
            raise StoreError(f"run folder {self.root} holds model {meta.model!r}, not {model!r}; use another --run-dir")
        for rec in self.records().values():
            if rec.get("model") not in (None, model):
                raise StoreError(f"run folder {self.root} holds records of model {rec.get('model')!r}, not {model!r}")

    def run_meta(self) -> R.RunMeta | None:
        """``run.json`` (migrated and validated), or None before the first invocation pinned a model."""
        path = self.root / "run.json"
        if not path.is_file():
            return None
        try:
            return R.read_run_meta(path)
        except ValueError as e:
            raise StoreError(str(e)) from None

    def pin_model(self, model: str, backend: dict[str, Any]) -> None:
        self._require_lock()
        meta = self.root / "run.json"
        if not meta.is_file():
            write_json_atomic(meta, R.RunMeta(model=model, backend=backend, created_at=_now()).to_json())

    def log_invocation(self, entry: dict[str, Any]) -> None:
        """Append one invocation record; ``entry`` holds the fields of :class:`~mkb_eval.run_record.Invocation`
        but ``started_at`` (a missing, misspelt or mistyped one raises here, before anything runs)."""
        self._require_lock()
        append_jsonl(self.root / INVOCATIONS, R.Invocation(started_at=_now(), **entry).to_json())

    def invocations(self) -> list[R.Invocation]:
        path = self.root / INVOCATIONS
        try:
            return R.read_invocations(path) if path.is_file() else []
        except ValueError as e:
            raise StoreError(str(e)) from None

    # -- records -----------------------------------------------------------------------------
    def records(self) -> dict[str, dict[str, Any]]:
        """The latest attempt record per trial id (later lines supersede earlier ones), each validated and
        in its current shape. A bad line warns and un-finishes the trial it names (see the module docstring)."""
        out: dict[str, dict[str, Any]] = {}
        if not self.attempts_path.is_file():
            return out
        for line in read_attempts(self.attempts_path):
            if line.record is not None:
                out[line.record.trial] = line.record.to_json()
                continue
            trial = line.trial
            if trial is not None:
                out.pop(trial, None)
            warnings.warn(f"{line.error}; line skipped" + (f", trial {trial} runs again" if trial else ""),
                          stacklevel=2)
        return out

    def append_record(self, record: dict[str, Any]) -> None:
        self._require_lock()
        append_jsonl(self.attempts_path, record)

    # -- artifacts ---------------------------------------------------------------------------
    def trial_dir(self, trial: str) -> Path:
        return self.root / "trials" / trial

    def begin_trial(self, trial: str) -> TrialArtifacts:
        """A fresh artifacts folder; a previous one (unfinished, errored or stale) is archived, not deleted."""
        self._require_lock()
        d = self.trial_dir(trial)
        if d.exists():
            dest = self.root / "archive" / f"{_stamp()}__{trial}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(d), str(dest))
        return TrialArtifacts(d)

    def final_skill(self, trial: str) -> str | None:
        """The SKILL.md a finished trial left (None when it wrote none)."""
        p = self.trial_dir(trial) / "SKILL.md"
        return p.read_text() if p.is_file() else None

    def write_attachment(self, trial: str, text: str) -> Path:
        self._require_lock()
        path = self.root / "skills" / f"{trial}.md"
        write_text_atomic(path, text)
        return path
