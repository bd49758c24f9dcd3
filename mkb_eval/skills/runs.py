"""Run folders: their attempt records, trial folders, and the skills their solo attempts wrote.

What a run folder must hold (the agent's ``RunStore`` writes exactly this, plus more):

    <run>/attempts.jsonl            attempt records (:class:`mkb_eval.attempt_record.AttemptRecord`)
    <run>/trials/<trial>/           one folder per trial (trial = p<NN>_r<k>_<arm>)
        SKILL.md                    the skill this trial wrote
        kernel.py                   its final kernel

A trial's folder is ``trials/<trial>``; failing that, any folder whose name ends with the trial
coordinate counts (``archive/`` is skipped: it holds superseded artifacts); two such folders for one
coordinate are an error. Inside a trial folder the shallowest ``SKILL.md``/``kernel.py`` wins.
The latest record per (model, trial) counts, as in the metrics. The files must still match the
record's ``skill_md_sha256`` and ``final_kernel_sha256`` (the store writes SKILL.md as the hashed text
plus a newline): a file changed after its record is refused rather than released.

Every line is read by the attempt record's own reader (:func:`mkb_eval.attempt_record.read_attempts`:
older shapes migrated, then validated strictly), then by the metrics' (:mod:`mkb_eval.metrics.inputs`)
for the outcome; what is released is a valid record. Records of the metrics' subset alone (other tools'
folders, which this reader took before the attempt record was typed, with a ``trial_dir`` key naming
their folder) are refused: a skill is released only with the full record that explains it. The
outcome built from them is strict (:class:`mkb_eval.skill_record.SkillOutcome`).
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval.attempt_record import SCHEMA_VERSION, read_attempts
from mkb_eval.metrics.inputs import ARMS, AttemptOutcome, InputError, SchemaVersionError, outcome_from_dict, trial_name
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


def _trial_dir(run: Path, trial: str, folders: dict[str, list[Path]],
               where: str) -> Path | None:
    canonical = run / TRIALS / trial
    if canonical.is_dir():
        return canonical
    dirs = folders.get(trial, [])
    if len(dirs) > 1:
        names = ", ".join(str(d.relative_to(run)) for d in dirs)
        raise SkillError(f"{where}: trial {trial} has {len(dirs)} folders ({names}); keep one")
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


def _newer(raw: Any) -> bool:
    """A line of a newer attempt-record version: a newer toolkit's run, refused whole rather than skipped."""
    v = raw.get("schema_version") if isinstance(raw, dict) else None
    return isinstance(v, int) and not isinstance(v, bool) and v > SCHEMA_VERSION


def _latest(file: Path, strict: bool, notes: list[str]) -> dict[tuple[str, str], tuple[dict[str, Any], AttemptOutcome, str]]:
    """The latest valid record per (model, trial), each checked by the attempt record's reader and then by
    the metrics'. A bad line raises (``strict``) or is noted and skipped, the trial it names dropped with it:
    an older outcome it supersedes is not released either. A newer schema_version always raises."""
    latest: dict[tuple[str, str], tuple[dict[str, Any], AttemptOutcome, str]] = {}
    for line in read_attempts(file):
        error = line.error
        if line.record is not None:
            raw = line.record.to_json()
            try:
                o = outcome_from_dict(raw, line.where)
            except InputError as e:
                error = str(e)
            else:
                latest.pop((o.model, o.trial), None)
                latest[(o.model, o.trial)] = (raw, o, line.where)
                continue
        elif _newer(line.raw):
            raise SchemaVersionError(f"{error}; upgrade mkb_eval to read this run")
        if strict:
            raise SkillError(str(error))
        for key in [k for k in latest if k[1] == line.trial]:
            del latest[key]
        notes.append(f"{error}; record skipped")
    return latest


def read_run(path: str | Path, *, strict: bool = True) -> Run:
    """Read a run folder. ``strict``: an unreadable or invalid record raises instead of being skipped."""
    run = Path(path)
    file = run / ATTEMPTS_FILE
    if not file.is_file():
        raise SkillError(f"{run}: not a run folder (no {ATTEMPTS_FILE})")
    notes: list[str] = []
    latest = _latest(file, strict, notes)
    folders = trial_folders(run)
    attempts = []
    for raw, o, where in sorted(latest.values(), key=lambda t: (t[1].model, t[1].problem_id, t[1].replicate, t[1].arm)):
        d = _trial_dir(run, o.trial, folders, where)
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
