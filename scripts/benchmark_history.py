#!/usr/bin/env python3
"""Re-create the benchmark history (every sweep and benchmark run kept before the curated sets) from git.

The tracked tree keeps only ``results/<gpu>/verification.jsonl`` (one curated sweep per GPU model),
the problem report and compile cache it is read with, and the human-readable summaries. Every
other record file of the nine H200 benchmark runs and the CPU fork-server run lives in git
history at ``HISTORY_COMMIT``; this script packs the files of ``results/`` at that commit that
the current tree no longer tracks into a deterministic ``.tar.gz`` (sorted names, the commit's
time as mtime, no owner), with ``MANIFEST.json`` (path, size and sha256 of every file) inside, for
upload as a release asset:

    python scripts/benchmark_history.py --out build/benchmark_history.tar.gz
    python scripts/benchmark_history.py --list                  # what it would pack
    python scripts/benchmark_history.py --commit <sha> --out ...  # another point of history

Two runs on the same commit write byte-identical archives.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

HISTORY_COMMIT = "44409e4bdd18d03010e2aee0fc2a6d8800d90a27"
"""The last commit at which results/ held every benchmark run (2026-12-01, before the curated sets)."""
PREFIX = "results/"
ROOT = Path(__file__).resolve().parents[1]


class HistoryError(RuntimeError):
    """The history cannot be read (not a git checkout, unknown commit); one line says why."""


def _git(repo: Path, *args: str) -> bytes:
    try:
        res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    except FileNotFoundError:
        raise HistoryError("git is not installed") from None
    if res.returncode != 0:
        raise HistoryError(f"git {' '.join(args[:2])}: {res.stderr.decode(errors='replace').strip()[:300]}")
    return res.stdout


@dataclass(frozen=True)
class HistoryFile:
    path: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def history_files(repo: Path, commit: str, prefix: str = PREFIX) -> list[HistoryFile]:
    """Files under ``prefix`` at ``commit`` that the current index does not track, sorted by path."""
    then = _git(repo, "ls-tree", "-r", "--name-only", commit, "--", prefix).decode().splitlines()
    now = set(_git(repo, "ls-files", "--", prefix).decode().splitlines())
    return [HistoryFile(p, _git(repo, "show", f"{commit}:{p}")) for p in sorted(then) if p not in now]


def commit_time(repo: Path, commit: str) -> int:
    return int(_git(repo, "log", "-1", "--format=%ct", commit).decode().strip())


def pack(files: list[HistoryFile], commit: str, mtime: int) -> bytes:
    """The .tar.gz bytes: MANIFEST.json first, then every file under its repository path."""
    manifest = {"commit": commit, "files": [{"path": f.path, "bytes": len(f.data), "sha256": f.sha256}
                                            for f in files]}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [("MANIFEST.json", (json.dumps(manifest, indent=1) + "\n").encode())] + \
                          [(f.path, f.data) for f in files]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), mtime, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=mtime, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=HISTORY_COMMIT, help=f"commit to read (default {HISTORY_COMMIT[:12]})")
    ap.add_argument("--repo", default=str(ROOT), help="git checkout (default: this one)")
    ap.add_argument("--out", help="archive to write (.tar.gz)")
    ap.add_argument("--list", action="store_true", help="print the files it would pack and stop")
    args = ap.parse_args(argv)
    repo = Path(args.repo)
    try:
        files = history_files(repo, args.commit)
        if args.list or not args.out:
            for f in files:
                print(f"{len(f.data):9d}  {f.path}")
            print(f"{len(files)} files, {sum(len(f.data) for f in files)} bytes at {args.commit[:12]}")
            return 0
        data = pack(files, args.commit, commit_time(repo, args.commit))
    except HistoryError as e:
        print(f"benchmark_history: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(f"{out}: {len(files)} files from {args.commit[:12]}, {len(data)} bytes, "
          f"sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
