// A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU; Llama, Mistral and
// Qwen2 checkpoints) running on the CPU in fp32 (matrix products: model/matmul.h). The engines
// reach it through CpuBackend (cpu_backend.h), the CPU compute backend.
//
// Load() reads config.json and the safetensors checkpoint of a Hugging Face model folder,
// checks every tensor's presence, dtype and shape against the config (kInvalidArgument naming
// the tensor), and converts the weights to fp32.
//
// Forward() runs a prompt from position 0 and returns the logits of every position and, when
// asked, each layer's K (after RoPE) and V — the KV cache a prefill node compresses. Attention
// runs through kernels::DecodeAttention in its several-query-tokens (prefill) mode.
//
// Thread-compatible: a loaded model is immutable; Forward may run concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/compute_backend.h"
#include "model/config.h"
#include "model/kv_cache.h"

namespace strata::model {

// One layer's KV for a token range: [tokens, kv_heads, head_dim] each, fp32.
struct LayerKv {
  std::vector<float> k;  // [tokens, kv_heads, head_dim], after RoPE
  std::vector<float> v;  // [tokens, kv_heads, head_dim]
  std::vector<float> q;  // [tokens, heads, head_dim], after RoPE
};

class LlamaModel {
 public:
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  // Names this model's KV blocks: covers the config's shape and the checkpoint (tensor headers
  // and the first MiB of each shard's data), so a fine-tune never shares blocks with its base.
  // ModelFingerprint(dir) computes the same without loading the weights.
  uint64_t fingerprint() const { return fingerprint_; }

  // Logits [tokens, vocab] of a prompt from position 0, all in full precision. `kv`
  // (optional) receives one LayerKv per layer.
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const uint32_t> tokens,
                                             std::vector<LayerKv>* kv = nullptr) const;

  // Runs `tokens` at positions cache->tokens()... on top of what the cache holds (compressed
  // blocks + window): prefill of a prompt or of a suffix over a cached prefix, or one decode
  // step. The new tokens' K and V join the cache, which then compresses any full chunk.
  // Returns the logits [tokens, vocab].
  absl::StatusOr<std::vector<float>> Step(absl::Span<const uint32_t> tokens,
                                          SequenceKvCache* cache) const;

  // Prefill as serving runs it: `tokens` on top of what the cache holds, in pieces that end on
  // the sequence's chunk boundaries (the last may end short), each piece committed before the
  // next, so every chunk is compressed before later tokens attend to it. A chunk's block is
  // then the same bytes whether this node computed it or adopted it from a store or a peer: the
  // output never depends on where a prefix came from. Needs a cache without an always-full-
  // precision window (KvCacheOptions::window_tokens == 0; kInvalidArgument otherwise). `hook`
  // runs after each layer of each piece. Returns the logits of the last token [vocab].
  // `piece_logits`, when set, gets every token's logits, a piece at a time: the index in `tokens`
  // of the piece's first token and its logits [piece tokens, vocab] (prompt logprobs).
  using PieceLogits = ComputeBackend::PieceLogits;
  absl::StatusOr<std::vector<float>> Prefill(absl::Span<const uint32_t> tokens,
                                             SequenceKvCache* cache,
                                             const LayerHook& hook = nullptr,
                                             const PieceLogits& piece_logits = nullptr) const;

  // Step for a batch of sequences at once, each on its own cache (distinct caches): the matrix
  // products run over all sequences' new tokens together, attention per sequence. Returns
  // each sequence's logits [its tokens, vocab].
  absl::StatusOr<std::vector<std::vector<float>>> StepBatch(
      absl::Span<const absl::Span<const uint32_t>> tokens,
      absl::Span<SequenceKvCache* const> caches, const LayerHook& hook = nullptr) const;

  // A cache shaped for this model.
  absl::StatusOr<std::unique_ptr<SequenceKvCache>> NewCache(KvCacheOptions options) const;

  // The weights at fp32, for another backend to load (model/cuda/): matrices [out, in].
  struct Layer {
    std::vector<float> input_norm, post_norm;
    std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo;  // [out, in]; biases empty when absent
    std::vector<float> w_gate, w_up, w_down;
  };
  const std::vector<Layer>& layers() const { return layers_; }
  const std::vector<float>& embed() const { return embed_; }        // [vocab, hidden]
  const std::vector<float>& final_norm() const { return norm_; }    // [hidden]
  const std::vector<float>& lm_head() const { return lm_head_; }    // empty when tied to embed()
  const std::vector<float>& inv_freq() const { return inv_freq_; }  // RoPE, scaling applied

 private:
  LlamaModel() = default;
  void Rope(float* x, uint32_t position0, uint32_t tokens, uint32_t heads) const;
  absl::StatusOr<std::vector<float>> Run(absl::Span<const uint32_t> tokens, SequenceKvCache* cache,
                                         std::vector<LayerKv>* kv) const;
  // `last_only`: logits of each sequence's last token only ([vocab] per sequence).
  absl::StatusOr<std::vector<std::vector<float>>> RunBatch(
      absl::Span<const absl::Span<const uint32_t>> seqs, absl::Span<SequenceKvCache* const> caches,
      std::vector<LayerKv>* kv, const LayerHook& hook = nullptr, bool last_only = false) const;

  ModelConfig config_;
  uint64_t fingerprint_ = 0;
  std::vector<float> embed_;    // [vocab, hidden]
  std::vector<float> norm_;     // [hidden]
  std::vector<float> lm_head_;  // [vocab, hidden]; empty when tied to embed_
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;  // [head_dim / 2], with rope scaling applied
};

// LlamaModel::fingerprint() of the checkpoint in `dir`, from its config and its shards' headers
// and first MiB, without reading the weights (a router names blocks with it).
absl::StatusOr<uint64_t> ModelFingerprint(const std::string& dir);

}  // namespace strata::model
