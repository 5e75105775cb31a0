// Measuring what a KV codec does to a model, on token ids: perplexity (and KL divergence from a
// recorded reference) with the cache compressed as in serving, and per-layer relative errors of
// K, V and the attention output. `strata ppl` and `strata eval` report these; the calibration
// search (calibration_search.h) minimizes them.
//
// Thread-compatible: the model is only read (LlamaModel is immutable once loaded); every call
// makes its own caches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "model/compute_backend.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/llama.h"

namespace strata::model {

struct PerplexityResult {
  double ppl = 0;
  size_t scored = 0, windows = 0;  // tokens predicted, windows run
  size_t block_bytes = 0, block_elements = 0;  // every block made, and the K+V elements in them
  double seconds = 0;
  double kl = 0;  // mean KL(reference || this) over the tokens the reference covers, nats
  // Over the same tokens: the share whose most likely next token is the reference's (greedy
  // agreement one token at a time, each position given the true text before it).
  double top1 = 0;
  double bits() const { return block_elements > 0 ? 8.0 * block_bytes / block_elements : 0; }
};

// Perplexity of `ids` with the KV cache compressed as in serving (`cache`: codec, chunk, window,
// calibration), on any compute backend (the CPU's, or a GPU's: `strata ppl --device cuda`): each
// window of `context` tokens prefilled chunk by chunk, each chunk attending
// over the compressed earlier chunks (+ the full-precision window); at most `max_windows`
// windows (0: the whole text).
// Optional: `record` gets the log-probabilities of the first `kl_tokens` scored positions
// ([kl_tokens, vocab]); with `reference` (as recorded by another run on the same text) the mean
// KL divergence from it is computed over those positions: fidelity to the reference, which
// unlike perplexity cannot improve by accident.
// Errors: kInvalidArgument for fewer than 2 ids or a context below 2; the cache's and the
// model's errors otherwise.
absl::StatusOr<PerplexityResult> Perplexity(const ComputeBackend& model,
                                            const std::vector<uint32_t>& ids,
                                            const KvCacheOptions& cache, uint32_t context,
                                            uint32_t max_windows, size_t kl_tokens = 0,
                                            std::vector<float>* record = nullptr,
                                            const std::vector<float>* reference = nullptr);
// The same on the CPU backend over `model`.
absl::StatusOr<PerplexityResult> Perplexity(const LlamaModel& model,
                                            const std::vector<uint32_t>& ids,
                                            const KvCacheOptions& cache, uint32_t context,
                                            uint32_t max_windows, size_t kl_tokens = 0,
                                            std::vector<float>* record = nullptr,
                                            const std::vector<float>* reference = nullptr);

// Per layer, relative (L2) errors of one codec on a window's full-precision K/V/q.
struct LayerErrors {
  std::vector<double> k, v, attn;  // [layers measured]
  double encode_seconds = 0;
  size_t encoded_bytes_in = 0;  // fp16 bytes of the K and V encoded
};

// Encodes the window's K/V (`kv`, as LlamaModel::Forward returns it for `tokens` tokens) chunk by
// chunk with the codec, as a prefill node would (with each chunk's queries), and compares per
// layer: K and V decoded against the originals, and the attention output of the window's last
// `queries` queries over blocks + full-precision rest against attention over the original K/V.
// `only_layer` >= 0 measures that layer alone (the vectors then hold one entry).
// Errors: kInvalidArgument when the tokens before the queries hold no full chunk; the codec's
// errors otherwise.
absl::StatusOr<LayerErrors> MeasureLayerErrors(const ModelConfig& config,
                                               const std::vector<LayerKv>& kv, uint32_t tokens,
                                               const kernels::Codec& codec, uint32_t chunk,
                                               uint32_t queries, int only_layer = -1);

// The structure of a model's KV that decides how hard it is to compress (issue 44 asks for it
// before any codec is ranked on a model): per layer, how far the largest channel of K (and V)
// stands above the typical one — max over channels of each channel's max |x| over tokens and
// heads, over the median of the same — before and after the rotation stage's transform
// (kernels/rotation.h), and the attention mass the queries put on the first token (attention
// sinks), averaged over query heads and over the queries from `sink_from` on.
struct KvStructure {
  struct Layer {
    double k_spread = 0, v_spread = 0;                  // max / median of per-channel max |x|
    double k_spread_rotated = 0, v_spread_rotated = 0;  // the same after the rotation
    double first_token_mass = 0;                        // mean attention weight on token 0
    uint32_t k_top_channel = 0;                         // the channel (head * D + c) of K's max
  };
  std::vector<Layer> layers;
  uint32_t tokens = 0;
};

// From a window's K/V/q as LlamaModel::Forward returns them for `tokens` tokens. Errors:
// kInvalidArgument for no tokens, sink_from >= tokens, or a head dim the rotation does not take.
absl::StatusOr<KvStructure> MeasureKvStructure(const ModelConfig& config,
                                               const std::vector<LayerKv>& kv, uint32_t tokens,
                                               uint32_t sink_from = 16);

}  // namespace strata::model
