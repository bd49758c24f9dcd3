#!/usr/bin/env bash
# GPU checks of the parent-attested timing (issue #27), one device call each, after `source .gpu/install.sh`:
#   bash scripts/gpu_timing.sh cheats     # problem 28: shipped solutions, every wrong/ kernel (timing cheats
#                                         # included), isolation, compile lane, device time, timer
#                                         # (K="stable" runs the 5-evaluation stability test alone)
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
  cheats)
    MKB_GPU_RECORDS="$OUT/cheats.jsonl" timeout "$budget" python3 -m pytest -q -m gpu tests/harness/test_gpu.py \
      -p no:cacheprovider -k "${K:-28- or isolated or lane_back or host_path or timer_matches}" -rA 2>&1 \
      | tee "$OUT/cheats.log" | tail -40
    python3 - "$OUT/cheats.jsonl" <<'EOF' | tee "$OUT/cheats.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| test | kernel | expected | status | kernel ms | attested ms | worker ms | flags |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    t = r.get("timing", {})
    f = lambda x: "-" if x is None else f"{x:.4f}"
    print(f"| {r.get('test')} | {r['problem_id']}/{r['dsl']} {r.get('kernel', '')} | {r.get('expected', 'ok')} | {r['status']} "
          f"| {f(t.get('kernel_ms'))} | {f(t.get('attested_ms'))} | {f(t.get('worker_event_ms'))} | {','.join(r['flags'])} |")
EOF
    ;;
  overhead)
    [ -d build/before_timing/mkb_eval ] || { echo "build/before_timing is missing (carry it)" >&2; exit 2; }
    timeout "$budget" python3 scripts/eval_overhead.py --tree before=build/before_timing --tree after=. \
      --kernels "${KERNELS:-28/cutedsl,28/tirx,36/cutedsl,36/tirx}" --rounds "${ROUNDS:-2}" \
      --out "$OUT/overhead.jsonl" 2> "$OUT/overhead.err" | tee "$OUT/overhead.log"
    tail -5 "$OUT/overhead.err" ;;
  *) echo "usage: $0 cheats|overhead" >&2; exit 2 ;;
esac
