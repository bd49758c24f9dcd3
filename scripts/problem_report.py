"""Full-size report of every problem's reference on the GPU: peak memory, eager and torch.compile
times, SOL ratio, and problems whose eager time is under 20 us (launch overhead would dominate).

    python scripts/problem_report.py --out docs/problem_report [--jobs 12] [--problems 1,28]

torch.compile is warmed in parallel processes first (CPU-bound; the compiled graphs land in inductor's
cache on disk), then every reference is measured with its GPU to itself (a lock per GPU), with nothing
compiling beside it; ``compile_s`` is the parallel phase's compile time. A run cut short resumes: the
problems already measured without error in ``<out>.rows.jsonl`` are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WARMUP, TIMED = 3, 10
SMALL_US = 20.0


@contextlib.contextmanager
def gpu_lock(path: str):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def warm(args: tuple[str, str, str, str, str | None]) -> dict:
    """Phase 1, many at once: torch.compile of the reference, run once, so the inductor cache on
    disk holds it when phase 2 times it with nothing else compiling beside it."""
    folder, _, device, size, _ = args
    import torch
    import torch._dynamo as dynamo

    from mkb_eval import problems as P
    from mkb_eval.harness.judge import Judge
    from mkb_eval.harness.tolerance import reference_numerics

    prob = P.load_problem(folder)
    row: dict = {"id": prob.id}
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        judge = Judge(prob, size, device)
        t0 = time.perf_counter()
        dynamo.reset()
        with reference_numerics(), torch.no_grad():
            torch.compile(judge.module.reference)(*judge.inputs(100))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - phase 2 measures (and reports) it again
        row["warm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def measure(args: tuple[str, str, str, str, str | None]) -> dict:
    folder, lock, device, size, no_compile = args
    import torch

    from mkb_eval import problems as P
    from mkb_eval.harness.judge import Judge
    from mkb_eval.harness.tolerance import run_reference

    prob = P.load_problem(folder)
    row = {"id": prob.id, "name": prob.name, "family": prob.family, "sol_ms": prob.sol.sol_ms, "bound": prob.sol.bound}
    try:
        judge = Judge(prob, size, device)
        seeds = list(range(1, WARMUP + TIMED + 2))
        gpu = device.startswith("cuda")
        if gpu:
            torch.cuda.set_device(torch.device(device))
        with gpu_lock(lock):
            if gpu:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            inputs = judge.inputs(seeds[-1])
            run_reference(judge.module.reference, inputs)
            run_reference(judge.module.reference, inputs, anchored=True)     # the judge needs both
            if gpu:
                torch.cuda.synchronize()
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            del inputs
            if not gpu:
                raise RuntimeError("timing needs a GPU (the reference ran; memory and times not measured)")
            eager, _ = judge.time_reference(seeds[:WARMUP], seeds[WARMUP:WARMUP + TIMED])
            row["eager_ms"] = eager.median_ms
        if gpu and no_compile:
            row["compile_note"] = no_compile
        elif gpu:
            row.update(measure_compile(prob, judge, lock, size))
    except Exception as e:  # noqa: BLE001 - a failing reference is a finding, reported in the table
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["trace"] = traceback.format_exc()[-1500:]
    if row.get("eager_ms"):
        row["sol_over_eager"] = prob.sol.sol_ms / row["eager_ms"]
        row["small"] = row["eager_ms"] * 1e3 < SMALL_US
    print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    return row


def measure_compile(prob, judge, lock: str, size: str) -> dict:
    """torch.compile: compiled outside the lock (CPU-bound, in parallel), timed under it with the
    verifier's procedure and draw counts, and stored in the verifier's compile cache so sweeps
    (``mkb verify --all --cached-compile-baseline``) never compile inside a timing lane."""
    import torch
    import torch._dynamo as dynamo

    from mkb_eval.env import describe
    from mkb_eval.harness.jobs import TIMING_DRAWS, WARMUP_DRAWS
    from mkb_eval.harness.judge import baseline_cached
    from mkb_eval.harness.timing import Clock, time_draws
    from mkb_eval.harness.tolerance import reference_numerics
    from mkb_eval.harness.verify import default_cache_dir

    row: dict = {}
    seeds = list(range(100, 100 + WARMUP_DRAWS + TIMING_DRAWS))

    def timed(fn) -> float:
        with gpu_lock(lock), reference_numerics(), torch.no_grad():
            return time_draws(fn, judge.inputs, seeds[:WARMUP_DRAWS], seeds[WARMUP_DRAWS:], Clock(),
                              torch.device("cuda")).median_ms

    def measure() -> float:          # the inductor cache on disk holds the graph since phase 1 (warm)
        dynamo.reset()
        compiled = torch.compile(judge.module.reference)
        with reference_numerics(), torch.no_grad():
            compiled(*judge.inputs(seeds[0]))
        return timed(compiled)

    env = describe()
    # the eager time by the verifier's procedure, in a process of its own, for sweeps that reuse it
    # (a judge thread timing eager beside other judges measured host-bound references 0.2-3.3x apart)
    row["eager_verifier_ms"] = baseline_cached(prob, size, env, default_cache_dir(),
                                               lambda: timed(judge.module.reference), kind="eager")[0]
    ms, cached, err = baseline_cached(prob, size, env, default_cache_dir(), measure)
    row.update(compile_ms=ms, compile_cached=cached)
    if err:
        row["error"] = f"torch.compile: {err}"
    return row


def main() -> int:
    from mkb_eval.cli import problem_ids

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/problem_report")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--problems", type=problem_ids, help="problem ids, e.g. 1-43,50")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="full")
    ap.add_argument("--warm-s", type=float, default=300,
                    help="the parallel compile phase ends after this; a reference still compiling then gets no "
                         "torch.compile time (a sweep never compiles one inside a timing lane either)")
    ap.add_argument("--merge", nargs="+", metavar="ROWS_JSONL",
                    help="measure nothing: build the report from these row logs (a later row of a problem wins)")
    args = ap.parse_args()
    out = Path(args.out)
    from mkb_eval.records import append_jsonl, read_jsonl

    if args.merge:
        rows = {r["id"]: r for f in args.merge for r in read_jsonl(f)}
        return write_report(out, sorted(rows.values(), key=lambda r: r["id"]), args.size)
    from mkb_eval import problems as P

    folders = P.discover()
    if args.problems:
        folders = [f for f in folders if int(f.name[:2]) in args.problems]
    lock = os.path.join(os.environ.get("TMPDIR", "/tmp"), "mkb_gpu_timing.lock")
    ctx = mp.get_context("spawn")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    # one timing lock per GPU, problems dealt round-robin over the visible GPUs
    n_gpu = torch.cuda.device_count() if args.device == "cuda" else 0
    jobs = [(str(f), f"{lock}.{i % n_gpu}" if n_gpu else lock, f"cuda:{i % n_gpu}" if n_gpu else args.device,
             args.size, None) for i, f in enumerate(folders)]
    rows: dict[int, dict] = {}
    log_path = out.with_suffix(".rows.jsonl")
    if log_path.exists():          # resume: a problem measured without error by an earlier (cut) run is kept
        rows = {r["id"]: r for r in read_jsonl(log_path)                  # a line torn by the cut is skipped
                if r.get("eager_ms") is not None and "error" not in r}     # (a compile_note is a result)
        jobs = [j for j in jobs if int(Path(j[0]).name[:2]) not in rows]
    compile_s: dict[int, float | None] = {}

    def run(pending: list, procs: int) -> None:
        with ctx.Pool(procs, maxtasksperchild=1) as pool:
            for row in pool.imap_unordered(measure, pending):
                if compile_s.get(row["id"]) is not None:
                    row["compile_s"] = compile_s[row["id"]]
                rows[row["id"]] = row
                append_jsonl(log_path, row)     # kept even if the run is cut short (a torn line repaired)

    # timing a host-bound reference beside 20+ compiling processes inflated torch.compile times
    # up to 20x (problem 25: 2.42 ms vs 0.10-0.13 ms timed alone), so: compile everything in
    # parallel first, then measure with the compiled graphs cached on disk and the GPU to itself
    # each compiling process gets its share of the cores for inductor's compile workers (24
    # processes, each with inductor's workers for every core, compiled 10-30x slower than before),
    # and the phase ends at --warm-s: one reference compiling for 6+ minutes (66) must not hold up the rest
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
    warmed: set[int] = set()
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:        # leaving the block kills stragglers
        it, end = pool.imap_unordered(warm, jobs), time.monotonic() + args.warm_s
        for _ in jobs:
            try:
                w = it.next(timeout=max(0.0, end - time.monotonic()))
            except mp.TimeoutError:
                break
            warmed.add(w["id"])
            compile_s[w["id"]] = w.get("compile_s")
            print(json.dumps({"warmed": w}), flush=True)
    late = f"torch.compile still compiling after the {args.warm_s:.0f} s compile phase: not timed"
    jobs = [j if int(Path(j[0]).name[:2]) in warmed else (*j[:4], late) for j in jobs]
    # two processes per GPU: one's start, imports and cached compile overlap the other's timing,
    # which the GPU's lock keeps to one at a time
    run(jobs, 2 * max(1, n_gpu))
    # peak memory needs the GPU to itself: a reference that ran out of memory beside the other
    # processes is measured again alone (the later row wins in the .rows.jsonl log too)
    from mkb_eval.sweep import oom_text

    oom = [j for j in jobs if oom_text(rows.get(int(Path(j[0]).name[:2]), {}).get("error", ""))]
    if oom:
        print(f"again, one at a time (out of memory beside the others): {[Path(j[0]).name[:2] for j in oom]}")
        run(oom, 1)
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    for r in rows.values():
        r.setdefault("gpu", gpu_name)
        r.setdefault("torch", torch.__version__)
    return write_report(out, sorted(rows.values(), key=lambda r: r["id"]), args.size)


def write_report(out: Path, rows: list[dict], size: str) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    envs = sorted({f"{r.get('gpu', 'GPU not recorded')}, torch {r.get('torch', '?')}" for r in rows})
    lines = [f"# Problem report ({size} size, {'; '.join(envs)})", "",
             f"Eager: median of {TIMED} timed draws after {WARMUP} warm-up; torch.compile: the verifier's 50 after 10 "
             "(also stored in the verifier's compile cache, as is an eager time by the same procedure). "
             "L2 flushed, device-wide sync inside the event pair. "
             "Peak GiB: reference plus its fp64 anchor. SOL ratio = SOL time / eager time.", "",
             "| id | problem | peak GiB | eager ms | compile ms | SOL ms | bound | SOL/eager | note |",
             "|---:|---|---:|---:|---:|---:|---|---:|---|"]

    def f(x, spec=".4f"):
        return "-" if x is None else format(x, spec)

    for r in rows:
        note = " ".join((r.get("error") or r.get("compile_note") or "").split())[:200] or (
            "eager < 20 us" if r.get("small") else "")
        lines.append(f"| {r['id']:02d} | {r['name']} | {f(r.get('peak_gib'), '.2f')} | {f(r.get('eager_ms'))} | "
                     f"{f(r.get('compile_ms'))} | {f(r['sol_ms'])} | {r['bound']} | {f(r.get('sol_over_eager'), '.3f')} | {note} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    bad = [r for r in rows if r.get("error") or r.get("small") or (r.get("peak_gib") or 0) > 20]
    print(f"{len(rows)} problems, {len(bad)} needing attention: {[r['id'] for r in bad]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
