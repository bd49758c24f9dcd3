"""Reading the MetaKernelBench Hugging Face dataset: a local/packaged folder or the Hub at a revision.

The dataset is a folder of parquet files whose configs are declared in the YAML front matter of
its ``README.md`` (datasets 5.x has no loading scripts). Where a copy comes from, in order:

1. ``path=`` given to :func:`load_dataset` (a folder built by ``mkb dataset build``);
2. the environment variable ``MKB_DATASET_DIR``;
3. the packaged copy ``mkb_eval/data/metakernelbench/`` (present in a wheel built after
   ``mkb dataset build --out mkb_eval/data/metakernelbench``; absent in a source checkout);
4. with ``revision=``: the Hub repo (``repo_id=``, else ``MKB_DATASET_REPO``, else
   :data:`DEFAULT_REPO`) fetched with ``huggingface_hub.snapshot_download``, which also resolves
   from the local Hub cache when ``HF_HUB_OFFLINE=1``; the snapshot is then read like a folder.

Every route checks the folder first (card YAML, config names, files the configs point to,
parquet footers), so a truncated file or a card pointing nowhere fails with one line naming
the file instead of a deep ``datasets`` traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkb_eval.frontmatter import split_front_matter

DEFAULT_REPO = "MetaKernelBench/metakernelbench"
"""Hub dataset id used when neither ``repo_id`` nor ``MKB_DATASET_REPO`` is given."""
PACKAGED_DIR = Path(__file__).resolve().parent / "data" / "metakernelbench"
LOCAL_ENV = "MKB_DATASET_DIR"
REPO_ENV = "MKB_DATASET_REPO"
MANIFEST = "manifest.json"


class DatasetError(ValueError):
    """A dataset folder or Hub snapshot cannot be read; the message names the file and the problem."""


@dataclass(frozen=True)
class FolderInfo:
    """What a checked folder holds: version, and per config its split and the files it points to."""

    path: Path
    dataset_version: str | None
    configs: dict[str, dict[str, list[Path]]]
    default_config: str | None


def read_card_yaml(folder: str | Path) -> dict[str, Any]:
    """The YAML front matter of ``<folder>/README.md`` as a mapping."""
    card = Path(folder) / "README.md"
    if not card.is_file():
        raise DatasetError(f"{card}: missing dataset card (README.md with a YAML 'configs:' block)")
    meta, _ = split_front_matter(card.read_text(encoding="utf-8"), str(card), DatasetError)
    return meta


def _data_file_patterns(card: Path, entry: Any) -> list[tuple[str, list[str]]]:
    name = entry.get("config_name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name:
        raise DatasetError(f"{card}: every 'configs:' entry needs a config_name")
    files = entry.get("data_files")
    if isinstance(files, str):
        files = [{"split": "train", "path": files}]
    if not isinstance(files, list) or not files:
        raise DatasetError(f"{card}: config '{name}' has no data_files")
    out = []
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("split"), str) or "path" not in f:
            raise DatasetError(f"{card}: config '{name}': each data_files entry needs 'split' and 'path'")
        paths = f["path"] if isinstance(f["path"], list) else [f["path"]]
        if not all(isinstance(p, str) and p for p in paths):
            raise DatasetError(f"{card}: config '{name}' split '{f['split']}': path must be a string or a list "
                               "of strings")
        out.append((f["split"], paths))
    return out


def _check_parquet(path: Path) -> None:
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatasetError(f"{path}: not a readable parquet file (truncated or corrupt: {reason})") from None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_folder(folder: str | Path, *, verify_hashes: bool = False) -> FolderInfo:
    """Check a dataset folder; return its configs and files, or raise DatasetError naming the fault.

    Checks the card YAML, that each config's ``data_files`` match at least one file inside the
    folder, that each parquet file has a readable footer, and (``verify_hashes``) that every file
    still has the sha256 that ``manifest.json`` recorded at build time.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: not a dataset folder (no such directory)")
    card = folder / "README.md"
    meta = read_card_yaml(folder)
    entries = meta.get("configs")
    if not isinstance(entries, list) or not entries:
        raise DatasetError(f"{card}: the YAML has no 'configs:' list")
    configs: dict[str, dict[str, list[Path]]] = {}
    default = None
    root = os.path.normpath(folder)
    for entry in entries:
        splits = {split: _split_files(card, folder, root, entry, split, patterns)
                  for split, patterns in _data_file_patterns(card, entry)}
        name = entry["config_name"]
        if name in configs:
            raise DatasetError(f"{card}: config '{name}' is declared twice")
        configs[name] = splits
        if entry.get("default"):
            default = name
    for splits in configs.values():
        for files in splits.values():
            for f in files:
                if f.suffix == ".parquet":
                    _check_parquet(f)
    version = meta.get("dataset_version")
    manifest_path = folder / MANIFEST
    if verify_hashes:
        if not manifest_path.is_file():
            raise DatasetError(f"{manifest_path}: missing; cannot verify file hashes")
        _verify_manifest(folder, card, version)
    return FolderInfo(path=folder, dataset_version=str(version) if version is not None else None,
                      configs=configs, default_config=default)


def _split_files(card: Path, folder: Path, root: str, entry: dict[str, Any], split: str,
                 patterns: list[str]) -> list[Path]:
    """The files one config split's patterns match: each pattern at least one, all inside the folder."""
    files: list[Path] = []
    for pattern in patterns:
        if Path(pattern).is_absolute():
            raise DatasetError(f"{card}: config '{entry['config_name']}' uses an absolute path '{pattern}'")
        matched = sorted(p for p in folder.glob(pattern) if p.is_file())
        if not matched:
            raise DatasetError(f"{card}: config '{entry['config_name']}' split '{split}' points to "
                               f"'{pattern}', which matches no file in {folder}")
        for p in matched:       # lexical check: Hub snapshots hold symlinks into the blob store
            if not os.path.normpath(p).startswith(root + os.sep):
                raise DatasetError(f"{card}: config '{entry['config_name']}' points outside the folder: {p}")
        files.extend(matched)
    return files


def _verify_manifest(folder: Path, card: Path, version: Any) -> None:
    """Every file the manifest lists is there with its recorded sha256, and the versions agree."""
    manifest = read_manifest(folder)
    for cfg in manifest.get("configs", {}).values():
        for rel, digest in cfg.get("files", {}).items():
            p = folder / rel
            if not p.is_file():
                raise DatasetError(f"{p}: listed in {MANIFEST} but missing")
            if sha256_file(p) != digest:
                raise DatasetError(f"{p}: sha256 differs from {MANIFEST} (file changed since the build)")
    if version is not None and manifest.get("dataset_version") != version:
        raise DatasetError(f"{card}: dataset_version {version} but {MANIFEST} says "
                           f"{manifest.get('dataset_version')}")


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The build manifest (versions, per-problem fingerprints, file hashes, changelog) of a folder."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DatasetError(f"{path}: missing (not a folder written by `mkb dataset build`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise DatasetError(f"{path}: top level must be an object")
    return data


def local_folder(path: str | Path | None = None) -> Path:
    """The local copy to read: ``path``, else ``$MKB_DATASET_DIR``, else the packaged copy."""
    if path is not None:
        return Path(path)
    env = os.environ.get(LOCAL_ENV)
    if env:
        return Path(env)
    if (PACKAGED_DIR / "README.md").is_file():
        return PACKAGED_DIR
    raise DatasetError(
        f"no local MetaKernelBench dataset: pass path=, set {LOCAL_ENV}, build the packaged copy with "
        f"`mkb dataset build --out {PACKAGED_DIR} --version X.Y.Z`, or give revision= to read the Hub")


def hub_snapshot(revision: str, repo_id: str | None = None) -> Path:
    """Download (or find in the Hub cache, offline) the dataset repo at ``revision``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = repo_id or os.environ.get(REPO_ENV) or DEFAULT_REPO
    if "/" not in repo:
        raise DatasetError(f"Hub dataset id '{repo}' needs a namespace: '<org>/{repo}'")
    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=revision))
    except RevisionNotFoundError:
        raise DatasetError(f"{repo}: no revision '{revision}' on the Hub") from None
    except RepositoryNotFoundError:
        raise DatasetError(f"{repo}: no such dataset repo on the Hub (or no access)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise DatasetError(f"{repo}@{revision}: not in the local Hub cache and the Hub is unreachable "
                           f"({type(e).__name__})") from None


def load_dataset(config: str = "problems", revision: str | None = None, split: str | None = None, *,
                 path: str | Path | None = None, repo_id: str | None = None, **kwargs: Any) -> Any:
    """Load one config of MetaKernelBench as a ``datasets`` Dataset (``split``) or DatasetDict.

    ``revision`` (a tag such as ``v1.0.0``, a branch or a commit) selects the Hub copy; without it
    a local copy is read (see the module docstring for the order). Extra keyword arguments go to
    ``datasets.load_dataset``.
    """
    import datasets

    if revision is not None and path is not None:
        raise DatasetError("revision= selects a Hub snapshot; it cannot be combined with path=")
    folder = hub_snapshot(revision, repo_id) if revision is not None else local_folder(path)
    info = check_folder(folder)
    if config not in info.configs:
        empty = _empty_configs(folder)
        why = " (it has no rows in this version)" if config in empty else ""
        raise DatasetError(f"{folder}: no config '{config}'{why}; configs: {', '.join(info.configs)}")
    if split is not None and split not in info.configs[config]:
        raise DatasetError(f"{folder}: config '{config}' has no split '{split}'; "
                           f"splits: {', '.join(info.configs[config])}")
    return datasets.load_dataset(str(folder), config, split=split, **kwargs)


def _empty_configs(folder: Path) -> list[str]:
    try:
        return list(read_manifest(folder).get("empty_configs", []))
    except DatasetError:
        return []


def decode_tensor(entry: Mapping[str, Any]) -> Any:
    """One stored tensor of ``reference_outputs`` as a CPU ``torch.Tensor``.

    Stored as ``dtype`` (torch name without ``torch.``), ``shape`` and ``data``: the C-contiguous
    little-endian bytes of the tensor, so bf16 and fp8 need no numpy equivalent.
    """
    import torch

    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise DatasetError(f"unknown tensor dtype {entry['dtype']!r}")
    shape = [int(s) for s in entry["shape"]]
    data = bytes(entry["data"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    if len(data) != n * itemsize:
        raise DatasetError(f"tensor {entry.get('path', '')}: {len(data)} bytes for shape {shape} of {entry['dtype']}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).clone()
