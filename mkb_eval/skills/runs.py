"""Run folders: their attempt records, trial folders, and the skills their solo attempts wrote.

What a run folder must hold (the agent's ``RunStore`` writes exactly this, plus more):

    <run>/attempts.jsonl            attempt records (``mkb_eval.metrics.inputs`` format)
    <run>/trials/<trial>/           one folder per trial (trial = p<NN>_r<k>_<arm>)
        SKILL.md                    the skill this trial wrote
        kernel.py                   its final kernel

Folders written by other tools are found too: a record may name its folder with ``trial_dir``
(relative to the run), and otherwise any folder whose name ends with the trial coordinate
counts (``archive/`` is skipped: it holds superseded artifacts); two such folders for one
coordinate are an error. Inside a trial folder the shallowest ``SKILL.md``/``kernel.py`` wins.
The latest record per (model, trial) counts, as in the metrics. When a record carries
``skill_md_sha256`` or ``final_kernel_sha256`` (the agent's extras), the files must still match
them (the store writes SKILL.md as the hashed text plus a newline): a file changed after its
record is refused rather than released.

Attempt records are read with the metrics' reader (:mod:`mkb_eval.metrics.inputs`), which checks
only the fields a skill and its outcome need and reads every attempt-record version, not with the
strict :func:`mkb_eval.attempt_record.parse`: run folders written by other tools or older loops
(with fewer fields) are released too. The outcome built from them is strict
(:class:`mkb_eval.skill_record.SkillOutcome`).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval.metrics.inputs import (
    ARMS,
    AttemptOutcome,
    InputError,
    SchemaVersionError,
    outcome_from_dict,
    record_version,
    trial_name,
)
from mkb_eval.metrics.paired import paired_outcome
from mkb_eval.skills.model import Outcome, Skill, SkillError, direction_from

ATTEMPTS_FILE = "attempts.jsonl"
TRIALS = "trials"
ARCHIVE = "archive"
_DIR_RE = re.compile(r"(?:^|[_-])(p\d+_r\d+_(?:" + "|".join(ARMS) + r"))$")


@dataclass(frozen=True)
class RunAttempt:
    """The latest record of one (model, trial): raw JSON, parsed outcome, and its trial files."""

    raw: dict[str, Any]
    outcome: AttemptOutcome
    where: str
    trial_dir: Path | None
    kernel: Path | None
    skill: Path | None


@dataclass(frozen=True)
class Run:
    """One run folder, read."""

    name: str
    path: Path
    attempts: tuple[RunAttempt, ...]
    warnings: tuple[str, ...]

    def find(self, model: str, trial: str) -> RunAttempt | None:
        for a in self.attempts:
            if a.outcome.model == model and a.outcome.trial == trial:
                return a
        return None


def _shallowest(folder: Path, name: str) -> Path | None:
    found = sorted(folder.rglob(name), key=lambda p: (len(p.relative_to(folder).parts), str(p)))
    found = [p for p in found if p.is_file()]
    if len(found) > 1 and len(found[0].relative_to(folder).parts) == len(found[1].relative_to(folder).parts):
        raise SkillError(f"{folder}: two {name} files at the same depth ({found[0].relative_to(folder)}, "
                         f"{found[1].relative_to(folder)}); keep one")
    return found[0] if found else None


def trial_folders(run: Path) -> dict[str, list[Path]]:
    """Trial coordinate -> folders under ``run`` whose name ends with it (``archive/`` left out)."""
    out: dict[str, list[Path]] = {}
    for d in sorted(p for p in run.rglob("*") if p.is_dir()):
        rel = d.relative_to(run).parts
        if rel[0] == ARCHIVE or any(_DIR_RE.search(part) for part in rel[:-1]):
            continue
        m = _DIR_RE.search(d.name)
        if m:
            out.setdefault(m.group(1), []).append(d)
    return out


def _trial_dir(run: Path, raw: Mapping[str, Any], trial: str, folders: dict[str, list[Path]],
               where: str) -> Path | None:
    rel = raw.get("trial_dir")
    if rel is not None:
        d = (run / str(rel)).resolve()
        if run.resolve() not in d.parents or not d.is_dir():
            raise SkillError(f"{where}: trial_dir {rel!r} is not a folder inside {run}")
        return d
    canonical = run / TRIALS / trial
    if canonical.is_dir():
        return canonical
    dirs = folders.get(trial, [])
    if len(dirs) > 1:
        names = ", ".join(str(d.relative_to(run)) for d in dirs)
        raise SkillError(f"{where}: trial {trial} has {len(dirs)} folders ({names}); give each record a trial_dir")
    return dirs[0] if dirs else None


def _check_recorded_hash(raw: Mapping[str, Any], key: str, path: Path | None, where: str) -> None:
    """The file must still be what the record hashed (the store writes SKILL.md with one added newline)."""
    want = raw.get(key)
    if not isinstance(want, str) or path is None:
        return
    text = path.read_bytes().decode("utf-8", errors="replace")
    candidates = [text] + ([text[:-1]] if text.endswith("\n") else [])
    digests = [hashlib.sha256(t.encode()).hexdigest() for t in candidates]
    if want not in digests:
        have = digests[0]
        raise SkillError(f"{where}: {path.name} of trial {raw.get('trial')} has sha256 {have[:12]}... but its "
                         f"record says {key} {want[:12]}... (changed after the attempt?)")


def read_run(path: str | Path, *, strict: bool = True) -> Run:
    """Read a run folder. ``strict``: an unreadable or invalid record raises instead of being skipped."""
    run = Path(path)
    file = run / ATTEMPTS_FILE
    if not file.is_file():
        raise SkillError(f"{run}: not a run folder (no {ATTEMPTS_FILE})")
    notes: list[str] = []
    latest: dict[tuple[str, str], tuple[dict[str, Any], AttemptOutcome, str]] = {}
    with file.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{file}:{n}"
            try:
                raw = json.loads(line)
                if not isinstance(raw, dict):
                    raise InputError(f"{where}: a record must be a JSON object")
                record_version(raw, where)
                if raw.get("kind", "attempt") != "attempt":
                    continue
                o = outcome_from_dict(raw, where)
            except SchemaVersionError:
                raise
            except (json.JSONDecodeError, InputError) as e:
                msg = f"{where}: malformed JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
                if strict:
                    raise SkillError(msg) from None
                notes.append(msg + "; record skipped")
                continue
            latest.pop((o.model, o.trial), None)
            latest[(o.model, o.trial)] = (raw, o, where)
    folders = trial_folders(run)
    attempts = []
    for raw, o, where in sorted(latest.values(), key=lambda t: (t[1].model, t[1].problem_id, t[1].replicate, t[1].arm)):
        d = _trial_dir(run, raw, o.trial, folders, where)
        kernel = _shallowest(d, "kernel.py") if d else None
        skill = _shallowest(d, "SKILL.md") if d else None
        _check_recorded_hash(raw, "skill_md_sha256", skill, where)
        _check_recorded_hash(raw, "final_kernel_sha256", kernel, where)
        attempts.append(RunAttempt(raw=raw, outcome=o, where=where, trial_dir=d, kernel=kernel, skill=skill))
    for msg in notes:
        warnings.warn(msg, stacklevel=2)
    return Run(name=run.resolve().name, path=run, attempts=tuple(attempts), warnings=tuple(notes))


def _speedup(o: AttemptOutcome) -> float | None:
    return o.speedup if o.passed else None


def skill_outcome(run: Run, source: AttemptOutcome, direction: str) -> Outcome:
    """Outcome of the skill attempt fed by ``source`` against the same replicate's base attempt."""
    target = direction.split("2")[1]
    skill_trial = trial_name(source.problem_id, source.replicate, f"{direction}_skill")
    skill = run.find(source.model, skill_trial)
    base = run.find(source.model, trial_name(source.problem_id, source.replicate, f"solo_{target}"))
    resolved = not (skill is None or base is None or skill.outcome.error or base.outcome.error)
    return Outcome.model_validate({           # validated: an unknown status or verdict fails here, not in a release
        "verdict": paired_outcome(base.outcome, skill.outcome) if resolved and skill and base else "unresolved",
        "skill_trial": skill_trial, "skill_status": skill.outcome.status if skill else None,
        "skill_speedup": _speedup(skill.outcome) if skill else None,
        "base_status": base.outcome.status if base else None, "base_speedup": _speedup(base.outcome) if base else None,
    })


def run_skills(run: Run) -> list[Skill]:
    """Skills written by the run's solo attempts (blank SKILL.md files are not skills).

    A skill-conditioned attempt also writes a SKILL.md, but it is never transferred, so it is
    not a skill of the corpus.
    """
    out = []
    for a in run.attempts:
        o = a.outcome
        if not o.arm.startswith("solo_") or a.skill is None:
            continue
        text = a.skill.read_bytes().decode("utf-8")
        if not text.strip():
            continue
        direction = direction_from(o.dsl)
        out.append(Skill(
            origin=f"run:{run.name}/{o.model}/{o.trial}", model=o.model, problem_id=o.problem_id,
            direction=direction, source_verdict=o.status, text=text, replicate=o.replicate,
            source_trial=o.trial, source_speedup=_speedup(o), outcome=skill_outcome(run, o, direction),
            path=a.skill,
        ))
    return out
