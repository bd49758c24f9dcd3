"""Per-evaluation overhead of two checkouts on one host, interleaved: each tree verifies the same shipped
kernels in a process of its own (warm forked workers, no torch.compile baseline), round after round,
alternating which tree goes first, and the stage times of every record are kept.

    python scripts/eval_overhead.py --tree before=build/before_timing --tree after=. \
        --kernels 28/cutedsl,28/tirx,36/cutedsl,36/tirx --rounds 2 --out "$OUT/overhead.jsonl"

A tree is a folder holding ``mkb_eval`` and ``problems`` (e.g. ``git archive <commit> mkb_eval problems``).
The summary (stdout, and ``<out>.md``) gives the median ``stages_s.total`` per kernel and tree and the
after/before ratio. Only public entry points are used, so any version of the toolkit can be a tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys, time
from mkb_eval import problems as P
from mkb_eval.harness.pool import WarmPool
from mkb_eval.harness.verify import Limits, verify
kernels = [k.split("/") for k in sys.argv[1].split(",")]
with WarmPool(fork=True) as pool:
    pool.fill("gpu", 0, Limits())
    for pid, dsl in kernels:
        p = P.find(int(pid))
        t = time.perf_counter()
        rec = verify(p, dsl, p.solution_path(dsl), pool=pool, compile_baseline=False)
        t = time.perf_counter() - t
        tm = rec.timing
        print(json.dumps({"problem": int(pid), "dsl": dsl, "status": rec.status, "wall_s": round(t, 3),
                          "stages_s": rec.stages_s, "kernel_ms": tm.kernel_ms, "eager_ms": tm.eager_ms,
                          "attested_ms": getattr(tm, "attested_ms", None),
                          "worker_event_ms": getattr(tm, "worker_event_ms", None),
                          "message": rec.message[-300:]}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=FOLDER (mkb_eval + problems)")
    ap.add_argument("--kernels", default="28/cutedsl,28/tirx,36/cutedsl,36/tirx")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    trees = [t.split("=", 1) for t in a.tree]
    for name, folder in trees:
        if not (Path(folder) / "mkb_eval").is_dir() or not (Path(folder) / "problems").is_dir():
            ap.error(f"tree {name}: {folder} holds no mkb_eval/ and problems/")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(a.rounds):
        for name, folder in (trees if r % 2 == 0 else trees[::-1]):
            env = {**os.environ, "PYTHONPATH": str(Path(folder).resolve())}
            proc = subprocess.run([sys.executable, "-c", _CHILD, a.kernels], env=env, capture_output=True,
                                  text=True, cwd=folder)
            if proc.returncode:
                print(f"tree {name} round {r}: exit {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
            for line in proc.stdout.splitlines():
                try:
                    row = {"tree": name, "round": r, **json.loads(line)}
                except json.JSONDecodeError:
                    continue
                rows.append(row)
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    lines = ["| kernel | " + " | ".join(f"{n} total s (median)" for n, _ in trees) + " | ratio |", "|---|"
             + "---|" * (len(trees) + 1)]
    ratios = []
    for k in a.kernels.split(","):
        pid, dsl = k.split("/")
        med = []
        for name, _ in trees:
            xs = [x["stages_s"].get("total", x["wall_s"]) for x in rows
                  if x["tree"] == name and str(x["problem"]) == pid and x["dsl"] == dsl and x["status"] == "ok"]
            med.append(statistics.median(xs) if xs else None)
        ratio = med[-1] / med[0] if len(med) > 1 and med[0] and med[-1] else None
        if ratio:
            ratios.append(ratio)
        lines.append(f"| {k} | " + " | ".join("-" if m is None else f"{m:.2f}" for m in med)
                     + f" | {'-' if ratio is None else f'{ratio:.3f}'} |")
    if ratios:
        lines.append(f"\nmedian ratio {trees[-1][0]}/{trees[0][0]}: {statistics.median(ratios):.3f}")
    bad = [x for x in rows if x["status"] != "ok"]
    lines += [f"not ok: {x['tree']} {x['problem']}/{x['dsl']}: {x['status']} {x['message']}" for x in bad]
    text = "\n".join(lines)
    print(text)
    Path(str(a.out) + ".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
