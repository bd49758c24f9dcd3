#!/usr/bin/env python3
"""Choose the curated verification set of a GPU model: the newest full sweep at the shipped hashes.

Candidates are record files (JSONL of verification records): given with ``--files``, or every
``results/<gpu>/**/*.jsonl`` at a commit of git history (``--commit``, default the benchmark
history commit of ``scripts/benchmark_history.py``). A candidate qualifies when, record by record,
every shipped solution has a GPU-tier record with its current ``kernel_sha256`` and
``problem_hash`` and no record is stale; the newest qualifying one (latest ``created_at``) wins.
Its lines are written verbatim, sorted by (problem, DSL), to ``results/<gpu>/verification.jsonl``,
and where they came from to ``verification.source.json`` beside it:

    python scripts/curate_verification.py --gpu h200
    python scripts/curate_verification.py --gpu h200 --files runs/sweep.jsonl   # after a new sweep
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mkb_eval import problems as P  # noqa: E402
from mkb_eval import verification_set as V  # noqa: E402

_spec = importlib.util.spec_from_file_location("benchmark_history", ROOT / "scripts" / "benchmark_history.py")
history = importlib.util.module_from_spec(_spec)
sys.modules["benchmark_history"] = history          # dataclasses look their module up while it loads
assert _spec.loader is not None
_spec.loader.exec_module(history)


def candidates_at(repo: Path, commit: str, gpu: str) -> list[V.Candidate]:
    names = history._git(repo, "ls-tree", "-r", "--name-only", commit, "--", f"results/{gpu}/").decode().splitlines()
    return [V.parse_candidate(f"{n}@{commit[:12]}", history._git(repo, "show", f"{commit}:{n}").decode("utf-8"))
            for n in sorted(names) if n.endswith(".jsonl") and not n.endswith(V.VERIFICATION_FILE)]


def curate(cands: list[V.Candidate], gpu: str, root: Path | None, out: Path, commit: str | None) -> dict:
    shipped = V.shipped_hashes(P.load_all(root))
    best, rep = V.choose(cands, shipped)
    by_key = {}
    for line, rec in zip(best.lines, best.records, strict=True):
        if rec.get("kind") == "verification" and rec.get("tier") == "gpu":
            by_key[(int(rec["problem_id"]), str(rec["dsl"]))] = line
    lines = [by_key[k] for k in sorted(by_key)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    commits = sorted({(r.get("env") or {}).get("commit", "") for r in best.records})
    source = {
        "gpu": gpu,
        "rule": "newest full sweep (latest created_at) whose GPU records match every shipped kernel's sha256 and "
                "problem hash, record by record; lines copied verbatim, sorted by (problem_id, dsl)",
        "chosen": best.name, "history_commit": commit, "source_sha256": best.sha256,
        "records": len(lines), "ok": len(rep.ok), "newest_created_at": best.newest, "sweep_commits": commits,
        "considered": [c.name for c in cands],
    }
    out.with_name(V.SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
    return source


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default=V.DEFAULT_GPU)
    ap.add_argument("--files", nargs="*", help="candidate record files (default: results/<gpu>/ in git history)")
    ap.add_argument("--commit", default=history.HISTORY_COMMIT, help="commit whose results/<gpu>/ to consider")
    ap.add_argument("--root", help="problems folder (default: the repo's)")
    ap.add_argument("--out", help="set to write (default: results/<gpu>/verification.jsonl)")
    args = ap.parse_args(argv)
    try:
        if args.files:
            cands = [V.parse_candidate(f, Path(f).read_text(encoding="utf-8")) for f in args.files]
            commit = None
        else:
            cands, commit = candidates_at(ROOT, args.commit, args.gpu), args.commit
        out = Path(args.out) if args.out else V.set_path(args.gpu, ROOT / "results")
        src = curate(cands, args.gpu, Path(args.root) if args.root else None, out, commit)
    except (ValueError, OSError, history.HistoryError) as e:
        print(f"curate_verification: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {src['records']} records ({src['ok']} ok) from {src['chosen']}, newest {src['newest_created_at']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
