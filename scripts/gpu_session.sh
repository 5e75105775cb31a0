#!/usr/bin/env bash
# The one runner of the GPU bundle: runs the steps asked for (default: all), most important first,
# inside a deadline, and always returns its logs. scripts/gpu_bundle.sh copies it beside the
# bundle as session.sh (and writes quick.sh, model.sh and run.sh: this with chosen steps). There
# (carry build/gpu-bundle):
#   STRATA_COMMIT=<commit> STRATA_DEADLINE_S=420 build/gpu-bundle/session.sh [STEP...]
# STEPs, in the default order:
#   pages kernels model common   the GPU tests (kernels_cuda_test runs both paged decode kernels)
#   decode sdpa                  cuda_decode_bench, and PyTorch's SDPA at the same shapes
#   mbench mtorch                cuda_model_bench (8B shape), and PyTorch at the same shapes
#   bbench                       cuda_backend_bench: the serving path (TTFT with an adopted prefix,
#                                prefill in chunk pieces, StepBatch decode) at the 8B shape
#   memcheck racecheck           compute-sanitizer on the paged decode tests
#   pmemcheck pracecheck         ... on the general kernel's parity test (every codec's pages)
#   cmemcheck cracecheck         ... on the codebook kernel's parity test (CQ pages)
#   opsmem opsrace               ... on the model ops' tests
#   mmemcheck                    memcheck on the model's and the backend's tests
#   ncu                          Nsight Compute (--set full, clocks left alone) on one launch each of
#                                the affine kernel over k4v4 pages, the general kernel over the
#                                same pages and the codebook kernel over CQ c4:b8 pages, batch
#                                16 x 32k: results/ncu-*.txt
#   nccl                         nccl_transport_test and nccl_bench (NCCL from /usr/local/cuda,
#                                $NCCL_LIB_DIR or Python's nvidia.nccl)
#   cpu                          where the CPU has AVX512-VNNI: kernels_test at 256 and 512 bits,
#                                codec_bench's attention tables per integer path (not in the default)
# A step starts only with >= 20 s left and is cut at the deadline. $OUT gets log.txt (every step's
# output) and results.tar.gz (the benchmarks' tables and JSON): the device tool returns at most 8
# files. The output's end: the benchmarks' tables, failures' lines, a line per step.
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
# NCCL and cuBLAS are not in the bundle (hundreds of MB): the machine's own.
nccl="${NCCL_LIB_DIR:-}"
if [ -z "$nccl" ] && [ ! -e /usr/local/cuda/lib/libnccl.so.2 ]; then
  nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
cublas="${CUBLAS_LIB_DIR:-}"
if [ -z "$cublas" ] && [ ! -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
  cublas="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
export LD_LIBRARY_PATH="$u/lib${nccl:+:$nccl}${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
  local arg
  for arg in "$@"; do  # a binary this bundle lacks (scripts/gpu_bundle.sh --cpu)
    if [[ "$arg" == "$u/"* ]] && [ ! -e "$arg" ]; then
      summary+=("$name: skipped (not in this bundle)")
      return
    fi
  done
  [ "$limit" -gt "$left" ] && limit="$left"
  local t0=$SECONDS
  echo "== $name ($*)" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local r=$?
  summary+=("$name: exit $r, $((SECONDS - t0)) s")
  [ "$r" = 0 ] || rc=1
}
sanitize() {  # NAME TOOL BINARY FILTER
  if [ ! -x "$cs" ]; then summary+=("$1: skipped (no compute-sanitizer)"); return; fi
  step "$1" 150 "$cs" --tool "$2" --error-exitcode 1 "$u/$3" --gtest_filter="$4" --gtest_brief=1
}
torch() {  # NAME SCRIPT
  if ! python3 -c 'import torch' 2>/dev/null; then summary+=("$1: skipped (no PyTorch)"); return; fi
  step "$1" 150 python3 "$u/$2" --out "$res"
}
# profile NAME KERNEL_REGEX BENCH_ROW: ncu's full set on the third launch of the kernel matching
# KERNEL_REGEX while cuda_decode_bench times only BENCH_ROW (batch 16 x 32k, 64-token pages).
profile() {
  local ncu
  ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  if [ ! -x "$ncu" ]; then summary+=("$1: skipped (no ncu)"); return; fi
  step "$1" 150 "$ncu" --clock-control none --set full -k "regex:$2" --launch-skip 2 \
    --launch-count 1 --log-file "$res/$1.txt" "$u/cuda_decode_bench" --quick --page_tokens 64 \
    --runs 3 --kernels "$3"
}
# The CPU's attention kernels where it has AVX512-VNNI: kernels_test (its integer-kernel test
# compares every path the CPU runs, 512-bit included, bit for bit with AVX2); the attention table
# at 8k tokens per integer path (AVX2, 256-bit VNNI, 512-bit), the compression table, 32k with
# VNNI and 512-bit.
cpu_checks() {
  if ! grep -qw avx512_vnni /proc/cpuinfo; then
    summary+=("cpu: skipped (no AVX512-VNNI here)")
    return
  fi
  echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo), $(nproc) threads" >> "$log"
  step "cpu kernels_test" 180 "$u/cpu/kernels_test" --gtest_brief=1
  local run name args
  for run in "avx2-8k|--isa avx2 --tables 2 --contexts 8192" \
             "vnni-8k|--tables 2 --contexts 8192" \
             "zmm-8k|--integer_dot avx512-vnni-zmm --tables 2 --contexts 8192" \
             "compress|--tables 1" \
             "zmm-32k|--integer_dot avx512-vnni-zmm --tables 2 --contexts 32768" \
             "vnni-32k|--tables 2 --contexts 32768"; do
    IFS='|' read -r name args <<< "$run"
    mkdir -p "$res/$name"
    # shellcheck disable=SC2086  # args is a word list
    step "cpu codec_bench $name" 300 "$u/cpu/codec_bench" $args --out "$res/$name" \
      --commit "${STRATA_COMMIT:-unknown}"
  done
}
steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(pages kernels model common decode sdpa mbench mtorch bbench memcheck racecheck cmemcheck cracecheck pmemcheck pracecheck opsmem opsrace mmemcheck nccl)
nvidia-smi -L >> "$log" 2>&1 || true
for s in "${steps[@]}"; do
  case "$s" in
    pages) step pages 150 "$u/kernels_cuda_pages_test" --gtest_brief=1 ;;
    kernels) step kernels 180 "$u/kernels_cuda_test" --gtest_brief=1 ;;
    model) step model 180 "$u/model_cuda_test" --gtest_brief=1 ;;
    common) step common 60 "$u/common_cuda_test" --gtest_brief=1 ;;
    decode) step decode 240 "$u/cuda_decode_bench" --out "$res" ;;
    sdpa) torch sdpa cuda_sdpa_bench.py ;;
    mbench) step mbench 180 "$u/cuda_model_bench" --out "$res" ;;
    mtorch) torch mtorch cuda_model_torch.py ;;
    bbench) step bbench 240 "$u/cuda_backend_bench" --out "$res" ;;
    memcheck) sanitize memcheck memcheck kernels_cuda_test 'PagedDecodeGpuTest.*' ;;
    racecheck) sanitize racecheck racecheck kernels_cuda_test 'PagedDecodeGpuTest.*' ;;
    pmemcheck) sanitize pmemcheck memcheck kernels_cuda_pages_test 'BlockPagesGpuTest.General*' ;;
    pracecheck) sanitize pracecheck racecheck kernels_cuda_pages_test 'BlockPagesGpuTest.General*' ;;
    cmemcheck) sanitize cmemcheck memcheck kernels_cuda_pages_test 'BlockPagesGpuTest.Codebook*' ;;
    cracecheck) sanitize cracecheck racecheck kernels_cuda_pages_test 'BlockPagesGpuTest.Codebook*' ;;
    opsmem) sanitize opsmem memcheck kernels_cuda_test 'ModelOps*' ;;
    opsrace) sanitize opsrace racecheck kernels_cuda_test 'ModelOps*' ;;
    mmemcheck) sanitize mmemcheck memcheck model_cuda_test '*' ;;
    ncu)
      profile ncu-affine-k4v4 MmaDecodeKernel "affine k4v4 g32"
      profile ncu-general-k4v4 GeneralDecodeKernel "general k4v4 g32"
      profile ncu-codebook-c4b8 CodebookDecodeKernel "codebook cq c4 b8" ;;
    nccl)
      step nccl_test 120 "$u/nccl_transport_test" --gtest_brief=1
      step nccl_bench 120 "$u/nccl_bench" --out "$res" --commit "${STRATA_COMMIT:-unknown}" ;;
    cpu) cpu_checks ;;
    *) summary+=("$s: unknown step"); rc=1 ;;
  esac
done
for f in "$res"/*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -v '^ *$' "$f" | head -n 30; }; done
tar -C "$out" -czf "$out/results.tar.gz" results && rm -rf "$res"
grep -E '^\[  FAILED  \]|Failure|error:|Error|ERROR|nan|mismatch' "$log" | grep -v '^\[  FAILED  \] *[0-9]* test' | head -n 60
printf '%s\n' "${summary[@]}"
exit "$rc"
