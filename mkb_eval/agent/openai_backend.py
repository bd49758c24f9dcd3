"""The OpenAI-compatible HTTP backend (:mod:`mkb_eval.agent.backends`): needs no model package in this
process, only a server (``vllm serve``, ``mkb serve``, others)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mkb_eval.agent.generation import BackendError, Generation, Message, Sampling, failed


SEED_ENV = "MKB_OPENAI_SEED"


def _seed_wanted(request_seeds: bool | None) -> bool:
    if request_seeds is not None:
        return request_seeds
    return os.environ.get(SEED_ENV, "").strip().lower() in ("1", "true", "yes")


class OpenAIBackend:
    """Any OpenAI-compatible chat server (``vllm serve``, ``mkb serve``, others), over plain HTTP.

    Requests of one batch are sent concurrently, so a batching server (vLLM) decodes them together.
    Per-request ``seed`` is sent only when asked (``request_seeds=True`` or ``MKB_OPENAI_SEED=1``):
    a vLLM server on a CPU dies on a seeded prompt long enough to be prefilled in chunks, and other
    servers ignore or reject it. A request that fails (HTTP error, timeout, dropped connection)
    becomes that one trial's error; the others of the batch keep their answers. The server's
    version (``GET /version``, vLLM's) is recorded in the identity.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 max_context: int | None = None, concurrency: int = 16, request_seeds: bool | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = model
        self._key = api_key
        self._timeout = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="mkb-openai")
        self.max_context = max_context
        self.request_seeds = _seed_wanted(request_seeds)
        self._server_models = self._probe()
        self.server_version = self._server_version()

    def _request(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None,
                 root: bool = False) -> dict[str, Any]:
        base = self.base_url.removesuffix("/v1") if root else self.base_url
        url = f"{base}{path}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")
        req.add_header("Content-Type", "application/json")
        if self._key:
            req.add_header("Authorization", f"Bearer {self._key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self._timeout) as r:
                return json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
            raise BackendError(f"{url} answered HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise BackendError(f"cannot reach the OpenAI-compatible server at {self.base_url}: {e.reason}") from None
        except (TimeoutError, ConnectionError, OSError) as e:
            raise BackendError(f"cannot reach the OpenAI-compatible server at {self.base_url}: {e}") from None
        except json.JSONDecodeError:
            raise BackendError(f"{url} did not answer with JSON (is this an OpenAI-compatible server?)") from None

    def _probe(self) -> list[str]:
        data = self._request("/models", timeout=min(30.0, self._timeout))
        ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
        if ids and self.name not in ids:
            raise BackendError(f"the server at {self.base_url} does not serve model {self.name!r} (it serves: "
                               f"{', '.join(map(str, ids))})")
        for m in data.get("data", []):
            if isinstance(m, dict) and m.get("id") == self.name and m.get("max_model_len") and not self.max_context:
                self.max_context = int(m["max_model_len"])
        return [str(i) for i in ids]

    def _server_version(self) -> str | None:
        """vLLM's ``GET /version`` (beside ``/v1``); None where the server has none."""
        try:
            v = self._request("/version", timeout=min(10.0, self._timeout), root=True).get("version")
        except (BackendError, AttributeError):
            return None
        return str(v) if v is not None else None

    def identity(self) -> dict[str, Any]:
        return {"kind": "openai", "model": self.name, "base_url": self.base_url, "max_context": self.max_context,
                "server_version": self.server_version, "request_seeds": self.request_seeds}

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return None

    def _one(self, messages: Sequence[Message], s: Sampling) -> Generation:
        body: dict[str, Any] = {"model": self.name, "messages": list(messages), "temperature": s.temperature,
                                "top_p": s.top_p, "max_tokens": s.max_tokens}
        if s.seed is not None and self.request_seeds:
            body["seed"] = s.seed
        t0 = time.perf_counter()
        try:
            data = self._request("/chat/completions", body)
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            return Generation(text=choice["message"].get("content") or "",
                              prompt_tokens=int(usage.get("prompt_tokens", 0)),
                              completion_tokens=int(usage.get("completion_tokens", 0)),
                              finish_reason=str(choice.get("finish_reason")), seconds=time.perf_counter() - t0)
        except BackendError as e:
            return failed(str(e), t0)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            return failed(f"{self.base_url}/chat/completions answered without choices[0].message", t0)

    def generate(self, conversations: Sequence[Sequence[Message]], sampling: Sequence[Sampling]) -> list[Generation]:
        futs = [self._pool.submit(self._one, c, s) for c, s in zip(conversations, sampling, strict=True)]
        return [f.result() for f in futs]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
