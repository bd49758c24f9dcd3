"""``mkb skills export|check|seal|index``: the released skills corpus and the skills of run folders.

``register(subparsers)`` adds the command group to the ``mkb`` parser. A library error is one line
on stderr and exit status 2; findings (a leak, a stale index) exit 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkb_eval.skills.model import SkillError

# the dataset's version rule (dataset_builder.versioning), checked here so that mkb_eval never imports the builder
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")


def _guard(prefix: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except SkillError as e:
            lines = str(e).splitlines() or [type(e).__name__]
            print(f"{prefix}: {lines[0]}", file=sys.stderr)
            for line in lines[1:]:
                print(f"  {line}", file=sys.stderr)
            return 2
    return run


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
        if not _SEMVER.match(args.dataset_version.strip()):
            raise SkillError(f"dataset version {args.dataset_version!r} is not semver MAJOR.MINOR.PATCH (e.g. 1.0.0)")
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
    kinds: dict[str, int] = {}
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
    """Add the ``skills`` command group to the ``mkb`` sub-parser action."""
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
