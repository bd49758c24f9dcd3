#!/usr/bin/env bash
# Per-evaluation overhead of the parent-attested timing (issue #27), one device call, after `source .gpu/install.sh`
# (the cheat suite is `bash scripts/gpu_session.sh cheats`):
#   bash scripts/gpu_timing.sh overhead   # per-evaluation time before/after, interleaved on this host; needs
#                                         # the pre-change tree in build/before_timing (carried: it is ignored)
# Logs and records go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export MKB_CACHE_DIR="${MKB_CACHE_DIR:-$HOME/mkb_state/cache}"
mkdir -p "$MKB_CACHE_DIR"
budget="${MKB_STAGE_S:-560}"
case "${1:-}" in
  overhead)
    [ -d build/before_timing/mkb_eval ] || { echo "build/before_timing is missing (carry it)" >&2; exit 2; }
    timeout "$budget" python3 scripts/eval_overhead.py --tree before=build/before_timing --tree after=. \
      --kernels "${KERNELS:-28/cutedsl,28/tirx,36/cutedsl,36/tirx}" --rounds "${ROUNDS:-2}" \
      --out "$OUT/overhead.jsonl" 2> "$OUT/overhead.err" | tee "$OUT/overhead.log"
    tail -5 "$OUT/overhead.err" ;;
  *) echo "usage: $0 overhead" >&2; exit 2 ;;
esac
