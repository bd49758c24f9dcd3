"""The released skills corpus: markdown files with YAML front matter, read, validated, written.

A released skill file is ``---`` + front matter + ``---`` + the skill text exactly as the
attempt wrote it. The front matter (:class:`mkb_eval.skill_record.SkillFrontMatter`, schema
``skills_corpus/schema/skill.schema.json`` generated from it) names the model, problem, direction,
source verdict, the sha256 of the text, and the dataset version it was released in; an edited
text no longer matches its sha256 and is refused. The other schemas of ``skills_corpus/schema``
(the SFT and DPO export lines) are written by hand and read by :func:`schema_errors`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from mkb_eval.frontmatter import split_front_matter as _split
from mkb_eval.skill_record import SkillFrontMatter, parse_front_matter
from mkb_eval.skills.model import Skill, SkillError, sha256_text

_REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS_ROOT = _REPO_ROOT / "skills_corpus"
SCHEMA_DIR = CORPUS_ROOT / "schema"
SKIPPED_NAMES = ("README.md",)


@cache
def schema(name: str) -> dict[str, Any]:
    """A JSON schema of ``skills_corpus/schema/<name>.schema.json``."""
    path = SCHEMA_DIR / f"{name}.schema.json"
    if not path.is_file():
        raise SkillError(f"{path}: schema not found")
    loaded: dict[str, Any] = json.loads(path.read_bytes().decode("utf-8"))
    return loaded


def schema_errors(instance: Any, name: str) -> list[str]:
    """Messages for every way ``instance`` violates schema ``name`` (empty when it is valid)."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema(name))
    out = []
    for err in sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path]):
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{where}: {err.message}")
    return out


def split_front_matter(text: str, where: str) -> tuple[dict[str, Any], str]:
    """(front matter, body) of a released skill file."""
    return _split(text, where, SkillError)


def parse_skill_file(path: Path, corpus: Path) -> Skill:
    """Read and validate one released skill file (SkillError naming the file and every bad field)."""
    rel = path.relative_to(corpus).as_posix()
    meta, body = split_front_matter(path.read_bytes().decode("utf-8"), str(path))
    try:
        fm = parse_front_matter(meta, str(path))
    except ValueError as e:
        raise SkillError(str(e)) from None
    skill = Skill(
        origin=f"corpus:{rel}", model=fm.model, problem_id=fm.problem, direction=fm.direction,
        source_verdict=fm.source_verdict, text=body, replicate=fm.replicate, source_trial=fm.source_trial,
        source_speedup=fm.source_speedup, outcome=fm.outcome, released_in=fm.dataset_version, path=path,
    )
    if skill.sha256 != fm.sha256:
        raise SkillError(f"{path}: the text's sha256 {skill.sha256[:12]}... differs from the front matter's "
                         f"{fm.sha256[:12]}... (edited after release?)")
    return skill


def seal_file(path: Path) -> str:
    """Set the front matter's sha256 to the text's (after the maintainers edit a skill); returns it."""
    raw = path.read_bytes().decode("utf-8")
    _, body = split_front_matter(raw, str(path))
    digest = sha256_text(body)
    head, n = re.subn(r"(?m)^sha256:.*$", f"sha256: {digest}", raw[: len(raw) - len(body)], count=1)
    if n != 1:
        raise SkillError(f"{path}: no 'sha256:' line in the front matter")
    path.write_bytes((head + body).encode("utf-8"))
    return digest


def corpus_files(corpus: Path) -> list[Path]:
    """Released skill files under ``corpus`` (every *.md except READMEs and the schema folder)."""
    return sorted(p for p in corpus.rglob("*.md")
                  if p.name not in SKIPPED_NAMES and "schema" not in p.relative_to(corpus).parts[:1])


def read_corpus(corpus: str | Path | None = None) -> list[Skill]:
    """Every released skill, ordered by path; one SkillError lists every bad file."""
    root = Path(corpus) if corpus is not None else CORPUS_ROOT
    if not root.is_dir():
        raise SkillError(f"{root}: skills corpus folder not found")
    skills, errors = [], []
    for path in corpus_files(root):
        try:
            skills.append(parse_skill_file(path, root))
        except SkillError as e:
            errors.append(str(e))
    if errors:
        raise SkillError("\n".join(errors))
    return skills


def front_matter(skill: Skill, dataset_version: str) -> dict[str, Any]:
    """The front matter a skill is released with (None fields left out); SkillError when it is not valid."""
    from pydantic import ValidationError

    from mkb_eval.records import validation_errors

    try:
        fm = SkillFrontMatter.model_validate({
            "model": skill.model, "problem": skill.problem_id, "direction": skill.direction,
            "source_verdict": skill.source_verdict, "sha256": skill.sha256, "dataset_version": dataset_version,
            "replicate": skill.replicate, "source_trial": skill.source_trial, "source_speedup": skill.source_speedup,
            "provenance": skill.origin, "outcome": skill.outcome})
    except ValidationError as e:
        raise SkillError(f"{skill.origin}: cannot release: {validation_errors(e)}") from None
    return fm.to_json()


def render_release(skill: Skill, dataset_version: str) -> str:
    """The released markdown file of a skill; refuses front matter the model does not accept."""
    meta = front_matter(skill, dataset_version)
    front = str(yaml.safe_dump(meta, sort_keys=False, allow_unicode=True))
    return "---\n" + front + "---\n" + skill.text


def release_name(skill: Skill) -> str:
    """File name of a released skill: ``p<NN>_<direction>_<model>_r<k>.md``."""
    model = re.sub(r"[^0-9A-Za-z._-]", "-", skill.model)
    return f"p{skill.problem_id:02d}_{skill.direction}_{model}_r{skill.replicate or 1}.md"


def write_release(skills: Iterable[Skill], dest: Path, dataset_version: str) -> list[Path]:
    """Write released skill files into ``dest``; refuses to overwrite a file with different content."""
    skills = list(skills)
    names = [release_name(s) for s in skills]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SkillError(f"two skills would be released as {dupes[0]}")
    rendered = [(dest / n, render_release(s, dataset_version)) for s, n in zip(skills, names, strict=True)]
    for path, text in rendered:
        if path.exists() and path.read_bytes() != text.encode("utf-8"):
            raise SkillError(f"{path}: exists with different content; not overwritten")
    dest.mkdir(parents=True, exist_ok=True)
    for path, text in rendered:
        path.write_bytes(text.encode("utf-8"))
    return [p for p, _ in rendered]
