#!/usr/bin/env bash
# Where the stores are, modelled over both Mooncake traces (issue "Beyond one store machine"):
# one store for the cluster, a store per host, and a store per host with a Redis Cluster shared
# tier behind them, over HOSTS hosts (default 4), each store one machine's RAM (and disk), the
# router choosing hosts by prefix overlap and load (PREFILL tokens/s per host, default 20000).
# Tables and JSON in bench/results/replay-layouts-<trace>-<date>-<commit>.{txt,json}.
#   scripts/replay_layouts.sh [CODEC ...]     (default: fp16 kivi:k2v2:g32)
#   HOSTS=4 SHARED=1T PREFILL=20000 RAM=64G,256G,1T DISK=4T scripts/replay_layouts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
codecs="${*:-fp16 kivi:k2v2:g32}"
codecs="${codecs// /,}"
./scripts/build.sh --target strata >/dev/null
commit="$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)"
for trace in ../shared/data/traces/mooncake_*_trace.jsonl; do
  name="$(basename "$trace" .jsonl)"
  base="bench/results/replay-layouts-${name}-$(date -u +%Y-%m-%d)-${commit}"
  {
    echo "machine $(uname -m) $(nproc) cores, $(date -u +%FT%TZ), commit $commit"
    ./build/tools/strata replay "$trace" --codecs "$codecs" --policies s3fifo \
      --ram_sizes "${RAM:-64G,256G,1T}" --disk_size "${DISK:-4T}" \
      --layouts central,per-host,shared-tier --hosts "${HOSTS:-4}" --shared_size "${SHARED:-1T}" \
      --host_prefill_tokens_per_s "${PREFILL:-20000}" --json "$base.json" 2>/dev/null
  } | tee "$base.txt"
done
