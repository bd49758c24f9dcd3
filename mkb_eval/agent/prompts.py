"""Prompts as versioned data: the files under ``prompts/``, their versions and recorded hashes.

Every text the model sees comes from a file here (task, DSL cards, SKILL.md rules, feedback,
correction, skill header). Each file carries a ``version`` in its front matter, and
``prompts/manifest.yaml`` records the version and sha256 of every file plus a version for the
whole set, so a run can tell that a prompt changed (a changed prompt makes its trials stale) and a
test catches an edit that forgot to bump the version.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from mkb_eval.dsl import SPECS
from mkb_eval.frontmatter import split_front_matter

from mkb_eval import problems as P

DSL_DISPLAY = {name: s.display for name, s in SPECS.items()}
KERNEL_BYTE_LIMIT = 300_000
_FILES = {
    "task": "task.md",
    "skill_instructions": "skill_instructions.md",
    "skill_header": "skill_header.md",
    "feedback": "feedback.md",
    "correction": "correction.md",
    **{f"card_{name}": s.card for name, s in SPECS.items()},     # each DSL's card (its spec names the file)
}


class PromptError(ValueError):
    """A prompt file is malformed or disagrees with the manifest; the message names the file."""


@dataclass(frozen=True)
class PromptFile:
    """One prompt file: its body (front matter removed), version and the sha256 of the whole file."""

    name: str
    path: str
    version: int
    sha256: str
    body: str


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt: the text, its sha256, the prompt-set version and the parts it came from."""

    text: str
    sha256: str
    version: str
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read(rel: str) -> str:
    node = resources.files("mkb_eval.agent").joinpath("prompts")
    for part in rel.split("/"):
        node = node.joinpath(part)
    return node.read_text(encoding="utf-8")


def parse_prompt_file(name: str, rel: str, raw: str) -> PromptFile:
    """Split front matter from body; the front matter must name the file and give an int version."""
    meta, body = split_front_matter(raw, f"prompts/{rel}", PromptError)
    if meta.get("name") != name:
        raise PromptError(f"prompts/{rel}: front matter must say name: {name}")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise PromptError(f"prompts/{rel}: version must be a positive integer, got {version!r}")
    return PromptFile(name=name, path=rel, version=version, sha256=_sha(raw), body=body)


@lru_cache(maxsize=None)
def load(name: str) -> PromptFile:
    """One prompt file by name (see ``_FILES``)."""
    if name not in _FILES:
        raise PromptError(f"unknown prompt {name!r}; known: {', '.join(sorted(_FILES))}")
    return parse_prompt_file(name, _FILES[name], _read(_FILES[name]))


@lru_cache(maxsize=1)
def manifest() -> dict[str, Any]:
    """The recorded manifest: ``{"version": str, "files": {name: {"version", "sha256"}}}``."""
    data = yaml.safe_load(_read("manifest.yaml"))
    if not isinstance(data, dict) or not isinstance(data.get("version"), str) or not isinstance(data.get("files"), dict):
        raise PromptError("prompts/manifest.yaml: needs a string 'version' and a 'files' mapping")
    return data


def current_manifest(set_version: str) -> dict[str, Any]:
    """What the manifest should say for the files as they are now (used to regenerate it)."""
    return {"version": set_version,
            "files": {n: {"version": load(n).version, "sha256": load(n).sha256} for n in sorted(_FILES)}}


def check_manifest() -> list[str]:
    """Disagreements between the files and the recorded manifest (empty when consistent)."""
    rec = manifest()["files"]
    problems = []
    for n in sorted(set(_FILES) | set(rec)):
        if n not in _FILES:
            problems.append(f"manifest lists {n!r}, which is not a prompt file")
            continue
        if n not in rec:
            problems.append(f"prompts/{_FILES[n]} is missing from the manifest")
            continue
        f = load(n)
        if rec[n].get("sha256") != f.sha256:
            problems.append(f"prompts/{_FILES[n]} changed (sha256 {f.sha256[:12]}, manifest says "
                            f"{str(rec[n].get('sha256'))[:12]}): bump its version and record the new hash")
        if rec[n].get("version") != f.version:
            problems.append(f"prompts/{_FILES[n]} has version {f.version}, manifest says {rec[n].get('version')}")
    return problems


def set_version() -> str:
    return str(manifest()["version"])


def prompt_set() -> dict[str, dict[str, Any]]:
    """Version and sha256 of every prompt file, as recorded with each trial."""
    return {n: {"version": load(n).version, "sha256": load(n).sha256} for n in sorted(_FILES)}


def prompt_set_sha256() -> str:
    """One hash over all prompt files: any edit to any of them changes it."""
    return _sha(json.dumps(prompt_set(), sort_keys=True))


def fill(name: str, **values: Any) -> str:
    """Substitute ``$name`` placeholders of a prompt file; a missing value raises PromptError."""
    try:
        return string.Template(load(name).body).substitute({k: str(v) for k, v in values.items()})
    except KeyError as e:
        raise PromptError(f"prompts/{_FILES[name]}: no value for placeholder {e}") from None
    except ValueError as e:
        raise PromptError(f"prompts/{_FILES[name]}: {e}") from None


@dataclass(frozen=True)
class TaskSettings:
    """The budget numbers printed in the task prompt (defaults = the protocol's defaults)."""

    n_submissions: int = 10
    max_tokens_per_turn: int = 8192
    max_total_tokens: int = 131072
    wall_minutes: float = 40.0
    tier: str = "gpu"


_TIER_NOTE = {
    "gpu": "Each submission is compiled, checked and timed on the H200 itself.",
    "cpu": ("This run has no GPU: each submission is checked statically and compiled for sm_90a, and the "
            "reference is run at a small size on the CPU; correctness and speed are reported as unverified."),
}


def render_task(problem: P.Problem, dsl: str, settings: TaskSettings | None = None) -> RenderedPrompt:
    """The first user message of an attempt at ``problem`` in ``dsl`` (the same for solo and skill arms)."""
    if dsl not in DSL_DISPLAY:
        raise PromptError(f"unknown DSL {dsl!r}; expected one of {', '.join(DSL_DISPLAY)}")
    s = settings or TaskSettings()
    text = fill(
        "task",
        dsl_display=DSL_DISPLAY[dsl],
        task_name=f"{problem.name}_{dsl}",
        description=problem.description.strip(),
        reference_source=problem.reference_source.rstrip(),
        kernel_byte_limit=KERNEL_BYTE_LIMIT,
        tier_note=_TIER_NOTE.get(s.tier, _TIER_NOTE["gpu"]),
        n_submissions=s.n_submissions,
        max_tokens_per_turn=s.max_tokens_per_turn,
        max_total_tokens=s.max_total_tokens,
        wall_minutes=f"{s.wall_minutes:g}",
        skill_instructions=load("skill_instructions").body.strip(),
        dsl_card=load(f"card_{dsl}").body.strip(),
    ).strip() + "\n"
    used = ("task", "skill_instructions", f"card_{dsl}")
    parts = {n: {"version": load(n).version, "sha256": load(n).sha256} for n in used}
    return RenderedPrompt(text=text, sha256=_sha(text), version=set_version(), parts=parts)


def skill_attachment(body: str) -> str:
    """The text a skill arm receives: the fixed header, then the source's SKILL.md."""
    return load("skill_header").body + body.strip() + "\n"


def render_skill_task(task: RenderedPrompt, skill_body: str) -> RenderedPrompt:
    """The skill arm's first message: the base task followed by the attached skill (the only difference)."""
    text = task.text + "\n" + skill_attachment(skill_body)
    parts = dict(task.parts)
    parts["skill_header"] = {"version": load("skill_header").version, "sha256": load("skill_header").sha256}
    return RenderedPrompt(text=text, sha256=_sha(text), version=task.version, parts=parts)


if __name__ == "__main__":
    import sys

    print(yaml.safe_dump(current_manifest(sys.argv[1] if len(sys.argv) > 1 else set_version()), sort_keys=True), end="")
