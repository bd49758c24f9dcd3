#!/usr/bin/env bash
# The main job on its embedded default: verify problem 28's shipped kernels in both DSLs
# (on the GPU when there is one, else the CPU tier: reference, policy, compile-only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
for dsl in cutedsl tirx; do
  .venv/bin/mkb verify --problem 28 --dsl "$dsl"
done
