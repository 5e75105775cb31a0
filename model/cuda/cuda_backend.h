// The CUDA compute backend (compute_backend.h): a serving node's model on a GPU, its sequences'
// KV caches in device memory, with the CPU backend's semantics.
//
// Each sequence's cache is the CPU's SequenceKvCache on the host (blocks in the Strata block
// format, the full-precision window, compression by the CPU codec: the blocks a node ships, stores
// and adopts, byte for byte the format every node reads) mirrored on the device:
//   - every block copied as it is into a page of the backend's device page pool (pages are
//     blocks read in place by the paged attention, kernels/cuda/paged_decode.h);
//   - the window in fp16 rows of a slot of the backend's window pool.
// A step (CudaLlamaModel::DecodePaged) runs every new token as a row: the products over all rows,
// each row attending to its sequence's pages and its window up to itself, so a prefill piece and
// a batch of decode tokens are the same kernel sequence. Each layer's new K and V come back to
// the host cache (8 KiB per token and layer at an 8B model's shape), which compresses full chunks
// as the CPU does; new blocks go up as pages before the next step. A chunk's block is therefore
// compressed before later tokens attend to it, as on the CPU: the same bytes whether this node
// computed it or adopted it.
//
// The node binaries do not link it: they open it as a plugin, libstrata_cuda.so (model/cuda_plugin.h;
// cluster/CMakeLists.txt says why: thread-local storage). What it does not do yet (issue 41): compression on the GPU
// (compress.cu writes KIVI pages; the host codec runs here so that every codec's bytes stay the
// CPU's), codecs without a page layout (GEAR, ZipCache, SKVQ, TaDA, int8, fp8, sinks, the Strata
// mix: refused at NewCache, naming the codec), attention splits fixed per sequence (a row's logits
// can differ in the last bits with the batch it runs in), sampling on the device.
//
// Thread-safe: steps run one at a time on the device (a mutex); caches may be created and dropped
// from any thread. A step holds the backend's lock while it calls its LayerHook: the hook may call
// the cache's CompressLayer (a prefill node's compression) and anything outside this backend, but
// not this backend or its caches' AdoptBlock, Clear or destruction.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/compute_backend.h"
#include "model/cuda/cuda_llama.h"
#include "model/llama.h"

namespace strata::model::cuda {

struct CudaBackendOptions {
  int device = 0;
  WeightType weights = WeightType::kBf16;
  // Device memory for KV pages; 0: 90 % of what is free once the weights and windows are in.
  uint64_t kv_pool_bytes = 0;
  // Sequences that may hold a cache at once (each a window slot on the device).
  uint32_t max_sequences = 64;
  // Tokens one sequence may add in one step beyond one chunk (the window's spare rows).
  uint32_t max_step_tokens = 16;
  bool cuda_graphs = true;  // decode steps replayed as CUDA graphs (CudaModelOptions)
};

// `host`'s weights uploaded to the GPU (`host` is not kept). kFailedPrecondition without a usable
// GPU, kResourceExhausted when the weights or the pools do not fit (saying how much is needed),
// kInvalidArgument for a shape the GPU kernels do not take (head dim other than 64 or 128, more
// than 8 query heads per KV head), naming it.
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackend(const LlamaModel& host,
                                                                const CudaBackendOptions& options);

// A backend over a model of `config`'s shape with pseudo-random weights made on the device (the
// benchmarks' 8B shape needs no checkpoint); its blocks are named by `seed`. Errors as above.
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeRandomCudaBackend(
    const ModelConfig& config, const CudaBackendOptions& options, uint64_t seed = 1);

// Loads the checkpoint in `model_dir` and makes the backend on `device` (options.device is
// replaced by device.index).
absl::StatusOr<std::unique_ptr<ComputeBackend>> LoadCudaBackend(const std::string& model_dir,
                                                                const Device& device,
                                                                CudaBackendOptions options = {});

}  // namespace strata::model::cuda
