#!/usr/bin/env bash
# Builds the GPU test binaries (CTest label "gpu") and GPU benchmarks and gathers them, with the shared libraries they
# need that a bare CUDA machine lacks (Debian's Abseil, ...), into build/gpu-bundle/, with a
# run.sh that runs each of them there. For a lent GPU machine that has the CUDA driver and NCCL
# (a CUDA image's Python nvidia-nccl package will do) but not Debian's libraries:
#   scripts/gpu_bundle.sh [--cpu]    # here: build and gather (--cpu: only the CPU binaries, for a
#                                    # lent machine's CPU; run.sh then runs only their part)
#   STRATA_COMMIT=$(git rev-parse --short HEAD) build/gpu-bundle/session.sh [STEP...]
#                                    # there (carry build/gpu-bundle): scripts/gpu_session.sh
#                                    # says the steps; run.sh, quick.sh and model.sh are it
#                                    # with chosen steps. Exit status: any failure
# NCCL and cuBLAS are not copied (hundreds of MB): run.sh finds libnccl.so.2 in
# /usr/local/cuda/lib, in $NCCL_LIB_DIR, or in Python's nvidia.nccl package, and libcublas.so.13
# in /usr/local/cuda/lib64 or Python's nvidia.cublas package. Tests that read the repository's
# models and fixtures find it through STRATA_SOURCE_DIR (the checkout around build/gpu-bundle).
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(common_cuda_test kernels_cuda_test kernels_cuda_pages_test model_cuda_test strata_cuda_plugin
         nccl_transport_test nccl_bench cuda_decode_bench cuda_model_bench cuda_backend_bench)
case "${1:-}" in
  --cpu) targets=() ;;
  "") ;;
  *) echo "gpu_bundle.sh: unknown argument $1 (--cpu or nothing)" >&2; exit 2 ;;
esac
# CPU binaries for the lent machine's own CPU (often one with AVX-512): run.sh runs the integer
# attention kernels' tests and benchmark there, 256-bit against 512-bit registers.
cpu_targets=(kernels_test codec_bench)
./scripts/build.sh --cuda-code full $(printf -- "--target %s " "${targets[@]}" "${cpu_targets[@]}")

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
for t in "${targets[@]+"${targets[@]}"}"; do
  case "$t" in
    # The node binaries' CUDA plugin, beside model_cuda_test (which opens it there).
    strata_cuda_plugin) gather libstrata_cuda.so "$out" ;;
    *) gather "$t" "$out" ;;
  esac
done
for t in "${cpu_targets[@]}"; do gather "$t" "$out/cpu"; done

cp bench/cuda_sdpa_bench.py bench/cuda_model_torch.py "$out/"
# session.sh: everything above in one call under a deadline, logs back through $OUT.
cp scripts/gpu_session.sh "$out/session.sh"

# run.sh, quick.sh and model.sh: session.sh with chosen steps (gpu_session.sh says what each
# runs). run.sh: everything, the CPU's AVX-512 checks too; quick.sh: the paged decode alone (its
# tests, sanitizers, cuda_decode_bench and SDPA: about 20 s); model.sh: the model and the backend
# (their tests, memcheck, cuda_model_bench and PyTorch's at the same shapes: about a minute).
wrapper() {  # NAME STEPS...
  local name="$1"; shift
  printf '#!/usr/bin/env bash\nexec "$(dirname "$0")/session.sh" %s "$@"\n' "$*" > "$out/$name"
  chmod +x "$out/$name"
}
wrapper run.sh pages kernels model common decode sdpa mbench mtorch bbench memcheck racecheck \
  opsmem opsrace mmemcheck nccl cpu
wrapper quick.sh pages kernels memcheck racecheck decode sdpa
wrapper model.sh model kernels mmemcheck mbench mtorch bbench

# Everything but the scripts, packed (the binaries and Debian's libraries are several times the
# carry limit unpacked).
# The archive is written beside the folder, not in it: tar would see the folder change under it.
(cd "$out" && tar -cf - --exclude=run.sh --exclude=quick.sh --exclude=model.sh --exclude=session.sh --exclude='*.py' . |
  xz -T0 -6 > ../gpu-bundle.tar.xz.tmp)
find "$out" -mindepth 1 -maxdepth 1 ! -name run.sh ! -name quick.sh ! -name model.sh ! -name session.sh ! -name '*.py' \
  -exec rm -rf {} +
mv build/gpu-bundle.tar.xz.tmp "$out/bundle.tar.xz"
du -sh "$out"
