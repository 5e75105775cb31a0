#!/usr/bin/env bash
# Offload-capacity report: both Mooncake traces replayed against the store's tiers (RAM sweep,
# with and without a 4 TiB disk, fp16 vs compressed blocks at their real bits per element, LRU
# vs S3-FIFO), as tables, JSON and charts in bench/results/replay-<trace>-<date>-<commit>.*
#   scripts/replay_report.sh [CODEC ...]     (default: kivi:k2v2:g32 gear:k2v2:kcvt:r2:s1)
set -euo pipefail
cd "$(dirname "$0")/.."
codecs="fp16,${*:-kivi:k2v2:g32 gear:k2v2:kcvt:r2:s1}"
codecs="${codecs// /,}"
./scripts/setup_training.sh >/dev/null  # python3-matplotlib for the charts
./scripts/build.sh --target strata >/dev/null
commit="$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)"
for trace in ../shared/data/traces/mooncake_*_trace.jsonl; do
  name="$(basename "$trace" .jsonl)"
  base="bench/results/replay-${name}-$(date -u +%Y-%m-%d)-${commit}"
  {
    echo "machine $(uname -m) $(nproc) cores, $(date -u +%FT%TZ), commit $commit"
    ./build/tools/strata replay "$trace" --codecs "$codecs" --json "$base.json"
  } | tee "$base.txt"
  /usr/bin/python3 tools/replay_chart.py "$base.json" "$base.png"
done
