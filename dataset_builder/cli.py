"""``mkb dataset build|push|check`` (the ``skills`` commands are :mod:`mkb_eval.skills.cli`).

``register(subparsers)`` adds the command group to the ``mkb`` parser. Every handler turns the
library's errors into one line on stderr and exit status 2; findings (a leak, a stale index, a
hash that does not reproduce) exit 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from dataset_builder.features import CONFIG_NAMES
from mkb_eval.dataset import DEFAULT_REPO, DatasetError

DEFAULT_OUT = Path("build") / "metakernelbench"


def _guard(prefix: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (BuildError, DatasetError) as e:
            lines = str(e).splitlines() or [type(e).__name__]
            print(f"{prefix}: {lines[0]}", file=sys.stderr)
            for line in lines[1:]:
                print(f"  {line}", file=sys.stderr)
            return 2
    return run


def _ints(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BuildError(f"{what} must be comma-separated integers, got {text!r}") from None


def _build(args: argparse.Namespace) -> int:
    from dataset_builder.build import BuildOptions, build_dataset
    from dataset_builder.sources.reference_outputs import PUBLIC_SEEDS

    configs = tuple(c.strip() for c in args.configs.split(",")) if args.configs else CONFIG_NAMES
    kw: dict[str, Any] = {}
    if args.results:
        kw["results_root"] = Path(args.results)
    if args.skills_corpus:
        kw["skills_corpus"] = Path(args.skills_corpus)
    res = build_dataset(BuildOptions(
        out=Path(args.out), version=args.version, configs=configs,
        problems_root=Path(args.root) if getattr(args, "root", None) else None,
        problem_ids=_ints(args.problems, "--problems"), runs=tuple(Path(r) for r in args.runs or ()),
        previous=Path(args.previous) if args.previous else None,
        seeds=_ints(args.seeds, "--seeds") or PUBLIC_SEEDS, hub_repo=args.repo, **kw))
    print(f"built MetaKernelBench {res.version} at {res.out}")
    for name, n in res.rows.items():
        print(f"  {name:18s} {n:6d} rows")
    print("changelog:")
    for line in res.changelog_entry["changes"]:
        print(f"  - {line}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from dataset_builder.push import push_dataset

    plan = push_dataset(args.folder, args.repo, args.tag, push=args.push)
    print(plan.describe())
    return 0


def _check(args: argparse.Namespace) -> int:
    from mkb_eval.dataset import check_folder

    info = check_folder(args.folder, verify_hashes=True)
    print(f"{info.path}: dataset_version {info.dataset_version}; configs {', '.join(info.configs)}: "
          "files and hashes ok")
    status = 0
    if {"solutions", "baselines"} & set(info.configs):
        from dataset_builder.check import check_records
        from mkb_eval import problems as P

        res = check_records(info.configs, P.load_all(Path(args.root) if getattr(args, "root", None) else None))
        for f in res.findings:
            print(f"  RECORD {f}")
        print(res.summary())
        status = 1 if res.findings else 0
    if not args.reference_outputs:
        return status
    if "reference_outputs" not in info.configs:
        raise BuildError(f"{args.folder}: no reference_outputs config to reproduce")
    import pyarrow.parquet as pq

    from dataset_builder.sources.reference_outputs import reproduce
    from mkb_eval import problems as P

    root = Path(args.root) if getattr(args, "root", None) else None
    files = [f for fs in info.configs["reference_outputs"].values() for f in fs]
    columns = ["problem_id", "seed", "problem_hash", "ok", "sha256", "outputs", "torch_version", "cpu_capability"]
    rows = [r for f in files for r in pq.read_table(f, columns=columns).to_pylist()]
    bad = reproduce(rows, P.load_all(root), root)
    for m in bad:
        print(f"  MISMATCH {m}")
    print(f"reference_outputs: {len(rows) - len(bad)}/{len(rows)} rows reproduced on this CPU")
    return 1 if bad or status else 0


def register(subparsers: Any) -> None:
    """Add the ``dataset`` command group to the ``mkb`` sub-parser action."""
    ds = subparsers.add_parser("dataset", help="build, check and push the Hugging Face dataset")
    dsub = ds.add_subparsers(dest="what", required=True)

    b = dsub.add_parser("build", help="write the dataset folder (parquet per config + card + manifest)")
    b.add_argument("--out", default=str(DEFAULT_OUT), help=f"dataset folder to write (default: {DEFAULT_OUT})")
    b.add_argument("--version", required=True, help="semver dataset_version, e.g. 1.0.0")
    b.add_argument("--previous", help="folder of the previous build (its manifest.json drives the changelog)")
    b.add_argument("--runs", nargs="*", help="run folders holding attempts.jsonl (attempts and skills configs)")
    b.add_argument("--results", help="results folder with <gpu>/verification.jsonl, the curated sets (default: the repo's results/)")
    b.add_argument("--skills-corpus", help="released skills corpus (default: the repo's skills_corpus/)")
    b.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIG_NAMES)} (default: all)")
    b.add_argument("--problems", help="comma-separated problem ids (default: all)")
    b.add_argument("--seeds", help="public seeds of reference_outputs (default: 0,1,2)")
    b.add_argument("--repo", default=DEFAULT_REPO, help="Hub repo id named in the card")
    b.set_defaults(fn=_guard("mkb dataset build", _build))

    p = dsub.add_parser("push", help="upload a built folder to the Hub and tag it (dry run without --push)")
    p.add_argument("--repo", required=True, help="<org>/metakernelbench")
    p.add_argument("--tag", required=True, help="v<dataset_version>, e.g. v1.0.0")
    p.add_argument("--folder", default=str(DEFAULT_OUT), help=f"built dataset folder (default: {DEFAULT_OUT})")
    p.add_argument("--push", action="store_true", help="really upload (default: print the plan only)")
    p.set_defaults(fn=_guard("mkb dataset push", _push))

    c = dsub.add_parser("check", help="check a built folder (card, configs, parquet, hashes; solutions and baselines "
                                      "against the checkout's kernel and problem hashes)")
    c.add_argument("folder")
    c.add_argument("--reference-outputs", action="store_true",
                   help="also re-run the references on CPU and compare every hash")
    c.set_defaults(fn=_guard("mkb dataset check", _check))
