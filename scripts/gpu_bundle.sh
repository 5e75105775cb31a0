#!/usr/bin/env bash
# Builds the GPU test binaries (CTest label "gpu") and GPU benchmarks and gathers them, with the shared libraries they
# need that a bare CUDA machine lacks (Debian's Abseil, ...), into build/gpu-bundle/, with a
# run.sh that runs each of them there. For a lent GPU machine that has the CUDA driver and NCCL
# (a CUDA image's Python nvidia-nccl package will do) but not Debian's libraries:
#   scripts/gpu_bundle.sh            # here: build and gather
#   STRATA_COMMIT=$(git rev-parse --short HEAD) build/gpu-bundle/run.sh
#                                    # there (carry build/gpu-bundle); exit status: any failure
# NCCL itself is not copied (over 200 MB): run.sh finds libnccl.so.2 in /usr/local/cuda/lib, in
# $NCCL_LIB_DIR, or in Python's nvidia.nccl package.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(common_cuda_test kernels_cuda_test kernels_cuda_pages_test nccl_transport_test nccl_bench
         cuda_decode_bench)
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
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' |
    { grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libcuda|libnccl)\.so' || true; } |
    while read -r lib; do cp -L "$lib" "$out/lib/"; done
}
for t in "${targets[@]}"; do gather "$t" "$out"; done
for t in "${cpu_targets[@]}"; do gather "$t" "$out/cpu"; done

cp bench/cuda_sdpa_bench.py "$out/"

cat > "$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs every GPU test binary beside this script; exit status 1 if any failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nccl="${NCCL_LIB_DIR:-}"
if [ -z "$nccl" ] && [ ! -e /usr/local/cuda/lib/libnccl.so.2 ]; then
  nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
fi
export LD_LIBRARY_PATH="$here/lib${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi -L 2>/dev/null || true
rc=0
for t in "$here"/*_test; do
  echo "== $(basename "$t")"
  "$t" || rc=1
done
# Benchmarks: results land in $OUT (the device tool's) or beside this script.
results="${OUT:-$here/results}"
mkdir -p "$results"
echo "== nccl_bench"
"$here/nccl_bench" --out "$results" --commit "${STRATA_COMMIT:-unknown}" || rc=1
echo "== cuda_decode_bench"
"$here/cuda_decode_bench" --out "$results" || rc=1
# The reference: PyTorch's SDPA on fp16 KV at the same shapes, where PyTorch is there.
if python3 -c 'import torch' 2>/dev/null; then
  echo "== cuda_sdpa_bench"
  python3 "$here/cuda_sdpa_bench.py" --out "$results" || rc=1
else
  echo "== cuda_sdpa_bench: no PyTorch on this machine; skipped"
fi
# The kernels' memory checks (when the CUDA toolkit's compute-sanitizer is there).
if command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  echo "== compute-sanitizer memcheck: kernels_cuda_test"
  "$cs" --tool memcheck --error-exitcode 1 "$here/kernels_cuda_test" \
    --gtest_filter='PagedDecodeGpuTest.Fp16*:PagedDecodeGpuTest.Affine*' || rc=1
else
  echo "== compute-sanitizer: not on this machine; memcheck skipped"
fi
# The CPU's integer attention kernels where it has AVX512-VNNI: their tests on the real
# instructions (VNNI and 512-bit against AVX2, bit for bit), then the attention table with the
# 256-bit kernels and with the 512-bit ones (STRATA_ZMM=1), in one sitting.
if grep -qw avx512_vnni /proc/cpuinfo; then
  echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo)"
  "$here/cpu/kernels_test" --gtest_filter='DecodeAttentionTest.*:ZmmOpsTest.*' || rc=1
  for zmm in 0 1; do
    echo "== cpu: codec_bench attention, STRATA_ZMM=$zmm"
    STRATA_ZMM=$zmm timeout 200 "$here/cpu/codec_bench" --tables 2 --contexts 8192 \
      --codecs fp16,kivi:k2v2:g32,kivi:k4v4:g32,kcvt:k2v2,gear:k2v2:kcvt:r2:s1 \
      --out "$results" --commit "${STRATA_COMMIT:-unknown}" || rc=1
  done
else
  echo "== cpu: no AVX512-VNNI here; the 512-bit kernels' checks skipped"
fi
exit "$rc"
EOF
chmod +x "$out/run.sh"
du -sh "$out"
