#include <cfloat>
#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/model_ops.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kWarp = 32;

absl::Status Launched(const char* what) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

template <typename T>
__device__ __forceinline__ float Widen(T x);
template <>
__device__ __forceinline__ float Widen(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float Widen(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
__device__ __forceinline__ T NarrowTo(float x);
template <>
__device__ __forceinline__ __half NarrowTo(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 NarrowTo(float x) {
  return __float2bfloat16_rn(x);
}

int Blocks(size_t n, int threads) {
  const size_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 16 ? b : 65535 * 16);
}

template <typename T>
__global__ void EmbedKernel(const T* table, const int32_t* ids, int hidden, float* x) {
  const int r = blockIdx.x;
  const T* row = table + static_cast<size_t>(ids[r]) * hidden;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
    x[static_cast<size_t>(r) * hidden + j] = Widen(row[j]);
  }
}

// One block per row; the sum of squares in double, as the CPU's.
template <typename T>
__global__ void RmsNormKernel(const float* x, const float* w, int d, double eps, T* out) {
  __shared__ double partial[32];
  const int r = blockIdx.x;
  const float* xr = x + static_cast<size_t>(r) * d;
  double ss = 0;
  for (int j = threadIdx.x; j < d; j += blockDim.x) ss += static_cast<double>(xr[j]) * xr[j];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = ss;
  __syncthreads();
  if (threadIdx.x < kWarp) {
    double s = threadIdx.x < blockDim.x / kWarp ? partial[threadIdx.x] : 0.0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) partial[0] = s;
  }
  __syncthreads();
  const float inv = static_cast<float>(1.0 / sqrt(partial[0] / d + eps));
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    out[static_cast<size_t>(r) * d + j] = NarrowTo<T>(xr[j] * inv * w[j]);
  }
}

__global__ void AddBiasKernel(float* y, const float* b, int d, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    y[i] += b[i % d];
  }
}

// One block per row; thread i of each head's pairs; the angle in double, as the CPU's.
__global__ void RopeKernel(float* x, const int32_t* positions, const float* inv_freq, int heads,
                           int head_dim) {
  const int r = blockIdx.x;
  const int half = head_dim / 2;
  const double pos = positions[r];
  for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
    const int h = i / half, c = i % half;
    double s, co;
    sincos(pos * static_cast<double>(inv_freq[c]), &s, &co);
    const float cf = static_cast<float>(co), sf = static_cast<float>(s);
    float* v = x + (static_cast<size_t>(r) * heads + h) * head_dim;
    const float a = v[c], b = v[c + half];
    v[c] = a * cf - b * sf;
    v[c + half] = b * cf + a * sf;
  }
}

template <typename T>
__global__ void SwiGluKernel(const float* g, const float* u, size_t n, T* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float x = g[i];
    out[i] = NarrowTo<T>(x / (1.0f + expf(-x)) * u[i]);
  }
}

__global__ void AddKernel(float* x, const float* y, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    x[i] += y[i];
  }
}

template <typename T>
__global__ void NarrowKernel(const float* in, size_t n, T* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = NarrowTo<T>(in[i]);
  }
}

// One warp per (row, query head): lanes own channels c = lane, lane + 32, ... (D <= 256).
__global__ void DenseAttentionKernel(DenseAttentionArgs a) {
  const int warps = blockDim.x / kWarp;
  const int item = blockIdx.x * warps + threadIdx.x / kWarp;
  if (item >= a.rows * a.q_heads) return;
  const int lane = threadIdx.x % kWarp;
  const int r = item / a.q_heads, h = item % a.q_heads;
  const int kvh = h / (a.q_heads / a.kv_heads);
  const int D = a.head_dim;
  constexpr int kMaxPer = 8;
  const int per = D / kWarp;
  const float scale = rsqrtf(static_cast<float>(D));
  float q[kMaxPer], acc[kMaxPer];
  const float* qr = a.q + (static_cast<size_t>(r) * a.q_heads + h) * D;
  for (int i = 0; i < per; ++i) {
    q[i] = qr[lane + i * kWarp] * scale;
    acc[i] = 0;
  }
  float m = -INFINITY, l = 0;
  const float* kh = a.k + static_cast<size_t>(kvh) * a.capacity * D;
  const float* vh = a.v + static_cast<size_t>(kvh) * a.capacity * D;
  const int last = a.positions[r];
  for (int t = 0; t <= last; ++t) {
    float dot = 0;
    for (int i = 0; i < per; ++i) dot += q[i] * kh[static_cast<size_t>(t) * D + lane + i * kWarp];
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float m_new = fmaxf(m, dot);
    const float correction = expf(m - m_new);  // 0 when m is -inf
    const float p = expf(dot - m_new);
    l = l * correction + p;
    for (int i = 0; i < per; ++i) {
      acc[i] = acc[i] * correction + p * vh[static_cast<size_t>(t) * D + lane + i * kWarp];
    }
    m = m_new;
  }
  float* o = a.out + (static_cast<size_t>(r) * a.q_heads + h) * D;
  for (int i = 0; i < per; ++i) o[lane + i * kWarp] = acc[i] / l;
}

__global__ void WriteKvKernel(const float* k, const float* v, const int32_t* positions,
                              int kv_heads, int head_dim, int capacity, float* ck, float* cv) {
  const int r = blockIdx.x;
  const size_t pos = positions[r];
  for (int i = threadIdx.x; i < kv_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, c = i % head_dim;
    const size_t dst = (static_cast<size_t>(h) * capacity + pos) * head_dim + c;
    ck[dst] = k[static_cast<size_t>(r) * kv_heads * head_dim + i];
    cv[dst] = v[static_cast<size_t>(r) * kv_heads * head_dim + i];
  }
}

__global__ void AppendWindowKernel(const float* k, const float* v, const int32_t* slots,
                                   const int32_t* lens, int kv_heads, int head_dim, int max_window,
                                   __half* wk, __half* wv) {
  const int b = blockIdx.x;
  const size_t row = static_cast<size_t>(slots[b]) * kv_heads;
  const int at = lens[b];
  for (int i = threadIdx.x; i < kv_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, c = i % head_dim;
    const size_t dst = ((row + h) * max_window + at) * head_dim + c;
    wk[dst] = __float2half_rn(k[static_cast<size_t>(b) * kv_heads * head_dim + i]);
    wv[dst] = __float2half_rn(v[static_cast<size_t>(b) * kv_heads * head_dim + i]);
  }
}

__device__ __forceinline__ float UniformAt(uint64_t seed, size_t i) {
  uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
}

template <typename T>
__global__ void FillUniformKernel(T* out, size_t n, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = scale * UniformAt(seed, i);
    } else {
      out[i] = NarrowTo<T>(scale * UniformAt(seed, i));
    }
  }
}

// One block per row: each thread's best, then the block's (lowest index among equals).
__global__ void ArgmaxKernel(const float* logits, int vocab, int32_t* index) {
  __shared__ float best_v[1024];
  __shared__ int best_i[1024];
  const int r = blockIdx.x;
  const float* row = logits + static_cast<size_t>(r) * vocab;
  float bv = -FLT_MAX;
  int bi = vocab;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    if (row[j] > bv) {
      bv = row[j];
      bi = j;
    }
  }
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const int oi = best_i[threadIdx.x + s];
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) index[r] = best_i[0] < vocab ? best_i[0] : 0;
}

}  // namespace

template <typename T>
absl::Status EmbedRows(const T* table, const int32_t* ids, int rows, int hidden, float* x,
                       cudaStream_t stream) {
  if (rows < 1) return absl::OkStatus();
  EmbedKernel<T><<<rows, 256, 0, stream>>>(table, ids, hidden, x);
  return Launched("embed");
}

template <typename T>
absl::Status RmsNormRows(const float* x, const float* w, int rows, int d, double eps, T* out,
                         cudaStream_t stream) {
  if (rows < 1) return absl::OkStatus();
  RmsNormKernel<T><<<rows, 256, 0, stream>>>(x, w, d, eps, out);
  return Launched("rms norm");
}

absl::Status AddBias(float* y, const float* b, int rows, int d, cudaStream_t stream) {
  const size_t n = static_cast<size_t>(rows) * d;
  if (n == 0) return absl::OkStatus();
  AddBiasKernel<<<Blocks(n, 256), 256, 0, stream>>>(y, b, d, n);
  return Launched("bias");
}

absl::Status Rope(float* x, const int32_t* positions, const float* inv_freq, int rows, int heads,
                  int head_dim, cudaStream_t stream) {
  if (rows < 1) return absl::OkStatus();
  RopeKernel<<<rows, 256, 0, stream>>>(x, positions, inv_freq, heads, head_dim);
  return Launched("rope");
}

template <typename T>
absl::Status SwiGlu(const float* gate, const float* up, size_t n, T* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  SwiGluKernel<T><<<Blocks(n, 256), 256, 0, stream>>>(gate, up, n, out);
  return Launched("swiglu");
}

absl::Status AddInPlace(float* x, const float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  AddKernel<<<Blocks(n, 256), 256, 0, stream>>>(x, y, n);
  return Launched("residual");
}

template <typename T>
absl::Status Narrow(const float* in, size_t n, T* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  NarrowKernel<T><<<Blocks(n, 256), 256, 0, stream>>>(in, n, out);
  return Launched("narrow");
}

absl::Status DenseAttention(const DenseAttentionArgs& a, cudaStream_t stream) {
  if (a.head_dim % kWarp != 0 || a.head_dim > 8 * kWarp || a.kv_heads < 1 ||
      a.q_heads % a.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("dense attention: head_dim ", a.head_dim,
                                                   " (a multiple of 32 up to 256), heads ",
                                                   a.q_heads, " over ", a.kv_heads));
  }
  if (a.rows < 1) return absl::OkStatus();
  constexpr int kWarps = 4;
  const int items = a.rows * a.q_heads;
  DenseAttentionKernel<<<(items + kWarps - 1) / kWarps, kWarps * kWarp, 0, stream>>>(a);
  return Launched("dense attention");
}

absl::Status WriteKv(const float* k, const float* v, const int32_t* positions, int rows,
                     int kv_heads, int head_dim, int capacity, float* cache_k, float* cache_v,
                     cudaStream_t stream) {
  if (rows < 1) return absl::OkStatus();
  WriteKvKernel<<<rows, 256, 0, stream>>>(k, v, positions, kv_heads, head_dim, capacity, cache_k,
                                          cache_v);
  return Launched("write kv");
}

absl::Status AppendWindow(const float* k, const float* v, const int32_t* slots, const int32_t* lens,
                          int batch, int kv_heads, int head_dim, int max_window, __half* window_k,
                          __half* window_v, cudaStream_t stream) {
  if (batch < 1) return absl::OkStatus();
  AppendWindowKernel<<<batch, 256, 0, stream>>>(k, v, slots, lens, kv_heads, head_dim, max_window,
                                                window_k, window_v);
  return Launched("append window");
}

template <typename T>
absl::Status FillUniform(T* out, size_t n, float scale, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  FillUniformKernel<T><<<Blocks(n, 256), 256, 0, stream>>>(out, n, scale, seed);
  return Launched("fill");
}
template absl::Status FillUniform<float>(float*, size_t, float, uint64_t, cudaStream_t);
template absl::Status FillUniform<__half>(__half*, size_t, float, uint64_t, cudaStream_t);
template absl::Status FillUniform<__nv_bfloat16>(__nv_bfloat16*, size_t, float, uint64_t,
                                                 cudaStream_t);

absl::Status ArgmaxRows(const float* logits, int rows, int vocab, int32_t* index,
                        cudaStream_t stream) {
  if (rows < 1) return absl::OkStatus();
  ArgmaxKernel<<<rows, 1024, 0, stream>>>(logits, vocab, index);
  return Launched("argmax");
}

#define STRATA_MODEL_OPS(T)                                                                     \
  template absl::Status EmbedRows<T>(const T*, const int32_t*, int, int, float*, cudaStream_t); \
  template absl::Status RmsNormRows<T>(const float*, const float*, int, int, double, T*,        \
                                       cudaStream_t);                                           \
  template absl::Status SwiGlu<T>(const float*, const float*, size_t, T*, cudaStream_t);        \
  template absl::Status Narrow<T>(const float*, size_t, T*, cudaStream_t);
STRATA_MODEL_OPS(__half)
STRATA_MODEL_OPS(__nv_bfloat16)
#undef STRATA_MODEL_OPS

}  // namespace strata::kernels::cuda
