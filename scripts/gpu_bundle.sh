#!/usr/bin/env bash
# Builds the GPU test binaries (CTest label "gpu") and GPU benchmarks and gathers them, with the shared libraries they
# need that a bare CUDA machine lacks (Debian's Abseil, ...), into build/gpu-bundle/, with a
# run.sh that runs each of them there. For a lent GPU machine that has the CUDA driver and NCCL
# (a CUDA image's Python nvidia-nccl package will do) but not Debian's libraries:
#   scripts/gpu_bundle.sh [--cpu]    # here: build and gather (--cpu: only the CPU binaries, for a
#                                    # lent machine's CPU; run.sh then runs only their part)
#   STRATA_COMMIT=$(git rev-parse --short HEAD) build/gpu-bundle/run.sh
#                                    # there (carry build/gpu-bundle); exit status: any failure
#   STRATA_COMMIT=... build/gpu-bundle/quick.sh   # the paged decode alone: its tests both
#                                    # ways, sanitizers, cuda_decode_bench and SDPA (~20 s)
# NCCL and cuBLAS are not copied (hundreds of MB): run.sh finds libnccl.so.2 in
# /usr/local/cuda/lib, in $NCCL_LIB_DIR, or in Python's nvidia.nccl package, and libcublas.so.13
# in /usr/local/cuda/lib64 or Python's nvidia.cublas package. Tests that read the repository's
# models and fixtures find it through STRATA_SOURCE_DIR (the checkout around build/gpu-bundle).
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(common_cuda_test kernels_cuda_test kernels_cuda_pages_test model_cuda_test
         nccl_transport_test nccl_bench cuda_decode_bench cuda_model_bench)
case "${1:-}" in
  --cpu) targets=() ;;
  "") ;;
  *) echo "gpu_bundle.sh: unknown argument $1 (--cpu or nothing)" >&2; exit 2 ;;
esac
# CPU binaries for the lent machine's own CPU (often one with AVX-512): run.sh runs the integer
# attention kernels' tests and benchmark there, 256-bit against 512-bit registers.
cpu_targets=(kernels_test codec_bench)
./scripts/build.sh $(printf -- "--target %s " "${targets[@]}" "${cpu_targets[@]}")

out=build/gpu-bundle
rm -rf "$out"
mkdir -p "$out/lib" "$out/cpu"
# gather TARGET DIR: the binary into DIR, and every shared library it loads except the C/C++
# runtime, CUDA's driver and NCCL into lib/.
gather() {
  local bin
  bin="$(find build -path build/gpu-bundle -prune -o -type f -name "$1" -perm -u+x -print | head -n 1)"
  [ -n "$bin" ] || { echo "gpu_bundle: $1 was not built (no CUDA in this build?)" >&2; exit 1; }
  cp "$bin" "$2/"
  # Without debug info: the device tool carries at most 64 MiB (RelWithDebInfo binaries are
  # mostly DWARF).
  strip --strip-debug "$2/$1"
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' |
    { grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libcuda|libnccl|libcublas|libcublasLt)\.so' || true; } |
    while read -r lib; do cp -L "$lib" "$out/lib/"; done
}
for t in "${targets[@]+"${targets[@]}"}"; do gather "$t" "$out"; done
for t in "${cpu_targets[@]}"; do gather "$t" "$out/cpu"; done

cp bench/cuda_sdpa_bench.py bench/cuda_model_torch.py "$out/"
# session.sh: everything above in one call under a deadline, logs back through $OUT.
cp scripts/gpu_session.sh "$out/session.sh"

cat > "$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs every test binary beside this script and the benchmarks; exit status 1 if any failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The binaries and libraries travel as bundle.tar.xz (a lent machine takes 64 MiB per call, the
# repository included): unpacked once into a scratch folder, run from there.
STRATA_SOURCE_DIR="${STRATA_SOURCE_DIR:-$(cd "$here/../.." && pwd)}"
export STRATA_SOURCE_DIR
if [ -f "$here/bundle.tar.xz" ]; then
  unpacked="${TMPDIR:-/tmp}/strata-gpu-bundle"
  if [ ! -f "$unpacked/.complete" ] || [ "$here/bundle.tar.xz" -nt "$unpacked/.complete" ]; then
    rm -rf "$unpacked" && mkdir -p "$unpacked" && tar -C "$unpacked" -xJf "$here/bundle.tar.xz" &&
      touch "$unpacked/.complete" || { echo "gpu bundle: cannot unpack $here/bundle.tar.xz" >&2; exit 1; }
  fi
  cp "$here"/*.py "$unpacked/" 2>/dev/null || true
  here="$unpacked"
fi
nccl="${NCCL_LIB_DIR:-}"
if [ -z "$nccl" ] && [ ! -e /usr/local/cuda/lib/libnccl.so.2 ]; then
  nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
cublas="${CUBLAS_LIB_DIR:-}"
if [ -z "$cublas" ] && [ ! -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
  cublas="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
[ -e /usr/local/cuda/lib64/libcublas.so.13 ] && cublas="${cublas:-/usr/local/cuda/lib64}"
export LD_LIBRARY_PATH="$here/lib${nccl:+:$nccl}${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
# Benchmarks: results land in $OUT (the device tool's) or beside this script.
results="${OUT:-$here/results}"
mkdir -p "$results"
if [ -x "$here/cuda_decode_bench" ]; then
  nvidia-smi -L 2>/dev/null || true
  for t in "$here"/*_test; do
    echo "== $(basename "$t")"
    timeout "${STRATA_TEST_TIMEOUT:-300}" "$t" || { echo "== $(basename "$t"): failed (exit $?)"; rc=1; }
  done
  # The paged decode's other kernel (one warp per query head), which layouts the tensor-core
  # kernel cannot take use: the same tests through it.
  echo "== kernels_cuda_test, STRATA_CUDA_DECODE=simt"
  STRATA_CUDA_DECODE=simt timeout "${STRATA_TEST_TIMEOUT:-300}" "$here/kernels_cuda_test" || rc=1
  echo "== nccl_bench"
  timeout 300 "$here/nccl_bench" --out "$results" --commit "${STRATA_COMMIT:-unknown}" || rc=1
  echo "== cuda_decode_bench"
  timeout 300 "$here/cuda_decode_bench" --out "$results" || rc=1
  # The reference: PyTorch's SDPA on fp16 KV at the same shapes, where PyTorch is there.
  if python3 -c 'import torch' 2>/dev/null; then
    echo "== cuda_sdpa_bench"
    timeout 300 python3 "$here/cuda_sdpa_bench.py" --out "$results" || rc=1
  else
    echo "== cuda_sdpa_bench: no PyTorch on this machine; skipped"
  fi
  echo "== cuda_model_bench"
  timeout 300 "$here/cuda_model_bench" --out "$results" || rc=1
  if python3 -c 'import torch' 2>/dev/null; then
    echo "== cuda_model_torch"
    timeout 300 python3 "$here/cuda_model_torch.py" --out "$results" || rc=1
  fi
  # The kernels' memory checks (when the CUDA toolkit's compute-sanitizer is there).
  if command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
    cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    echo "== compute-sanitizer memcheck: kernels_cuda_test"
    timeout 300 "$cs" --tool memcheck --error-exitcode 1 "$here/kernels_cuda_test" \
      --gtest_filter='PagedDecodeGpuTest.Fp16*:PagedDecodeGpuTest.Affine*' || rc=1
  else
    echo "== compute-sanitizer: not on this machine; memcheck skipped"
  fi
fi
# The CPU's attention kernels where it has AVX512-VNNI (STRATA_CPU_CHECKS=0 skips them):
# - kernels_test on the real instructions, as dispatched and with the 512-bit kernels
#   (STRATA_ZMM=1): VNNI and 512-bit against AVX2, bit for bit;
# - the attention table at 8k tokens on every codec with the three integer paths, AVX2
#   (STRATA_ISA=avx2), 256-bit VNNI and 512-bit, in one sitting; the compression table; then
#   32k tokens with 256-bit VNNI and 512-bit. Each run's JSON goes to its own folder.
cpu_bench() {  # NAME ENV... -- ARGS...
  local name="$1"; shift
  local env=()
  while [ "$1" != "--" ]; do env+=("$1"); shift; done
  shift
  echo "== cpu: codec_bench $name (${env[*]:-as dispatched}) $*"
  mkdir -p "$results/$name"
  env "${env[@]+"${env[@]}"}" timeout 300 "$here/cpu/codec_bench" "$@" --out "$results/$name" \
    --commit "${STRATA_COMMIT:-unknown}" || rc=1
}
if [ "${STRATA_CPU_CHECKS:-1}" = 0 ]; then
  echo "== cpu: STRATA_CPU_CHECKS=0; skipped"
elif grep -qw avx512_vnni /proc/cpuinfo; then
  echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo), $(nproc) threads"
  echo "== cpu: $(grep -m1 '^flags' /proc/cpuinfo | grep -ow 'avx512[a-z_0-9]*\|avx_vnni' | tr '\n' ' ')"
  for zmm in 0 1; do
    echo "== cpu: kernels_test, STRATA_ZMM=$zmm"
    STRATA_ZMM=$zmm timeout 120 "$here/cpu/kernels_test" || rc=1
  done
  cpu_bench avx2-8k STRATA_ISA=avx2 -- --tables 2 --contexts 8192
  cpu_bench vnni-8k STRATA_ZMM=0 -- --tables 2 --contexts 8192
  cpu_bench zmm-8k STRATA_ZMM=1 -- --tables 2 --contexts 8192
  cpu_bench compress -- --tables 1
  cpu_bench zmm-32k STRATA_ZMM=1 -- --tables 2 --contexts 32768
  cpu_bench vnni-32k STRATA_ZMM=0 -- --tables 2 --contexts 32768
else
  echo "== cpu: no AVX512-VNNI here; the 512-bit kernels' checks skipped"
fi
exit "$rc"
EOF
chmod +x "$out/run.sh"

# quick.sh: the paged decode alone, for a kernel change (about 20 s on an H200): its tests
# through both kernels (STRATA_CUDA_DECODE=mma|simt), compute-sanitizer memcheck and racecheck,
# cuda_decode_bench and PyTorch's SDPA at the same shapes, results into $OUT.
cat > "$out/quick.sh" <<'EOF'
#!/usr/bin/env bash
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The binaries and libraries travel as bundle.tar.xz (a lent machine takes 64 MiB per call, the
# repository included): unpacked once into a scratch folder, run from there.
STRATA_SOURCE_DIR="${STRATA_SOURCE_DIR:-$(cd "$here/../.." && pwd)}"
export STRATA_SOURCE_DIR
if [ -f "$here/bundle.tar.xz" ]; then
  unpacked="${TMPDIR:-/tmp}/strata-gpu-bundle"
  if [ ! -f "$unpacked/.complete" ] || [ "$here/bundle.tar.xz" -nt "$unpacked/.complete" ]; then
    rm -rf "$unpacked" && mkdir -p "$unpacked" && tar -C "$unpacked" -xJf "$here/bundle.tar.xz" &&
      touch "$unpacked/.complete" || { echo "gpu bundle: cannot unpack $here/bundle.tar.xz" >&2; exit 1; }
  fi
  cp "$here"/*.py "$unpacked/" 2>/dev/null || true
  here="$unpacked"
fi
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
results="${OUT:-$here/results}"
mkdir -p "$results"
rc=0
for mode in mma simt; do
  for t in kernels_cuda_test kernels_cuda_pages_test; do
    echo "== $t, STRATA_CUDA_DECODE=$mode"
    STRATA_CUDA_DECODE=$mode timeout 120 "$here/$t" --gtest_brief=1 || rc=1
  done
done
cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
if [ -x "$cs" ]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"
    timeout 150 "$cs" --tool "$tool" --error-exitcode 1 "$here/kernels_cuda_test" \
      --gtest_filter='PagedDecodeGpuTest.*' --gtest_brief=1 || rc=1
  done
fi
echo "== cuda_decode_bench"
timeout 200 "$here/cuda_decode_bench" --out "$results" || rc=1
if python3 -c 'import torch' 2>/dev/null; then
  echo "== cuda_sdpa_bench"
  timeout 120 python3 "$here/cuda_sdpa_bench.py" --out "$results" || rc=1
fi
exit "$rc"
EOF
chmod +x "$out/quick.sh"

# model.sh: the model on the GPU alone (about two minutes): its tests and the model ops', the 8B
# benchmark and PyTorch's at the same shapes, compute-sanitizer memcheck on the paged decode test.
{
  sed -n '1,/^fi$/p' "$out/quick.sh"
  cat <<'EOF'
cublas="${CUBLAS_LIB_DIR:-}"
if [ -z "$cublas" ] && [ ! -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
  cublas="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
export LD_LIBRARY_PATH="$here/lib${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
results="${OUT:-$here/results}"
mkdir -p "$results"
rc=0
echo "== model_cuda_test"
timeout 180 "$here/model_cuda_test" --gtest_brief=1 || rc=1
echo "== kernels_cuda_test, model ops"
timeout 60 "$here/kernels_cuda_test" --gtest_filter='ModelOps*' --gtest_brief=1 || rc=1
cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
if [ -x "$cs" ]; then
  echo "== compute-sanitizer memcheck: model_cuda_test"
  timeout 240 "$cs" --tool memcheck --error-exitcode 1 "$here/model_cuda_test" \
    --gtest_filter='*Paged*:*Decode*' --gtest_brief=1 || rc=1
fi
echo "== cuda_model_bench"
timeout 240 "$here/cuda_model_bench" --out "$results" || rc=1
if python3 -c 'import torch' 2>/dev/null; then
  echo "== cuda_model_torch"
  timeout 240 python3 "$here/cuda_model_torch.py" --out "$results" || rc=1
fi
exit "$rc"
EOF
} > "$out/model.sh"
chmod +x "$out/model.sh"

# Everything but the scripts, packed (the binaries and Debian's libraries are several times the
# carry limit unpacked).
(cd "$out" && tar -cf - --exclude=run.sh --exclude=quick.sh --exclude=model.sh --exclude=session.sh --exclude='*.py' . |
  xz -T0 -6 > bundle.tar.xz.tmp)
find "$out" -mindepth 1 -maxdepth 1 ! -name run.sh ! -name quick.sh ! -name model.sh ! -name session.sh ! -name '*.py' \
  ! -name bundle.tar.xz.tmp -exec rm -rf {} +
mv "$out/bundle.tar.xz.tmp" "$out/bundle.tar.xz"
du -sh "$out"
