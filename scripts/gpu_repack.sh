#!/usr/bin/env bash
# Re-pack .gpu/ (from ../shared/gpu/prepare.sh) into smaller transfer folders. A device call carries the
# tracked tree plus one folder within 64 MiB; prepare.sh packs folders of up to 56 MiB, which no longer
# fit once the tree (results included) passes ~8 MiB. Each folder then holds what is left beside the
# tree, minus a margin; receive.sh and install.sh are unchanged (pieces are joined in name order).
#   bash scripts/gpu_repack.sh        # then: one `bash .gpu/K/receive.sh .gpu/K` call per folder
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu/SHA256SUMS ] || { echo "no .gpu/ here: run bash ../shared/gpu/prepare.sh first" >&2; exit 1; }
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
limit=$(( 64 * 1024 * 1024 - tree - 4 * 1024 * 1024 ))
(( limit > 8 * 1024 * 1024 )) || { echo "the tracked tree ($tree bytes) leaves no room for transfers" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cp .gpu/SHA256SUMS .gpu/install.sh "$work"/; cp "$(ls .gpu/*/receive.sh | head -1)" "$work"/
for first in .gpu/*/*.part00; do
  w=$(basename "${first%.part00}")
  for p in $(ls .gpu/*/"$w".part* | awk -F/ '{print $NF "\t" $0}' | sort | cut -f2); do cat "$p"; done > "$work/$w"
done
(cd "$work" && sha256sum -c --quiet SHA256SUMS)
rm -rf .gpu; mkdir -p .gpu/parts
for w in "$work"/*.whl; do split -b "$limit" -d "$w" ".gpu/parts/$(basename "$w").part"; done
k=1; used=0; mkdir -p .gpu/$k
for p in $(ls -S .gpu/parts); do
  sz=$(stat -c %s ".gpu/parts/$p")
  if (( used + sz > limit )); then k=$((k + 1)); used=0; mkdir -p .gpu/$k; fi
  mv ".gpu/parts/$p" .gpu/$k/; used=$((used + sz))
done
rmdir .gpu/parts
for d in .gpu/[0-9]*; do cp "$work/receive.sh" "$d"/; done
cp "$work/SHA256SUMS" "$work/install.sh" .gpu/; cp "$work/SHA256SUMS" .gpu/1/
echo "tree $tree bytes; $(ls -d .gpu/[0-9]* | wc -l) transfer folders of at most $limit bytes:"; du -sb .gpu/[0-9]*
