#!/usr/bin/env bash
# Configures and builds Strata with CMake + Ninja (ccache when present).
#   scripts/build.sh [--asan | --tsan] [--cpu-only] [--cuda-code full|ptx] [--target T]...
# Build folders: build/ (default), build-asan/, build-tsan/. CUDA targets are built when nvcc is
# found (STRATA_CUDA=AUTO) unless --cpu-only. Their code (cmake/StrataCuda.cmake): full (SASS for
# sm_80 and sm_90a, plus PTX) where a GPU is visible, else ptx (compute_80 PTX only: a third of the
# compile time, and any sm_80+ GPU still runs it, compiled at first use); --cuda-code chooses
# (scripts/gpu_bundle.sh builds full for the GPU it carries the build to). The sanitizer builds use clang when it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=build
cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_CUDA=AUTO)
cuda_code=ptx
if nvidia-smi -L >/dev/null 2>&1; then cuda_code=full; fi
targets=()
sanitized=0
while [ $# -gt 0 ]; do
  case "$1" in
    # Sanitizer builds keep assertions (STRATA_DCHECK) on: -O1 without NDEBUG. Their debug
    # information is line tables (-g1): enough for every report's file:line, and a third
    # cheaper to compile than -g. They build no benchmarks: timings under a sanitizer mean nothing.
    --asan) dir=build-asan; sanitized=1; cmake_args+=(-DSTRATA_SANITIZE=address "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DSTRATA_BUILD_BENCHMARKS=OFF) ;;
    --tsan) dir=build-tsan; sanitized=1; cmake_args+=(-DSTRATA_SANITIZE=thread "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DSTRATA_BUILD_BENCHMARKS=OFF) ;;
    --cpu-only) dir="$dir-cpu"; cmake_args+=(-DSTRATA_CUDA=OFF) ;;
    --cuda-code)
      case "$2" in full|ptx) cuda_code="$2" ;; *) echo "build.sh: --cuda-code takes full or ptx" >&2; exit 2 ;; esac
      shift ;;
    --target) targets+=(--target "$2"); shift ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

cmake_args+=("-DSTRATA_CUDA_CODE=$cuda_code")

# Sanitizer builds compile with clang where it is installed (scripts/setup.sh installs it): the
# same checks, in two thirds of GCC's time (a cold ASan build of the unit tests on 2 cores: 529 s
# against 773 s), and its ASan caught a use-after-free GCC's let pass. The default build keeps
# the system compiler.
if [ "$sanitized" = 1 ] && [ -z "${CXX:-}" ] && command -v clang++ >/dev/null; then
  export CC=clang CXX=clang++
fi
# A folder configured with another compiler is configured anew (CMake keeps its first one).
if [ -f "$dir/CMakeCache.txt" ]; then
  have="$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$dir/CMakeCache.txt")"
  want="$(command -v "${CXX:-c++}" || true)"
  if [ -n "$have" ] && [ -n "$want" ] && [ "$(readlink -f "$have")" != "$(readlink -f "$want")" ]; then
    rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
  fi
fi

# ccache: share hits between clones in different folders.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
cmake -S . -B "$dir" -G Ninja "${cmake_args[@]}" >"/tmp/strata-cmake-$(basename "$dir").log" ||
  { cat "/tmp/strata-cmake-$(basename "$dir").log"; exit 1; }
cmake --build "$dir" "${targets[@]}"
