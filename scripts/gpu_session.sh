#!/usr/bin/env bash
# One lent-GPU call that runs everything the bundle holds, most important first, inside a
# deadline, and always returns its logs: scripts/gpu_bundle.sh copies it beside the bundle as
# session.sh. There (carry build/gpu-bundle):
#   STRATA_COMMIT=<commit> STRATA_DEADLINE_S=420 build/gpu-bundle/session.sh [STEP...]
# STEPs (default: all, in this order): pages mma model common simt decode sdpa mbench mtorch
# memcheck racecheck opsmem opsrace mmemcheck. A step starts only with >= 20 s left and is cut at the deadline.
# $OUT gets log.txt (every step's output) and results.tar.gz (the benchmarks' tables and JSON):
# the device tool returns at most 8 files.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
deadline="${STRATA_DEADLINE_S:-420}"
STRATA_SOURCE_DIR="${STRATA_SOURCE_DIR:-$(cd "$here/../.." && pwd)}"
export STRATA_SOURCE_DIR
u="${TMPDIR:-/tmp}/strata-gpu-bundle"
if [ ! -f "$u/.complete" ] || [ "$here/bundle.tar.xz" -nt "$u/.complete" ]; then
  rm -rf "$u" && mkdir -p "$u" && tar -C "$u" -xJf "$here/bundle.tar.xz" && touch "$u/.complete" ||
    { echo "session: cannot unpack $here/bundle.tar.xz" >&2; exit 1; }
fi
cp "$here"/*.py "$u/"
cublas="${CUBLAS_LIB_DIR:-}"
if [ -z "$cublas" ] && [ ! -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
  cublas="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
export LD_LIBRARY_PATH="$u/lib${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out="${OUT:-$here/out}"
res="$out/results"
mkdir -p "$res"
log="$out/log.txt"
: > "$log"
cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
summary=()
rc=0
# step NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, time left), its output into the log.
step() {
  local name="$1" limit="$2"; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then summary+=("$name: skipped (deadline)"); return; fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local t0=$SECONDS
  echo "== $name ($*)" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local r=$?
  summary+=("$name: exit $r, $((SECONDS - t0)) s")
  [ "$r" = 0 ] || rc=1
}
steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(pages mma model common simt decode sdpa mbench mtorch memcheck racecheck opsmem opsrace mmemcheck)
nvidia-smi -L >> "$log" 2>&1 || true
for s in "${steps[@]}"; do
  case "$s" in
    pages) step pages 60 "$u/kernels_cuda_pages_test" --gtest_brief=1 ;;
    mma) step mma 120 env STRATA_CUDA_DECODE=mma "$u/kernels_cuda_test" --gtest_brief=1 ;;
    simt) step simt 120 env STRATA_CUDA_DECODE=simt "$u/kernels_cuda_test" --gtest_brief=1 \
            --gtest_filter='PagedDecode*' ;;
    model) step model 150 "$u/model_cuda_test" --gtest_brief=1 ;;
    common) step common 60 "$u/common_cuda_test" --gtest_brief=1 ;;
    decode) step decode 150 "$u/cuda_decode_bench" --out "$res" ;;
    sdpa) step sdpa 120 python3 "$u/cuda_sdpa_bench.py" --out "$res" ;;
    mbench) step mbench 180 "$u/cuda_model_bench" --out "$res" ;;
    mtorch) step mtorch 150 python3 "$u/cuda_model_torch.py" --out "$res" ;;
    memcheck) step memcheck 120 "$cs" --tool memcheck --error-exitcode 1 "$u/kernels_cuda_test" \
                --gtest_filter='PagedDecodeGpuTest.*' --gtest_brief=1 ;;
    racecheck) step racecheck 120 "$cs" --tool racecheck --error-exitcode 1 "$u/kernels_cuda_test" \
                 --gtest_filter='PagedDecodeGpuTest.*' --gtest_brief=1 ;;
    opsmem) step opsmem 120 "$cs" --tool memcheck --error-exitcode 1 "$u/kernels_cuda_test" \
              --gtest_filter='ModelOps*' --gtest_brief=1 ;;
    opsrace) step opsrace 120 "$cs" --tool racecheck --error-exitcode 1 "$u/kernels_cuda_test" \
               --gtest_filter='ModelOps*' --gtest_brief=1 ;;
    mmemcheck) step mmemcheck 150 "$cs" --tool memcheck --error-exitcode 1 "$u/model_cuda_test" \
                 --gtest_brief=1 ;;
    *) summary+=("$s: unknown step") ; rc=1 ;;
  esac
done
# The benchmarks' tables, shortened, then the failures' lines and the summary (the device tool's
# reply holds the output's end).
for f in "$res"/*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -v '^ *$' "$f" | head -n 30; }; done
tar -C "$out" -czf "$out/results.tar.gz" results && rm -rf "$res"
grep -E '^\[  FAILED  \]|Failure|error:|Error|ERROR|nan|mismatch' "$log" | grep -v '^\[  FAILED  \] *[0-9]* test' | head -n 60
printf '%s\n' "${summary[@]}"
exit "$rc"
