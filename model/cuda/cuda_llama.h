// The Llama-family model (model/llama.h's: Llama, Mistral, Qwen2 checkpoints) on a CUDA device:
// weights resident in device memory in bf16 or fp16, matrix products by cuBLAS (fp32
// accumulation and outputs), RMSNorm, RoPE, SwiGLU, embedding, biases and residuals as kernels
// (kernels/cuda/model_ops.h), activations in fp32, greedy decoding on the device: logits are
// copied back only when asked.
//
// This is the model's forward pass with a full-precision KV cache on the device per sequence
// (DenseKv): what the parity tests hold against the CPU engine and what `strata generate
// --device cuda` needs. The serving engines' compressed pages (each chunk compressed before later
// tokens attend to it, paged_decode.h's kernels) are the CUDA compute backend's next step
// (issue 41); until then the nodes refuse --device cuda.
//
// Not thread-safe: one caller at a time (it keeps one stream, one cuBLAS handle and its scratch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/config.h"
#include "model/llama.h"

namespace strata::model::cuda {

enum class WeightType { kBf16, kFp16 };

struct CudaModelOptions {
  int device = 0;                          // CUDA device index
  WeightType weights = WeightType::kBf16;  // the products' input type
};

class CudaLlamaModel {
 public:
  // Copies `host`'s weights to device `options.device` (converted to options.weights).
  // kFailedPrecondition without a usable device (naming why), kResourceExhausted when the weights
  // do not fit (saying how many bytes are needed and how many are free), kInvalidArgument for a
  // head size the kernels do not take.
  static absl::StatusOr<std::unique_ptr<CudaLlamaModel>> Upload(const LlamaModel& host,
                                                                const CudaModelOptions& options);
  ~CudaLlamaModel();
  CudaLlamaModel(const CudaLlamaModel&) = delete;
  CudaLlamaModel& operator=(const CudaLlamaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  size_t weight_bytes() const { return weight_bytes_; }

  // One sequence's K and V at fp32 on the device, room for `capacity` tokens.
  class DenseKv {
   public:
    ~DenseKv();
    DenseKv(const DenseKv&) = delete;
    DenseKv& operator=(const DenseKv&) = delete;
    uint32_t tokens() const { return tokens_; }
    uint32_t capacity() const { return capacity_; }
    size_t bytes() const { return bytes_; }

   private:
    friend class CudaLlamaModel;
    DenseKv() = default;
    float* k_ = nullptr;  // [layers][kv_heads][capacity][head_dim]
    float* v_ = nullptr;
    uint32_t tokens_ = 0, capacity_ = 0;
    size_t bytes_ = 0;
  };
  // kResourceExhausted when the device lacks the memory, saying how much is needed.
  absl::StatusOr<std::unique_ptr<DenseKv>> NewKv(uint32_t capacity) const;

  // Runs `tokens` at positions kv->tokens().. on top of what `kv` holds (a prompt, or one decode
  // step), appending their K and V. Returns the greedy next token (the argmax of the last
  // token's logits, on the device); `logits`, when not null, receives every token's logits
  // [tokens, vocab]. kInvalidArgument for tokens beyond the vocabulary or the cache's capacity.
  absl::StatusOr<uint32_t> Step(absl::Span<const uint32_t> tokens, DenseKv* kv,
                                std::vector<float>* logits = nullptr) const;

 private:
  struct Layer {
    const float *input_norm = nullptr, *post_norm = nullptr;
    const void *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    const void *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr;  // null when absent
  };
  struct Scratch;
  CudaLlamaModel() = default;
  absl::Status EnsureScratch(uint32_t rows) const;
  absl::Status Gemm(const void* x, int rows, int in, const void* w, int out, float* y) const;

  ModelConfig config_;
  CudaModelOptions options_;
  void* stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;  // cublasHandle_t
  std::vector<void*> allocations_;
  size_t weight_bytes_ = 0;
  const void* embed_ = nullptr;    // [vocab, hidden], weight type
  const void* lm_head_ = nullptr;  // embed_ when tied
  const float* norm_ = nullptr;
  const float* inv_freq_ = nullptr;
  std::vector<Layer> layers_;
  mutable std::unique_ptr<Scratch> scratch_;
};

}  // namespace strata::model::cuda
