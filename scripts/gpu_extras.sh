#!/usr/bin/env bash
# The project's pure-Python dependencies that the H200 image lacks (pydantic and what it needs), as wheels in
# .gpu/py (git-ignored) for Python 3.12 on x86_64. Run here once; carry .gpu/py in a device call and
# scripts/gpu_session.sh installs them (without them every verification fails at import on the host).
#   bash scripts/gpu_extras.sh
set -euo pipefail
cd "$(dirname "$0")/.."
pin=$(.venv/bin/python -c "import pydantic; print(pydantic.VERSION)" 2>/dev/null || echo "")
mkdir -p .gpu/py
.venv/bin/python -m pip download -q -d .gpu/py --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "pydantic${pin:+==$pin}"
ls .gpu/py
