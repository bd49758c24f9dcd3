"""``mkb dataset build|push|check`` and ``mkb skills export|check|index``.

``register(subparsers)`` adds both command groups to the ``mkb`` parser. Every handler turns the
library's errors into one line on stderr and exit status 2; findings (a leak, a stale index, a
hash that does not reproduce) exit 1.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from dataset_builder.features import CONFIG_NAMES
from mkb_eval.dataset import DEFAULT_REPO, DatasetError
from mkb_eval.skills.model import SkillError

DEFAULT_OUT = Path("build") / "metakernelbench"


def _guard(prefix: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (BuildError, DatasetError, SkillError) as e:
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


def _skills_sources(args: argparse.Namespace) -> list[Any]:
    from mkb_eval.skills.corpus import CORPUS_ROOT, read_corpus
    from mkb_eval.skills.runs import read_run, run_skills

    skills: list[Any] = []
    corpus = Path(args.corpus) if args.corpus else CORPUS_ROOT
    if not args.no_corpus:
        skills += read_corpus(corpus)
    for r in args.runs or ():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = read_run(r, strict=False)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        skills += run_skills(run)
    return skills


def _skills_export(args: argparse.Namespace) -> int:
    from mkb_eval import problems as P
    from mkb_eval.skills.corpus import write_release
    from mkb_eval.skills.export import export

    skills = _skills_sources(args)
    out = Path(args.out)
    if args.format == "md":
        if not args.dataset_version:
            raise SkillError("--format md releases skills and needs --dataset-version X.Y.Z")
        from dataset_builder.versioning import parse_version

        parse_version(args.dataset_version)
        paths = write_release([s for s in skills if s.origin.startswith("run:")], out, args.dataset_version)
        print(f"released {len(paths)} skills into {out} (run `mkb skills index` to update the corpus README)")
        return 0
    root = Path(args.root) if getattr(args, "root", None) else None
    problems = {p.id: p for p in P.load_all(root)}
    evidence, task_prompt = (None, None) if args.format == "dpo" else _evidence(args, problems.values())
    tasks = tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else ("apply_skill", "write_skill")
    res = export(skills, problems, args.format, out, include_flagged=args.include_flagged, evidence=evidence,
                 task_prompt=task_prompt, gpu=args.gpu, tasks=tasks)
    left = ", ".join(f"{n} {why}" for why, n in sorted(res.left_out.items())) or "none"
    kinds = {}
    for r in res.records:
        kinds[r.get("task", "pair")] = kinds.get(r.get("task", "pair"), 0) + 1
    print(f"wrote {len(res.records)} {args.format} records to {out} ("
          + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
          + f"; validated against {args.format.replace('-', '_')}.schema.json); left out: {left}")
    return 0


def _evidence(args: argparse.Namespace, problems: Any) -> tuple[Any, Any]:
    """The curated set's records that verified the shipped solutions, and the skill arm's prompt renderer."""
    from mkb_eval import verification_set as V
    from mkb_eval.agent.prompts import render_skill_task, render_task

    path = Path(args.verification) if args.verification else V.set_path(args.gpu)
    if args.verification == "none":
        return None, None
    try:
        rep = V.match(V.read_set(path), V.shipped_hashes(problems))
    except ValueError as e:
        raise SkillError(f"--verification: {e}") from None
    return rep.matched, lambda p, dsl, body: render_skill_task(render_task(p, dsl), body).text


def _skills_check(args: argparse.Namespace) -> int:
    from mkb_eval.skills.leak import check_text

    skills = _skills_sources(args)
    flagged = 0
    for s in skills:
        findings = check_text(s.text)
        if findings:
            flagged += 1
            print(f"{s.origin}: {len(findings)} leak finding(s)")
            for f in findings:
                print(f"  line {f.line}: {f.kind}: {f.excerpt}")
    print(f"{len(skills)} skills checked (front matter and sha256 of corpus files valid); {flagged} flagged")
    return 1 if flagged else 0


def _skills_seal(args: argparse.Namespace) -> int:
    from mkb_eval.skills.corpus import seal_file

    for f in args.files:
        print(f"{f}: sha256 {seal_file(Path(f))}")
    return 0


def _skills_index(args: argparse.Namespace) -> int:
    from mkb_eval.skills.corpus import CORPUS_ROOT, read_corpus
    from mkb_eval.skills.index import update_readme

    corpus = Path(args.corpus) if args.corpus else CORPUS_ROOT
    readme = corpus / "README.md"
    new, changed = update_readme(readme, read_corpus(corpus))
    if args.check:
        print(f"{readme}: index is {'stale; run `mkb skills index`' if changed else 'current'}")
        return 1 if changed else 0
    if changed:
        readme.write_bytes(new.encode("utf-8"))
    print(f"{readme}: index {'updated' if changed else 'already current'}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``dataset`` and ``skills`` command groups to the ``mkb`` sub-parser action."""
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

    sk = subparsers.add_parser("skills", help="skills corpus: leak check, index, training exports")
    ssub = sk.add_subparsers(dest="what", required=True)

    def sources(q: argparse.ArgumentParser) -> None:
        q.add_argument("--corpus", help="skills corpus folder (default: the repo's skills_corpus/)")
        q.add_argument("--no-corpus", action="store_true", help="leave the corpus out (only --runs)")
        q.add_argument("--runs", nargs="*", help="run folders whose solo SKILL.md files to include")

    e = ssub.add_parser("export", help="JSONL for training (sft, sft-messages, dpo: TRL's dataset formats) or "
                                       "release markdown (md)")
    e.add_argument("--format", required=True, choices=("sft", "sft-messages", "dpo", "md"),
                   help="sft: prompt/completion; sft-messages: conversational messages; dpo: prompt/chosen/rejected")
    e.add_argument("--out", required=True, help="JSONL file (sft, sft-messages, dpo) or folder (md)")
    e.add_argument("--verification", help="curated verification set whose records are the evidence of apply_skill "
                                          "records (default: results/<gpu>/verification.jsonl; 'none' for none)")
    e.add_argument("--gpu", default="h200", help="GPU model of the default verification set (default h200)")
    e.add_argument("--tasks", help="SFT record kinds, comma-separated: apply_skill,write_skill (default both)")
    e.add_argument("--include-flagged", action="store_true", help="keep skills the leak check flags")
    e.add_argument("--dataset-version", help="with --format md: the version the skills are released in")
    sources(e)
    e.set_defaults(fn=_guard("mkb skills export", _skills_export))

    k = ssub.add_parser("check", help="validate corpus files and flag skills with code or DSL API calls")
    sources(k)
    k.set_defaults(fn=_guard("mkb skills check", _skills_check))

    sl = ssub.add_parser("seal", help="set the sha256 in a skill file's front matter to its text's")
    sl.add_argument("files", nargs="+")
    sl.set_defaults(fn=_guard("mkb skills seal", _skills_seal))

    i = ssub.add_parser("index", help="regenerate the index in the corpus README")
    i.add_argument("--corpus", help="skills corpus folder (default: the repo's skills_corpus/)")
    i.add_argument("--check", action="store_true", help="exit 1 if the index is stale instead of writing it")
    i.set_defaults(fn=_guard("mkb skills index", _skills_index))
