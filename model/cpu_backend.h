// The CPU compute backend (compute_backend.h): LlamaModel's fp32 forward passes over
// SequenceKvCache, the embedded default and the reference every other backend is tested against.
//
// Thread-compatible like LlamaModel: Prefill and StepBatch may run concurrently on distinct caches.
#pragma once

#include <memory>
#include <vector>

#include "model/compute_backend.h"
#include "model/kv_cache.h"
#include "model/llama.h"

namespace strata::model {

class CpuBackend final : public ComputeBackend {
 public:
  // Owns `model`.
  explicit CpuBackend(std::unique_ptr<LlamaModel> model);
  // Borrows `model`, which must outlive the backend (tests, tools that hold the model).
  explicit CpuBackend(const LlamaModel* model);

  const LlamaModel& model() const { return *model_; }

  Device device() const override { return Device{}; }
  const ModelConfig& config() const override { return model_->config(); }
  uint64_t fingerprint() const override { return model_->fingerprint(); }
  absl::StatusOr<std::unique_ptr<KvCache>> NewCache(const KvCacheOptions& options) const override;
  absl::StatusOr<std::vector<float>> Prefill(
      absl::Span<const uint32_t> tokens, KvCache* cache, const LayerHook& hook = nullptr,
      const PieceLogits& piece_logits = nullptr) const override;
  absl::StatusOr<std::vector<std::vector<float>>> StepBatch(
      absl::Span<const absl::Span<const uint32_t>> tokens, absl::Span<KvCache* const> caches,
      const LayerHook& hook = nullptr) const override;

 private:
  std::unique_ptr<LlamaModel> owned_;
  const LlamaModel* model_;
};

// `cache` as the CPU's cache; kInvalidArgument for a cache of another backend (or null).
absl::StatusOr<SequenceKvCache*> AsCpuCache(KvCache* cache);

}  // namespace strata::model
