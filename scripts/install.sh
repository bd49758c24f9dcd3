#!/usr/bin/env bash
# Create .venv and install the toolkit with its test extras (idempotent; CPU machines).
# torch is installed first at the CPU build's pin so that the unpinned `torch` requirement
# does not pull a multi-GB CUDA build; GPU hosts keep the torch they have.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, cutlass, tvm, datasets, evaluate; print('installed: torch', torch.__version__, '| cutlass-dsl', cutlass.__version__, '| tvm', tvm.__version__)"
