#!/usr/bin/env bash
# One stage of a GPU session on the H200 host (after `source .gpu/install.sh`); each stage fits one
# device call and leaves its logs and records under $OUT. State that later stages reuse (the
# torch.compile cache, the resumable sweep file) lives under $MKB_STATE, which survives between
# calls while the host stays warm.
#   bash scripts/gpu_session.sh foundation|report|sweep|bench|safety|noise [extra args]
# Run `report` before `sweep` on the same host: the sweep then takes both baselines (torch.compile and
# eager, timed by the report with nothing compiling beside them) from the cache instead of its lanes.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
export MKB_STATE="${MKB_STATE:-$HOME/mkb_state}"
export MKB_CACHE_DIR="${MKB_STATE}/cache"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$MKB_STATE" "$MKB_CACHE_DIR"
# MKB_SEED_COMPILE=results/h200/<date>_compile_baselines.jsonl: sweeps take torch.compile times from an
# earlier report (same GPU model and versions) when this host has none, e.g. to benchmark sweeps alone
if [ -n "${MKB_SEED_COMPILE:-}" ] && [ ! -s "$MKB_CACHE_DIR/compile_baselines.jsonl" ]; then
  cp "$MKB_SEED_COMPILE" "$MKB_CACHE_DIR/compile_baselines.jsonl"
fi
budget="${MKB_STAGE_S:-540}"          # seconds this stage may run (a call is capped at 600)
stage="$1"; shift || true
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c \
  "import torch,importlib.metadata as m;print('torch',torch.__version__,'cutlass-dsl',m.version('nvidia-cutlass-dsl'),'tvm',m.version('apache-tvm'))"; } \
  > "$OUT/env.txt" 2>&1
preflight() {
  # one evaluation per DSL with the default worker user; if the unprivileged user cannot evaluate
  # here, sweeps keep root workers (their records say so in sandbox.uid) rather than fail; once per host
  [ -n "${MKB_WORKER_USER+x}" ] && return
  if [ -f "$MKB_STATE/preflight.env" ]; then source "$MKB_STATE/preflight.env"; return; fi
  for d in cutedsl tirx; do
    timeout 120 python3 -m mkb_eval.cli verify --problem 28 --dsl $d --no-compile-baseline --json \
      > "$OUT/preflight_$d.json" 2> "$OUT/preflight_$d.err" &
  done; wait
  if ! python3 -c "import json,sys; sys.exit(any(json.load(open(f))['status'] != 'ok' for f in sys.argv[1:]))" \
      "$OUT"/preflight_*.json; then
    echo "preflight failed with the default worker user: sweeping with MKB_WORKER_USER='' (root)" | tee "$OUT/preflight.txt"
    echo 'export MKB_WORKER_USER=""' > "$MKB_STATE/preflight.env"
    export MKB_WORKER_USER=""
  else
    : > "$MKB_STATE/preflight.env"
  fi
}
case "$stage" in
  foundation)
    timeout 60 python3 -m mkb_eval.cli verify --problem 28 --dsl cutedsl --no-compile-baseline --json > "$OUT/smoke.json" 2> "$OUT/smoke.err"
    MKB_GPU_RECORDS="$OUT/foundation.jsonl" timeout "$budget" python3 -m pytest -q -m gpu tests/harness/test_gpu.py \
      -p no:cacheprovider -s "$@" 2>&1 | tee "$OUT/foundation.log" | tail -40 ;;
  report)
    timeout "$budget" python3 scripts/problem_report.py --out "$MKB_STATE/problem_report" --jobs "${JOBS:-12}" "$@" \
      > "$OUT/report.log" 2>&1
    tail -5 "$OUT/report.log"; cp "$MKB_STATE"/problem_report.* "$MKB_CACHE_DIR"/{compile,eager}_baselines.jsonl "$OUT/" 2>/dev/null ;;
  sweep)
    preflight
    timeout "$budget" python3 -m mkb_eval.cli verify --all --parallel "${PARALLEL:-8}" --warm --cached-compile-baseline --reuse-eager-baseline \
      --out "$MKB_STATE/sweep.jsonl" "$@" > "$OUT/sweep.log" 2>&1
    tail -30 "$OUT/sweep.log"; cp "$MKB_STATE/sweep.jsonl" "$OUT/" ;;
  bench)
    # resumable stages (scripts/bench_sweep.py --stage ...); its folder comes back whole as bench.tgz
    preflight
    timeout $((budget + 30)) python3 scripts/bench_sweep.py --out "$MKB_STATE/bench" --deadline-s "$budget" "$@" \
      >> "$MKB_STATE/bench.log" 2>&1
    tail -30 "$MKB_STATE/bench.log"; sed "s#$PWD/#<repo>/#g" "$MKB_STATE/bench.log" > "$OUT/bench.log"   # no machine paths
    tar czf "$OUT/bench.tgz" -C "$MKB_STATE" bench ;;
  noise)
    # is the host call path's speed a property of the process or of the moment? fresh processes one after
    # another on the same core, each timing the solutions in several rounds; every other process with a
    # fixed hash seed and no address randomisation (so those share their memory layout)
    sols="${NOISE_SOLUTIONS:-3/cutedsl 3/tirx 46/cutedsl 55/tirx 70/cutedsl 70/tirx}"
    for p in $(seq 0 $((${NOISE_PROCS:-4} - 1))); do
      if [ $((p % 2)) = 1 ]; then fixed="env PYTHONHASHSEED=0 setarch $(uname -m) -R"; else fixed=""; fi
      timeout "$budget" $fixed taskset -c 1 python3 scripts/diagnostics/timing_noise.py $sols --rep "$p" --variants base \
        --rounds "${NOISE_ROUNDS:-4}" --pause-s 5 "$@" >> "$OUT/noise.jsonl" 2>> "$OUT/noise.err"
    done
    tail -3 "$OUT/noise.err"; wc -l "$OUT/noise.jsonl" ;;
  safety)
    timeout "$budget" python3 -m mkb_eval.cli safety --tier gpu --md "$OUT/safety_gpu.md" "$@" > "$OUT/safety.log" 2>&1
    tail -25 "$OUT/safety.log" ;;
  *) echo "unknown stage '$stage'" >&2; exit 2 ;;
esac
