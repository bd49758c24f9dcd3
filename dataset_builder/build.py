"""``build_dataset``: problems, records, reference runs and run folders -> the dataset folder.

Output layout (what is uploaded to the Hub and what ``datasets.load_dataset(folder, config)`` reads):

    <out>/README.md                                   card: YAML configs + prose
    <out>/manifest.json                               version, fingerprints, file hashes, changelog
    <out>/<config>/<split>-00000-of-00001.parquet     one file per config that has rows

A config without rows (e.g. ``attempts`` before any run is released) is left out of the folder
and the card and listed under ``empty_configs`` in the manifest: ``datasets`` cannot load a
split without data, and a placeholder row would be a lie.

The folder is written to a staging folder beside ``out``, checked, and only then moved into
place, so a failed build never leaves a half-written dataset where a good one was. Rows are
in a fixed order, parquet options are fixed, and no build time or machine path is stored, so
two builds of the same inputs are byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataset_builder.card import render_card
from dataset_builder.errors import BuildError
from dataset_builder.features import CONFIG_NAMES, config_specs
from dataset_builder.parquet_io import write_rows
from dataset_builder.sources.problems import problem_rows
from dataset_builder.sources.reference_outputs import PUBLIC_SEEDS, reference_rows
from dataset_builder.sources.runs import attempt_rows, read_runs, skill_rows
from dataset_builder.sources.tasks import task_rows
from dataset_builder.sources.verification import baseline_rows, read_results, solution_rows
from dataset_builder.versioning import changelog, changelog_entry, parse_version, problem_entries
from mkb_eval import problems as P
from mkb_eval.dataset import DEFAULT_REPO, MANIFEST, DatasetError, check_folder, read_manifest, sha256_file
from mkb_eval.skills.corpus import CORPUS_ROOT, read_corpus
from mkb_eval.skills.model import SkillError

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILDER_VERSION = 1


@dataclass(frozen=True)
class BuildOptions:
    """Inputs of one build. Paths default to the toolkit checkout's folders."""

    out: Path
    version: str
    configs: tuple[str, ...] = CONFIG_NAMES
    problems_root: Path | None = None
    problem_ids: tuple[int, ...] | None = None
    results_root: Path = REPO_ROOT / "results"
    runs: tuple[Path, ...] = ()
    skills_corpus: Path | None = CORPUS_ROOT
    previous: Path | None = None
    seeds: tuple[int, ...] = PUBLIC_SEEDS
    hub_repo: str = DEFAULT_REPO


@dataclass(frozen=True)
class BuildResult:
    out: Path
    version: str
    rows: dict[str, int]
    changelog_entry: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)


def _select_configs(names: Sequence[str]) -> list[str]:
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown:
        raise BuildError(f"unknown config(s) {unknown}; configs: {', '.join(CONFIG_NAMES)}")
    if "problems" not in names:
        raise BuildError("the 'problems' config is always built (it carries the licences and fingerprints)")
    return [n for n in CONFIG_NAMES if n in names]


def _problems(opts: BuildOptions) -> list[P.Problem]:
    try:
        probs = P.load_all(opts.problems_root)
    except P.ProblemError as e:
        raise BuildError(f"problem folders do not validate:\n{e}") from None
    if not probs:
        raise BuildError(f"no problems under {P.problems_root(opts.problems_root)}")
    if opts.problem_ids is not None:
        have = {p.id for p in probs}
        missing = sorted(set(opts.problem_ids) - have)
        if missing:
            raise BuildError(f"no problem(s) {missing} under {P.problems_root(opts.problems_root)}")
        probs = [p for p in probs if p.id in set(opts.problem_ids)]
    return probs


def _previous_manifest(opts: BuildOptions) -> dict[str, Any] | None:
    if opts.previous is None:
        return None
    try:
        return read_manifest(opts.previous)
    except DatasetError as e:
        raise BuildError(f"--previous: {e}") from None


Rows = dict[str, list[dict[str, Any]]]


def collect_rows(opts: BuildOptions, names: Sequence[str], probs: Sequence[P.Problem],
                 entries: dict[str, Any]) -> tuple[Rows, dict[str, Any]]:
    """Rows of every selected config (without dataset_version) and the sources they came from."""
    rows: Rows = {}
    sources: dict[str, Any] = {}
    rows["problems"] = problem_rows(probs, entries)
    if "tasks" in names:
        rows["tasks"] = task_rows(probs)
    if "solutions" in names or "baselines" in names:
        results = read_results(opts.results_root)
        sources["results"] = {g.gpu: {"file": f"results/{g.gpu}/{g.path.name}", "sha256": sha256_file(g.path),
                                      "chosen": g.source.get("chosen"), "history_commit": g.source.get("history_commit")}
                              for g in results}
        if "solutions" in names:
            rows["solutions"] = solution_rows(probs, results)
        if "baselines" in names:
            rows["baselines"] = baseline_rows(probs, results)
    if "reference_outputs" in names:
        rows["reference_outputs"] = reference_rows(probs, opts.seeds, opts.problems_root)
        sources["seeds"] = list(opts.seeds)
    if "attempts" in names or "skills" in names:
        runs = read_runs(opts.runs)
        sources["runs"] = {r.name: sha256_file(r.path / "attempts.jsonl") for r in runs}
        if "attempts" in names:
            rows["attempts"] = attempt_rows(runs, probs)
        if "skills" in names:
            corpus = []
            if opts.skills_corpus is not None and opts.skills_corpus.is_dir():
                try:
                    corpus = read_corpus(opts.skills_corpus)
                except SkillError as e:
                    raise BuildError(f"skills corpus: {e}") from None
            sources["skills_corpus"] = len(corpus)
            rows["skills"] = skill_rows(corpus, runs, probs)
    return rows, sources


def _stage_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def _install(stage: Path, out: Path) -> None:
    """Move the staged folder to ``out``, replacing an earlier build there (never anything else)."""
    if out.exists():
        if not out.is_dir():
            raise BuildError(f"{out}: exists and is not a folder")
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise BuildError(f"{out}: not empty and not an earlier build (no {MANIFEST}); refusing to replace it")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old)
    else:
        os.replace(stage, out)


def build_dataset(opts: BuildOptions) -> BuildResult:
    """Build the dataset folder at ``opts.out``; raise BuildError naming the first input at fault."""
    version = parse_version(opts.version)
    names = _select_configs(opts.configs)
    specs = config_specs()
    previous = _previous_manifest(opts)
    probs = _problems(opts)
    out = Path(opts.out)
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise BuildError(f"{out}: not empty and not an earlier build (no {MANIFEST}); refusing to replace it")
    problems_manifest = problem_entries(probs)
    rows, sources = collect_rows(opts, names, probs, problems_manifest)
    for name in names:
        for row in rows[name]:
            row["dataset_version"] = str(version)
    counts = {name: len(rows[name]) for name in names}
    entry = changelog_entry(version, previous, problems_manifest, counts)
    log = changelog(entry, previous)

    written = [n for n in names if counts[n] > 0]
    empty = [n for n in names if counts[n] == 0]
    stage = _stage_dir(out)
    try:
        files: dict[str, str] = {}
        configs_manifest: dict[str, Any] = {}
        for name in written:
            spec = specs[name]
            path = stage / spec.data_file
            write_rows(rows[name], spec, path)
            files[spec.data_file] = sha256_file(path)
            configs_manifest[name] = {"split": spec.split, "rows": counts[name],
                                      "files": {spec.data_file: files[spec.data_file]}}
        card = render_card([specs[n] for n in written], counts, str(version), opts.hub_repo, rows["problems"], log,
                           empty=empty, verification=sources.get("results"))
        (stage / "README.md").write_bytes(card.encode("utf-8"))
        manifest = {
            "dataset_version": str(version), "builder_version": BUILDER_VERSION, "hub_repo": opts.hub_repo,
            "writer": _writer_versions(), "configs": configs_manifest, "empty_configs": empty,
            "problems": problems_manifest,
            "sources": sources, "changelog": log,
        }
        (stage / MANIFEST).write_bytes((json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        try:
            check_folder(stage, verify_hashes=True)
        except DatasetError as e:
            raise BuildError(f"the built folder does not check: {e}") from None
        _install(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return BuildResult(out=out, version=str(version), rows=counts, changelog_entry=entry, files=files)


def _writer_versions() -> dict[str, str]:
    import datasets
    import pyarrow

    return {"pyarrow": pyarrow.__version__, "datasets": datasets.__version__}
