// The model's elementwise and reduction steps on the GPU (the matrix products are cuBLAS's, in
// model/cuda/): embedding rows, RMSNorm, rotary position embedding, bias, SwiGLU, residual adds,
// conversions, dense causal attention over a full-precision KV cache, and greedy argmax. Each
// mirrors model/llama.cc's CPU arithmetic (fp32 activations; RMSNorm's sum of squares and RoPE's
// angles in double, as there), so that the CUDA model's logits track the CPU engine's.
//
// Activations are fp32; the inputs of the matrix products are `T` (__half or __nv_bfloat16, the
// weights' type). Every pointer is a device pointer; launches go on `stream`, report launch
// errors as absl::Status and do not synchronize.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace strata::kernels::cuda {

// x[i] = table[ids[i]] (rows of `hidden`), widened to fp32.
template <typename T>
absl::Status EmbedRows(const T* table, const int32_t* ids, int rows, int hidden, float* x,
                       cudaStream_t stream);

// out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, per row of `d`, as T (the next product's input).
template <typename T>
absl::Status RmsNormRows(const float* x, const float* w, int rows, int d, double eps, T* out,
                         cudaStream_t stream);

// y[i][j] += b[j] (rows of `d`).
absl::Status AddBias(float* y, const float* b, int rows, int d, cudaStream_t stream);

// Rotates the (i, i + D/2) channel pairs of each of `heads` heads of row r by the angle
// positions[r] * inv_freq[i] (Hugging Face's rotate_half), in place: x [rows][heads][D].
absl::Status Rope(float* x, const int32_t* positions, const float* inv_freq, int rows, int heads,
                  int head_dim, cudaStream_t stream);

// out[i] = silu(gate[i]) * up[i], as T.
template <typename T>
absl::Status SwiGlu(const float* gate, const float* up, size_t n, T* out, cudaStream_t stream);

// x[i] += y[i].
absl::Status AddInPlace(float* x, const float* y, size_t n, cudaStream_t stream);

// out[i] = T(in[i]).
template <typename T>
absl::Status Narrow(const float* in, size_t n, T* out, cudaStream_t stream);

// Causal attention of `rows` query tokens over a sequence's full-precision KV: query row r (at
// position positions[r]) attends to keys 0..positions[r]. q [rows][q_heads][D], k and v
// [kv_heads][capacity][D] (the cache, every position up to the largest written), out
// [rows][q_heads][D]; GQA groups of q_heads / kv_heads. Softmax scale 1/sqrt(D).
// Two kernels:
//   - tensor cores (head_dim 64 or 128, unless `exact`): 64 query rows x one head per block,
//     keys in tiles of 64 through shared memory, Q.K^T and P.V by mma.sync m16n8k16 on fp16
//     operands with fp32 sums, an online softmax in fp32 (FlashAttention-2's scheme). Operands
//     rounded to fp16: relative error ~1e-3.
//   - exact (any head_dim a multiple of 32 up to 256): one warp per (row, head), fp32 throughout;
//     slow (every key read once per row and head), the reference.
// Either way a row's output depends only on its query, its position and the keys: the same bits
// whatever other rows share the launch (a decode step equals the same token in a prefill).
struct DenseAttentionArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const int32_t* positions = nullptr;
  float* out = nullptr;
  int rows = 0, q_heads = 0, kv_heads = 0, head_dim = 0, capacity = 0;
  bool exact = false;  // the fp32 SIMT kernel even where the tensor-core one applies
};
absl::Status DenseAttention(const DenseAttentionArgs& args, cudaStream_t stream);

// Writes rows' K and V [rows][kv_heads][D] into the cache [kv_heads][capacity][D] at their
// positions.
absl::Status WriteKv(const float* k, const float* v, const int32_t* positions, int rows,
                     int kv_heads, int head_dim, int capacity, float* cache_k, float* cache_v,
                     cudaStream_t stream);

// Appends one token per sequence to its fp16 window (paged_decode.h's window pool): sequence b's
// K and V [batch][kv_heads][D] go to row slots[b] at index lens[b] of window_k/v
// [slots][kv_heads][max_window][D]. lens[b] < max_window.
absl::Status AppendWindow(const float* k, const float* v, const int32_t* slots, const int32_t* lens,
                          int batch, int kv_heads, int head_dim, int max_window, __half* window_k,
                          __half* window_v, cudaStream_t stream);

// Deterministic pseudo-random values for benchmark weights: uniform in [-scale, scale) from
// (seed, index), written as T (or fp32).
template <typename T>
absl::Status FillUniform(T* out, size_t n, float scale, uint64_t seed, cudaStream_t stream);

// index[r] = argmax of logits row r (the lowest index among equal maxima), rows of `vocab`.
absl::Status ArgmaxRows(const float* logits, int rows, int vocab, int32_t* index,
                        cudaStream_t stream);

}  // namespace strata::kernels::cuda
