"""The replay backend: answers each task with given kernels and SKILL.md texts, no model.

``mkb run --model replay:<source>`` drives the real attempt loop, parser, verifier and store with
answers taken from a source instead of a model, so a run can be re-scored on new hardware, the
pipeline tested end to end, and an A/A or A/B test made one command. Sources:

- ``replay:solutions``: the shipped solutions (``solutions/<dsl>.py``); SKILL.md is the maintainers'
  skill of the problem where ``skills_corpus/maintainers`` has one for that source DSL, else a short
  fixed note (a skill arm is then run, not skipped).
- ``replay:<folder>`` of kernels: ``<NN>_<dsl>.py`` answers every arm in that DSL;
  ``<NN>_<dsl>.<arm>.py`` overrides it for one arm and ``<NN>_<dsl>.<arm>.r<k>.py`` for one replicate
  of it; ``<NN>_<dsl>.SKILL.md`` (or ``.<arm>.SKILL.md``) is the SKILL.md sent with it.
- ``replay:<run folder>`` (it holds ``attempts.jsonl``): every trial's submissions in their order
  (``trials/<trial>/submissions/NN_kernel.py``) with its last SKILL.md: a released run re-scored.

The backend sees only conversations, like any model. It reads the task (problem and DSL) from the
first message, the arm from whether a skill is attached, the submission from the number of answers
so far, and the replicate from the request's seed (the runner derives it from the run's seed, the
trial id and the turn). Each answer is the ``<kernel.py>`` / ``<SKILL.md>`` blocks the parser expects.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval import problems as P
from mkb_eval.agent.generation import BackendError, Generation, Message, Sampling
from mkb_eval.vocab import DSLS

PREFIX = "replay:"
MAX_REPLICATES = 256
_DSL_RE = "|".join(DSLS)
_TASK = re.compile(rf"This is task `(\d{{2,}})_[a-z0-9_]+?_({_DSL_RE})`")
_FOLDER_FILE = re.compile(rf"^(\d{{2,}})_({_DSL_RE})(?:\.([a-z0-9_]+?))?(?:\.r(\d+))?\.(py|SKILL\.md)$")
_SKILL_ARM = {"tirx": "cutedsl2tirx_skill", "cutedsl": "tirx2cutedsl_skill"}
_SOLO_ARM = {"tirx": "solo_tirx", "cutedsl": "solo_cutedsl"}
_DIRECTION_FROM = {"cutedsl": "cutedsl2tirx", "tirx": "tirx2cutedsl"}
FIXED_SKILL = ("- Replayed answer (no model): the kernel is a given file; this note carries no kernel knowledge.\n"
               "- Skill arms receive it so that they run, as an A/A test needs.")


@dataclass(frozen=True)
class ReplayAnswer:
    """One submission of a replay source: the kernel source and the SKILL.md sent with it."""

    kernel: str
    skill: str | None


def _sha_files(paths: Iterable[Path], base: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(base)).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


class ReplaySource:
    """Where replayed answers come from; ``answers`` gives a trial's submissions in order."""

    kind = "abstract"

    def __init__(self, label: str, sha256: str) -> None:
        self.label, self.sha256 = label, sha256

    def answers(self, problem: P.Problem, arm: str, replicate: int) -> list[ReplayAnswer]:
        raise NotImplementedError

    @property
    def max_submissions(self) -> int:
        """The most submissions any trial of this source makes (the default budget of a replay run)."""
        return 1

    @property
    def replicate_specific(self) -> bool:
        """Whether answers depend on the replicate (then the request seed must identify it)."""
        return False


def _maintainers_skill(problem: P.Problem, dsl: str, root: Path) -> str | None:
    path = root / "skills_corpus" / "maintainers" / f"{problem.name}.{_DIRECTION_FROM[dsl]}.md"
    if not path.is_file():
        return None
    text = path.read_text()
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        text = text[end + 5:] if end >= 0 else text
    return text.strip() or None


class SolutionsSource(ReplaySource):
    """The shipped solutions of the problem set (``root`` is the problems folder)."""

    kind = "solutions"

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else None
        folders = P.discover(root)
        files = [f for d in folders for f in (d / "solutions").glob("*.py")]
        self.repo = Path(P.__file__).resolve().parent.parent
        base = Path(folders[0]).parent.parent if folders else Path(".")
        super().__init__("solutions", _sha_files(files, base))

    def answers(self, problem: P.Problem, arm: str, replicate: int) -> list[ReplayAnswer]:
        from mkb_eval.vocab import ARM_DSL

        dsl = ARM_DSL[arm]
        path = problem.solution_path(dsl)
        if not path.is_file():
            return []
        skill = _maintainers_skill(problem, dsl, self.repo) or FIXED_SKILL
        return [ReplayAnswer(path.read_text(), skill)]


class FolderSource(ReplaySource):
    """A folder of kernels named ``<NN>_<dsl>[.<arm>][.r<k>].py`` with optional SKILL.md files beside them."""

    kind = "folder"

    def __init__(self, folder: Path) -> None:
        from mkb_eval.vocab import ARM_DSL

        self.folder = folder
        self.kernels: dict[tuple[int, str, str | None, int | None], Path] = {}
        self.skills: dict[tuple[int, str, str | None], Path] = {}
        used: list[Path] = []
        for f in sorted(folder.iterdir()):
            m = _FOLDER_FILE.match(f.name)
            if not m or not f.is_file():
                continue
            pid, dsl, arm, rep, ext = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
            if arm is not None and ARM_DSL.get(arm) != dsl:
                raise BackendError(f"replay folder {folder}: {f.name} names arm {arm!r}, which does not run in {dsl}")
            if ext == "py":
                self.kernels[(pid, dsl, arm, int(rep) if rep else None)] = f
            elif rep is None:
                self.skills[(pid, dsl, arm)] = f
            else:
                raise BackendError(f"replay folder {folder}: {f.name}: a SKILL.md is per DSL or arm, not per replicate")
            used.append(f)
        if not self.kernels:
            raise BackendError(f"replay folder {folder} holds no kernels named <NN>_<dsl>.py (e.g. 28_tirx.py)")
        super().__init__(f"folder:{folder.name}", _sha_files(used, folder))

    @property
    def replicate_specific(self) -> bool:
        return any(k[3] is not None for k in self.kernels)

    def answers(self, problem: P.Problem, arm: str, replicate: int) -> list[ReplayAnswer]:
        from mkb_eval.vocab import ARM_DSL

        dsl, pid = ARM_DSL[arm], problem.id
        path = (self.kernels.get((pid, dsl, arm, replicate)) or self.kernels.get((pid, dsl, arm, None))
                or self.kernels.get((pid, dsl, None, None)))
        if path is None:
            return []
        skill_path = self.skills.get((pid, dsl, arm)) or self.skills.get((pid, dsl, None))
        skill = skill_path.read_text().strip() if skill_path else FIXED_SKILL
        return [ReplayAnswer(path.read_text(), skill)]


class RunSource(ReplaySource):
    """A run folder (``attempts.jsonl`` + ``trials/``): each trial's submissions, in their order."""

    kind = "run"

    def __init__(self, folder: Path) -> None:
        import warnings

        from mkb_eval.attempt_record import read_attempts

        self.folder = folder
        self.trials: dict[str, list[Path]] = {}
        self.skill: dict[str, str | None] = {}
        used = [folder / "attempts.jsonl"]
        for line in read_attempts(folder / "attempts.jsonl"):
            if line.record is None:                   # validated like the store's resume: named, never used
                warnings.warn(f"{line.error}; not replayed", stacklevel=2)
                continue
            trial = line.record.trial
            d = folder / "trials" / trial
            subs = sorted((d / "submissions").glob("*_kernel.py")) if d.is_dir() else []
            self.trials[trial] = subs
            skill = d / "SKILL.md"
            self.skill[trial] = skill.read_text().strip() if skill.is_file() else None
            used += subs + ([skill] if skill.is_file() else [])
        if not self.trials:
            raise BackendError(f"replay run {folder}: attempts.jsonl holds no attempt records")
        super().__init__(f"run:{folder.name}", _sha_files(used, folder))

    @property
    def max_submissions(self) -> int:
        return max((len(s) for s in self.trials.values()), default=1) or 1

    @property
    def replicate_specific(self) -> bool:
        return True

    def answers(self, problem: P.Problem, arm: str, replicate: int) -> list[ReplayAnswer]:
        from mkb_eval.vocab import trial_name

        trial = trial_name(problem.id, replicate, arm)
        skill = self.skill.get(trial)
        return [ReplayAnswer(p.read_text(), skill) for p in self.trials.get(trial, [])]


def open_source(text: str, root: str | Path | None = None) -> ReplaySource:
    """``solutions``, a run folder (has attempts.jsonl) or a folder of kernels; a bad one raises BackendError."""
    text = text.strip()
    if text == "solutions":
        return SolutionsSource(root)
    path = Path(text).expanduser()
    if not path.is_dir():
        raise BackendError(f"--model replay:{text}: give replay:solutions, a folder of <NN>_<dsl>.py kernels "
                           f"or a run folder (no folder at {path})")
    if (path / "attempts.jsonl").is_file():
        return RunSource(path.resolve())
    return FolderSource(path.resolve())


def model_name(source: ReplaySource) -> str:
    """The model id a replay run records: ``replay-<label>-<source hash prefix>``."""
    label = re.sub(r"[^0-9A-Za-z._-]", "-", source.label)
    return f"replay-{label}-{source.sha256[:8]}"


def _turn_seed(base: int, trial: str, turn: int) -> int:
    from mkb_eval.agent.loop import _turn_seed as seed_of

    out = seed_of(base, trial, turn)
    assert out is not None
    return out


class ReplayBackend:
    """A Backend whose answers come from a :class:`ReplaySource` (see the module docstring)."""

    max_context: int | None = None

    def __init__(self, source: ReplaySource, *, seed: int | None = 0, root: str | Path | None = None) -> None:
        self.source = source
        self.name = model_name(source)
        self._seed = seed
        self._root = root
        self._problems: dict[int, P.Problem] = {}
        self.unmatched = 0

    def identity(self) -> dict[str, Any]:
        return {"kind": "replay", "model": self.name, "source": self.source.label, "source_kind": self.source.kind,
                "source_sha256": self.source.sha256}

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return None

    def _problem(self, pid: int) -> P.Problem:
        if pid not in self._problems:
            self._problems[pid] = P.find(pid, self._root)
        return self._problems[pid]

    def _replicate(self, arm: str, pid: int, turn: int, sampling: Sampling) -> int:
        if not self.source.replicate_specific or sampling.seed is None or self._seed is None:
            return 1
        from mkb_eval.vocab import trial_name

        for k in range(1, MAX_REPLICATES + 1):
            if _turn_seed(self._seed, trial_name(pid, k, arm), turn) == sampling.seed:
                return k
        self.unmatched += 1
        return 1

    def answer(self, messages: Sequence[Message], sampling: Sampling) -> str:
        """The text for one conversation: its next replayed submission, or a note without blocks."""
        from mkb_eval.agent import prompts

        first = messages[0]["content"] if messages else ""
        m = _TASK.search(first)
        if not m:
            return "(replay: the first message names no task `<NN>_<slug>_<dsl>`; nothing to answer)"
        pid, dsl = int(m.group(1)), m.group(2)
        header = prompts.load("skill_header").body.strip().splitlines()[0]
        arm = _SKILL_ARM[dsl] if header in first else _SOLO_ARM[dsl]
        turn = sum(1 for x in messages if x.get("role") == "assistant")
        try:
            problem = self._problem(pid)
        except P.ProblemError as e:
            return f"(replay: {e})"
        replicate = self._replicate(arm, pid, turn, sampling)
        items = self.source.answers(problem, arm, replicate)
        if turn >= len(items):
            return (f"(replay: {self.source.label} has no submission {turn + 1} for problem {pid:02d}, arm {arm}, "
                    f"replicate {replicate}; it holds {len(items)})")
        item = items[turn]
        out = f"Replayed submission {turn + 1} of {len(items)} from {self.source.label}.\n"
        out += f"<kernel.py>\n{item.kernel.rstrip(chr(10))}\n</kernel.py>\n"
        if item.skill:
            out += f"<SKILL.md>\n{item.skill}\n</SKILL.md>\n"
        return out

    def generate(self, conversations: Sequence[Sequence[Message]], sampling: Sequence[Sampling]) -> list[Generation]:
        return [Generation(text=self.answer(c, s), prompt_tokens=0, completion_tokens=0, finish_reason="stop")
                for c, s in zip(conversations, sampling, strict=True)]

    def close(self) -> None:
        pass

