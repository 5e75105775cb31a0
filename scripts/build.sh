#!/usr/bin/env bash
# Configures and builds Strata with CMake + Ninja (ccache when present).
#   scripts/build.sh [--asan | --tsan] [--cpu-only] [--target T]...
# Build folders: build/ (default), build-asan/, build-tsan/. CUDA targets are built when nvcc is
# found (STRATA_CUDA=AUTO) unless --cpu-only.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=build
cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_CUDA=AUTO)
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    # Sanitizer builds keep assertions (STRATA_DCHECK) on: -O1 without NDEBUG. Their debug
    # information is line tables (-g1): enough for every report's file:line, and a third
    # cheaper to compile than -g. They build no benchmarks: timings under a sanitizer mean nothing.
    --asan) dir=build-asan; cmake_args+=(-DSTRATA_SANITIZE=address "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DSTRATA_BUILD_BENCHMARKS=OFF) ;;
    --tsan) dir=build-tsan; cmake_args+=(-DSTRATA_SANITIZE=thread "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DSTRATA_BUILD_BENCHMARKS=OFF) ;;
    --cpu-only) dir="$dir-cpu"; cmake_args+=(-DSTRATA_CUDA=OFF) ;;
    --target) targets+=(--target "$2"); shift ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

# ccache: share hits between clones in different folders.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
cmake -S . -B "$dir" -G Ninja "${cmake_args[@]}" >"/tmp/strata-cmake-$(basename "$dir").log" ||
  { cat "/tmp/strata-cmake-$(basename "$dir").log"; exit 1; }
cmake --build "$dir" "${targets[@]}"
