#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan+UBSan, coverage-instrumented) and fuzzes the
# block reader.   scripts/fuzz.sh [SECONDS]   (default 300)
# The corpus grows in build-fuzz/corpus/block_reader and is reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-300}"
./scripts/setup.sh
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSTRATA_BUILD_FUZZERS=ON -DSTRATA_SANITIZE=address -DSTRATA_CUDA=OFF \
  -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build-fuzz --target block_reader_fuzz make_block_seeds
mkdir -p build-fuzz/corpus/block_reader build-fuzz/seeds/block_reader
./build-fuzz/tests/fuzz/make_block_seeds build-fuzz/seeds/block_reader
./build-fuzz/tests/fuzz/block_reader_fuzz -max_total_time="$seconds" -max_len=65536 \
  -print_final_stats=1 build-fuzz/corpus/block_reader build-fuzz/seeds/block_reader
