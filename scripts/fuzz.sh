#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan+UBSan, coverage-instrumented) and runs each for
# SECONDS: the block reader; parse + codec validation + decode + attention; the safetensors and
# config.json parsers; the block shipping protocol's header decoders; a shipment (the blocks and
# windows of one request) as the decode node adopts it; the router's OpenAI request parser; the
# store's recovery from a damaged block log; what the cluster reads from etcd; calibration files;
# a Redis server's replies.
#   scripts/fuzz.sh [SECONDS] [TARGET]   (default 300 seconds each, every target)
# Corpora grow in build-fuzz/corpus/<target> and are reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-300}"
only="${2:-}"
./scripts/setup.sh
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSTRATA_BUILD_FUZZERS=ON -DSTRATA_SANITIZE=address -DSTRATA_CUDA=OFF \
  -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build-fuzz --target block_reader_fuzz block_attention_fuzz safetensors_fuzz \
  block_wire_fuzz shipment_fuzz openai_request_fuzz block_log_fuzz etcd_answer_fuzz calibration_fuzz \
  redis_reply_fuzz make_block_seeds
mkdir -p build-fuzz/seeds
./build-fuzz/tests/fuzz/make_block_seeds build-fuzz/seeds
for target in block_reader block_attention safetensors block_wire shipment openai_request block_log \
              etcd_answer calibration redis_reply; do
  [ -n "$only" ] && [ "$only" != "$target" ] && continue
  mkdir -p "build-fuzz/corpus/$target"
  echo "== fuzzing $target for $seconds s"
  "./build-fuzz/tests/fuzz/${target}_fuzz" -max_total_time="$seconds" -max_len=65536 \
    -print_final_stats=1 "build-fuzz/corpus/$target" build-fuzz/seeds tests/fuzz/regressions
done
