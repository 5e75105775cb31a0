#!/usr/bin/env bash
# Builds and runs Strata's benchmarks, writing JSON to bench/results/ named by benchmark, date
# and commit, with the machine, date and commit inside:
#  - Google Benchmark micro-benchmarks (CRC-32C, codec encode), filtered by the argument;
#  - end-to-end programs (bench/codec_bench: compression, attention and error tables).
#   scripts/bench.sh [BENCHMARK_NAME_FILTER]
set -euo pipefail
cd "$(dirname "$0")/.."
filter="${1:-.}"
./scripts/setup.sh
./scripts/build.sh
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
dirty="$(git diff --quiet 2>/dev/null || echo -dirty)"
date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
mkdir -p bench/results
for bin in build/common/common_benchmark build/kernels/kernels_benchmark; do
  name="$(basename "$bin")"
  out="bench/results/${name}-$(date -u +%Y%m%d)-${commit}${dirty}.json"
  "$bin" --benchmark_filter="$filter" --benchmark_out="$out" --benchmark_out_format=json \
    --benchmark_context=commit="${commit}${dirty}" --benchmark_context=date="$date" \
    --benchmark_context=machine="$(hostname) / ${cpu} / $(nproc) cores"
  echo "wrote $out"
done
if [ "$filter" = "." ] || [ "$filter" = "codec_bench" ]; then
  ./build/bench/codec_bench --commit "${commit}${dirty}" --out bench/results |
    tee "bench/results/codec_bench-$(date -u +%Y-%m-%d)-${commit}${dirty}.txt"
fi
if { [ "$filter" = "." ] || [ "$filter" = "model_bench" ]; } && [ -f models/strata-tiny/config.json ]; then
  ./build/bench/model_bench --commit "${commit}${dirty}" --out bench/results |
    tee "bench/results/model_bench-$(date -u +%Y-%m-%d)-${commit}${dirty}.txt"
fi
if [ "$filter" = "." ] || [ "$filter" = "transport_bench" ]; then
  # Two processes on this machine over UCX, against ucx_perftest in the same run; writes
  # bench/results/transport_bench-<UCX_TLS>-<date>-<commit>.{txt,json}.
  ./build/bench/transport_bench --commit "${commit}${dirty}" --out bench/results
fi
