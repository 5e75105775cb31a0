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
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cuda/paged_decode.h"
#include "model/config.h"
#include "model/llama.h"

namespace strata::model::cuda {

struct CublasLibrary;  // cublas_library.h

enum class WeightType { kBf16, kFp16 };

struct CudaModelOptions {
  int device = 0;                          // CUDA device index
  WeightType weights = WeightType::kBf16;  // the products' input type
  // Step's attention by the fp32 SIMT kernel instead of the tensor cores (fp16 operands): the
  // reference, slow (model_ops.h, DenseAttentionArgs::exact).
  bool exact_attention = false;
  // DecodePaged captures its step (every kernel and product from the embedding to the argmax) as
  // a CUDA graph and replays it while the batch's shape and buffers repeat: one launch per step
  // instead of ~20 per layer. Captured again when they change.
  bool cuda_graphs = true;
};

class CudaLlamaModel {
 public:
  // Copies `host`'s weights to device `options.device` (converted to options.weights).
  // kFailedPrecondition without a usable device (naming why), kResourceExhausted when the weights
  // do not fit (saying how many bytes are needed and how many are free), kInvalidArgument for a
  // head size the kernels do not take.
  static absl::StatusOr<std::unique_ptr<CudaLlamaModel>> Upload(const LlamaModel& host,
                                                                const CudaModelOptions& options);
  // A model of `config`'s shape with deterministic pseudo-random weights made on the device (the
  // benchmarks' 8B shape needs no checkpoint and no host copy). Errors as Upload's.
  static absl::StatusOr<std::unique_ptr<CudaLlamaModel>> Random(const ModelConfig& config,
                                                                const CudaModelOptions& options,
                                                                uint64_t seed = 1);
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
    void Clear() { tokens_ = 0; }  // empty again (its memory kept)
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
  // [tokens, vocab], or with `every_row` false the last token's [vocab] only (what sampling
  // needs: no products or copies for the prompt's other rows). kInvalidArgument for tokens
  // beyond the vocabulary or the cache's capacity.
  absl::StatusOr<uint32_t> Step(absl::Span<const uint32_t> tokens, DenseKv* kv,
                                std::vector<float>* logits = nullptr, bool every_row = true) const;

  // One decode step for a batch of sequences whose KV is in pages (blocks read in place,
  // kernels/cuda/paged_decode.h) plus an fp16 window each: every sequence's new token is
  // appended to its window (row window_slots[b], at index window_lens[b]), then attends over its
  // pages and its window. Pages, block tables, page counts and windows are the caller's device
  // memory; the spans are host memory.
  struct PagedStep {
    absl::Span<const uint32_t> tokens;    // one per sequence
    absl::Span<const int32_t> positions;  // each new token's position
    absl::Span<const int32_t> window_slots;
    absl::Span<const int32_t> window_lens;          // tokens in each window before the step
    kernels::cuda::PagedKvLayout layout;            // every layer's pages
    // Each layer's own, where they differ (a Strata mix's layers of CQ alone are codebook pools,
    // block_pages.h PageLayoutForCodec); empty: `layout` for every layer. The same pool.
    absl::Span<const kernels::cuda::PagedKvLayout> layer_layouts;
    const uint8_t* pages = nullptr;                 // the pool
    // General pages (layout.format kGeneral): descriptors, each page's index, calibration
    // constants (kernels/cuda/paged_decode.h PagedDecodeArgs).
    const kernels::cuda::PageDesc* page_descs = nullptr;
    const uint16_t* page_desc_ids = nullptr;
    const uint8_t* constants = nullptr;
    absl::Span<const int32_t* const> block_tables;  // per layer: [batch][max_pages]
    int max_pages = 0;
    const int32_t* page_counts = nullptr;  // [batch]
    int max_pages_in_batch = 0;
    __half* window_k = nullptr;  // [layers][slots][kv_heads][max_window][head_dim]
    __half* window_v = nullptr;
    int slots = 0, max_window = 0;
    // Where each layer's new K (after RoPE) and V rows go, when not null: device memory
    // [layers][2][tokens][kv_heads * head_dim] fp32 (what a host-side cache appends).
    float* save_kv = nullptr;
    // Called after each layer, the stream synchronized (save_kv holds that layer's rows): a
    // prefill node's per-layer compression. An error ends the step. Steps with it are never
    // captured as graphs.
    std::function<absl::Status(uint32_t layer)> after_layer;
    bool last_row_only = false;  // logits (and the greedy token) of the last row only
    // Capture the step as a CUDA graph (CudaModelOptions::cuda_graphs) and replay it while the
    // shapes and buffers repeat: for decode steps, not for prefill pieces of changing sizes.
    bool graph = true;
  };
  // Rows may repeat a sequence (its block table and window slot) with consecutive positions and
  // window lengths: a prefill piece, each row attending to the window up to itself.
  // Returns each row's greedy next token; `logits`, when not null, gets [rows, vocab] ([vocab]
  // with last_row_only).
  // kInvalidArgument for inconsistent spans, a window with no room, or a layout that is not this
  // model's shape.
  absl::StatusOr<std::vector<uint32_t>> DecodePaged(const PagedStep& step,
                                                    std::vector<float>* logits = nullptr) const;
  // The stream every step runs on (a cudaStream_t): a caller's copies into buffers that a step
  // reads (pages, block tables, windows) go on it, so the step sees them.
  void* stream() const { return stream_; }
  // CudaModelOptions' switches, changed between steps (the benchmarks time both ways).
  void SetCudaGraphs(bool on) { options_.cuda_graphs = on; }
  void SetExactAttention(bool on) { options_.exact_attention = on; }
  // DecodePaged's steps that replayed a captured graph, and its captures (CudaModelOptions).
  uint64_t graph_replays() const { return graph_replays_; }
  uint64_t graph_captures() const { return graph_captures_; }

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
  absl::StatusOr<void*> Alloc(size_t bytes, absl::string_view what);
  absl::Status Init(const ModelConfig& config, const CudaModelOptions& options);
  // Runs the layers and the vocabulary over `n` rows already embedded in the scratch's x, with
  // `attend(layer)` computing s.att from s.q, s.k, s.v; the greedy tokens of the last `out_rows`
  // rows into `next`, their logits into `logits` when asked.
  template <typename Attend>
  absl::Status Forward(int n, int out_rows, const Attend& attend, std::vector<int32_t>* next,
                       std::vector<float>* logits) const;
  // Forward's parts: room for out_rows rows of logits (before a capture: no allocation may happen
  // inside one); the device work, stream-ordered only (capturable); the copies back and the wait.
  absl::Status EnsureLogits(int out_rows) const;
  template <typename Attend>
  absl::Status ForwardOnDevice(
      int n, int out_rows, const Attend& attend,
      const std::function<absl::Status(uint32_t)>* after_layer = nullptr) const;
  absl::Status Collect(int out_rows, std::vector<int32_t>* next, std::vector<float>* logits) const;
  absl::Status Gemm(const void* x, int rows, int in, const void* w, int out, float* y) const;

  ModelConfig config_;
  CudaModelOptions options_;
  void* stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;  // cublasHandle_t
  const CublasLibrary* blas_ = nullptr;  // cublas_library.h: loaded, not linked
  std::vector<void*> allocations_;
  size_t weight_bytes_ = 0;
  const void* embed_ = nullptr;    // [vocab, hidden], weight type
  const void* lm_head_ = nullptr;  // embed_ when tied
  const float* norm_ = nullptr;
  const float* inv_freq_ = nullptr;
  std::vector<Layer> layers_;
  mutable std::unique_ptr<Scratch> scratch_;
  mutable void* paged_ = nullptr;  // DecodePaged's own buffers (workspace, slots, lengths)
  mutable size_t paged_bytes_ = 0;
  mutable void* graph_ = nullptr;  // cudaGraphExec_t of DecodePaged's step, for graph_key_
  mutable std::vector<uint64_t> graph_key_;
  mutable uint64_t graph_replays_ = 0, graph_captures_ = 0;
};

}  // namespace strata::model::cuda
