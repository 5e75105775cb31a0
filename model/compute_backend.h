// The compute backend a serving node runs the model on: a model's forward passes and its
// sequences' KV caches behind one interface, so that the prefill and decode engines never reach
// into a CPU class (ggml's backends and vLLM's attention backends are the pattern). The CPU
// implementation is LlamaModel with SequenceKvCache (model/llama.h, model/kv_cache.h), the
// embedded default and the reference; a CUDA implementation is the GPU path (issue 41).
//
// What a backend promises, whatever its device:
//   - A chunk's block is the same bytes whether this backend computed it or adopted it (each
//     chunk is compressed before later tokens attend to it), so a prefix can come from any node.
//   - A sequence's tokens do not depend on the other sequences of its batch.
//   - Blocks leave and enter a cache as SharedBytes in host memory, in the Strata block format.
//
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ComputeBackend> backend,
//                           LoadComputeBackend(dir, ParseDevice("cpu").value()));
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, backend->NewCache(options));
//   STRATA_ASSIGN_OR_RETURN(std::vector<float> logits, backend->Prefill(prompt, cache.get()));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "model/config.h"

namespace strata::model {

struct KvCacheOptions;

// Where a backend computes: the CPU, or CUDA device `index`.
struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;
  std::string ToString() const;  // "cpu", "cuda:0"
};

// "cpu", "cuda" (device 0) or "cuda:N"; kInvalidArgument naming the text otherwise.
absl::StatusOr<Device> ParseDevice(absl::string_view text);

// One sequence's KV cache on a backend: compressed blocks (one per full chunk and layer) and a
// full-precision window of the newest tokens. model/kv_cache.h documents each operation.
class KvCache {
 public:
  virtual ~KvCache() = default;

  virtual Device device() const = 0;
  virtual const KvCacheOptions& options() const = 0;
  virtual uint32_t layers() const = 0;
  virtual uint32_t tokens() const = 0;         // every token cached, blocks + window
  virtual uint32_t window_tokens() const = 0;  // tokens not in blocks
  virtual size_t blocks_per_layer() const = 0;
  virtual size_t block_bytes() const = 0;  // of all blocks, every layer
  virtual double encode_seconds() const = 0;

  // The blocks of one layer (host memory, block format), for a store or the transport.
  virtual const std::vector<SharedBytes>& layer_blocks(uint32_t layer) const = 0;
  virtual BlockName NameOf(uint32_t layer, const BlockHash& key) const = 0;
  virtual std::vector<uint64_t> LayerCodecFingerprints() const = 0;

  // A prefill node's per-layer compression of the step's full chunks (from a LayerHook).
  virtual absl::StatusOr<std::vector<SharedBytes>> CompressLayer(uint32_t layer) = 0;
  // A cached prefix, block by block, then committed.
  virtual absl::Status AdoptBlock(uint32_t layer, SharedBytes block,
                                  bool checksum_verified = false) = 0;
  virtual absl::Status CommitAdopted() = 0;
  // A sequence moving between nodes: its window as bytes.
  virtual std::string ExportWindow(uint32_t layer) const = 0;
  virtual absl::Status ImportWindow(uint32_t layer, absl::Span<const uint8_t> bytes) = 0;
  virtual absl::Status CommitWindow() = 0;
  // Forgets every block and window (a preempted sequence).
  virtual void Clear() = 0;
};

// Called after every layer of a step, once that layer is done for every sequence of the batch:
// a prefill node compresses the layer's new chunks there (KvCache::CompressLayer) and ships them
// while the next layer computes. An error ends the step; the caches discard its tokens.
using LayerHook = std::function<absl::Status(uint32_t layer)>;

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;

  virtual Device device() const = 0;
  virtual const ModelConfig& config() const = 0;
  // Names this model's KV blocks (the config's shape and the checkpoint).
  virtual uint64_t fingerprint() const = 0;

  // A cache shaped for this model, on this backend's device.
  virtual absl::StatusOr<std::unique_ptr<KvCache>> NewCache(
      const KvCacheOptions& options) const = 0;

  // Prefill as serving runs it: `tokens` on top of what the cache holds, each chunk compressed
  // before later tokens attend to it; `hook` after each layer of each piece; `piece_logits`, when
  // set, gets every token's logits a piece at a time (prompt logprobs). Returns the last token's
  // logits [vocab]. LlamaModel::Prefill documents the details.
  using PieceLogits = std::function<void(size_t first, absl::Span<const float> logits)>;
  virtual absl::StatusOr<std::vector<float>> Prefill(
      absl::Span<const uint32_t> tokens, KvCache* cache, const LayerHook& hook = nullptr,
      const PieceLogits& piece_logits = nullptr) const = 0;

  // One step for a batch of sequences, each on its own cache: returns each sequence's logits
  // [its tokens, vocab].
  virtual absl::StatusOr<std::vector<std::vector<float>>> StepBatch(
      absl::Span<const absl::Span<const uint32_t>> tokens, absl::Span<KvCache* const> caches,
      const LayerHook& hook = nullptr) const = 0;
};

// Prefill's pieces, for every backend alike: `tokens`, whose first sits at position `position`
// of its sequence, cut at the sequence's `chunk_tokens` boundaries (the last piece may end short).
// `run(piece, last_only)` computes and commits one piece and returns its logits: [piece tokens,
// vocab], or with last_only the last token's [vocab]. `piece_logits` (when set) gets each piece's
// as ComputeBackend::Prefill says; returns the last token's logits. `who` names the backend in
// errors.
using RunPiece = std::function<absl::StatusOr<std::vector<float>>(
    absl::Span<const uint32_t> piece, bool last_only)>;
absl::StatusOr<std::vector<float>> PrefillInPieces(absl::Span<const uint32_t> tokens,
                                                   uint32_t position, uint32_t chunk_tokens,
                                                   uint32_t vocab, const RunPiece& run,
                                                   const ComputeBackend::PieceLogits& piece_logits,
                                                   absl::string_view who);

// Loads the model in `model_dir` (config.json + safetensors) onto `device`: the CPU backend, or
// for a CUDA device the loader a binary linking the CUDA backend registered
// (SetCudaBackendLoader; serving/node_flags.cc does for the node mains). kUnimplemented for a
// CUDA device without one, saying so and what to use.
absl::StatusOr<std::unique_ptr<ComputeBackend>> LoadComputeBackend(const std::string& model_dir,
                                                                   const Device& device);

using BackendLoader = std::function<absl::StatusOr<std::unique_ptr<ComputeBackend>>(
    const std::string& model_dir, const Device& device)>;
// The loader LoadComputeBackend uses for CUDA devices (model/cuda/cuda_backend.h's
// LoadCudaBackend with the process's options); null: none. Thread-safe.
void SetCudaBackendLoader(BackendLoader loader);

}  // namespace strata::model
