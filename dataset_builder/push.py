"""Push a built dataset folder to the Hub as a tagged release (dry run unless asked).

The plan is always computed and checked first: the folder checks (card, configs, parquet
footers, file hashes against the manifest), the tag is ``v<dataset_version>``, and the repo id
has a namespace. Only with ``push=True`` does anything leave the machine: ``create_repo``
(exist_ok), a refusal if the tag already exists (a release is immutable), ``upload_folder`` of
exactly the planned files (stale parquet files of dropped configs deleted in the same commit),
then ``create_tag`` on that commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataset_builder.errors import BuildError
from dataset_builder.versioning import parse_version
from mkb_eval.dataset import MANIFEST, DatasetError, check_folder, read_manifest

REPO_TYPE = "dataset"
STALE_PATTERNS = ("*/*.parquet",)


@dataclass(frozen=True)
class PushPlan:
    """What a push uploads, and (after a real push) the commit it made."""

    repo_id: str
    tag: str
    folder: Path
    version: str
    files: tuple[str, ...]
    total_bytes: int
    pushed: bool = False
    commit: str | None = None

    def describe(self) -> str:
        verb = "pushed" if self.pushed else "would push (dry run; add --push to upload)"
        head = f"{verb} {self.folder} -> {self.repo_id} ({REPO_TYPE}) tag {self.tag}"
        if self.commit:
            head += f" at commit {self.commit}"
        files = "\n".join(f"  {f}" for f in self.files)
        return f"{head}\n{len(self.files)} files, {self.total_bytes / 1e6:.1f} MB:\n{files}"


def plan_push(folder: str | Path, repo_id: str, tag: str) -> PushPlan:
    """Check the folder, repo id and tag; list the files a push would upload."""
    folder = Path(folder)
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise BuildError(f"repo id {repo_id!r} must be '<org>/<name>' (the Hub needs a namespace)")
    try:
        info = check_folder(folder, verify_hashes=True)
        manifest = read_manifest(folder)
    except DatasetError as e:
        raise BuildError(str(e)) from None
    version = parse_version(str(manifest.get("dataset_version")))
    if info.dataset_version != str(version):
        raise BuildError(f"{folder}/README.md: dataset_version {info.dataset_version} but {MANIFEST} says {version}")
    if tag != version.tag:
        raise BuildError(f"tag {tag!r} does not match the folder's dataset_version {version} (expected {version.tag})")
    files = ["README.md", MANIFEST, *sorted(f for c in manifest["configs"].values() for f in c["files"])]
    total = sum((folder / f).stat().st_size for f in files)
    return PushPlan(repo_id=repo_id, tag=tag, folder=folder, version=str(version), files=tuple(files),
                    total_bytes=total)


def push_dataset(folder: str | Path, repo_id: str, tag: str, *, push: bool = False, token: str | None = None,
                 api: Any = None) -> PushPlan:
    """Plan, and with ``push=True`` upload and tag; returns the plan (with the commit when pushed)."""
    plan = plan_push(folder, repo_id, tag)
    if not push:
        return plan
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = api or HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type=REPO_TYPE, exist_ok=True)
        refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
        if any(t.name == tag for t in refs.tags):
            raise BuildError(f"{repo_id} already has tag {tag}; a release is immutable, bump the version")
        commit = api.upload_folder(repo_id=repo_id, repo_type=REPO_TYPE, folder_path=str(plan.folder),
                                   commit_message=f"Release {tag}",
                                   commit_description=f"MetaKernelBench dataset {plan.version}",
                                   allow_patterns=list(plan.files), delete_patterns=list(STALE_PATTERNS))
        api.create_tag(repo_id, tag=tag, tag_message=f"MetaKernelBench dataset {plan.version}",
                       revision=commit.oid, repo_type=REPO_TYPE, exist_ok=False)
    except OfflineModeIsEnabled:
        raise BuildError("HF_HUB_OFFLINE is set; unset it to push") from None
    except HfHubHTTPError as e:
        raise BuildError(f"the Hub refused the push to {repo_id}: {str(e).splitlines()[0]}") from None
    except ValueError as e:       # huggingface_hub's own refusals, e.g. "Invalid metadata in README.md"
        if isinstance(e, BuildError):
            raise
        raise BuildError(f"the push to {repo_id} failed: {' '.join(str(e).split())}") from None
    return PushPlan(**{**plan.__dict__, "pushed": True, "commit": commit.oid})
