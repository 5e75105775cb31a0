#include <cfloat>
#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/mma_ptx.cuh"
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

// Dense causal attention on the tensor cores (model_ops.h, DenseAttentionArgs). Block: 4 warps,
// 64 query rows of one query head (warp w: rows 16w..16w+15); keys in tiles of kTileKeys,
// converted to fp16 into shared memory (rows padded by 16 bytes: the B-fragment loads and
// ldmatrix hit 32 distinct banks). Per tile and warp: S[16 x 64] = Q.K^T (D/16 k-steps x 8
// n-tiles), masked, scaled into log2 units; the online softmax per row (each lane holds two rows'
// partial sums over its columns, reduced over the quad at the end); P rounded to fp16 straight
// from the accumulators into A fragments; O[16 x D] += P.V with V's B fragments by ldmatrix.trans.
// Blocks are taken last rows first (the causal mask makes them the longest).
constexpr int kTileRows = 64, kTileKeys = 64;

template <int D>
__global__ void __launch_bounds__(128) DenseAttentionMmaKernel(DenseAttentionArgs a) {
  constexpr int kLd = D + 8;  // halves per shared-memory row
  __shared__ __align__(16) __half ks[kTileKeys * kLd];
  __shared__ __align__(16) __half vs[kTileKeys * kLd];
  __shared__ int kv_end;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  const int h = blockIdx.y;
  const int kvh = h / (a.q_heads / a.kv_heads);
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kTileRows + warp * 16;
  const int r_lo = row0 + g, r_hi = row0 + g + 8;
  const int pos_lo = r_lo < a.rows ? a.positions[r_lo] : -1;
  const int pos_hi = r_hi < a.rows ? a.positions[r_hi] : -1;
  if (threadIdx.x == 0) kv_end = 0;
  __syncthreads();
  atomicMax(&kv_end, max(pos_lo, pos_hi) + 1);

  // Q's A fragments, fp16, for the warp's 16 rows (rows past the end read as zeros).
  uint32_t qf[D / 16][4];
  {
    const float* q_lo = a.q + (static_cast<size_t>(r_lo) * a.q_heads + h) * D;
    const float* q_hi = a.q + (static_cast<size_t>(r_hi) * a.q_heads + h) * D;
    const float2 zero = make_float2(0.f, 0.f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk * 16 + 2 * t;
      const float2 lo0 = r_lo < a.rows ? *reinterpret_cast<const float2*>(q_lo + c) : zero;
      const float2 hi0 = r_hi < a.rows ? *reinterpret_cast<const float2*>(q_hi + c) : zero;
      const float2 lo1 = r_lo < a.rows ? *reinterpret_cast<const float2*>(q_lo + c + 8) : zero;
      const float2 hi1 = r_hi < a.rows ? *reinterpret_cast<const float2*>(q_hi + c + 8) : zero;
      qf[kk][0] = HalfBits2(__floats2half2_rn(lo0.x, lo0.y));
      qf[kk][1] = HalfBits2(__floats2half2_rn(hi0.x, hi0.y));
      qf[kk][2] = HalfBits2(__floats2half2_rn(lo1.x, lo1.y));
      qf[kk][3] = HalfBits2(__floats2half2_rn(hi1.x, hi1.y));
    }
  }
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  const float scale = rsqrtf(static_cast<float>(D)) * 1.4426950408889634f;  // log2(e)
  __syncthreads();                                                          // kv_end complete
  const int end = kv_end;
  const float* kh = a.k + static_cast<size_t>(kvh) * a.capacity * D;
  const float* vh = a.v + static_cast<size_t>(kvh) * a.capacity * D;
  for (int kb = 0; kb < end; kb += kTileKeys) {
    // Stage the tile: 4 floats per thread and step, keys past `end` as zeros (P is 0 there, but
    // 0 x garbage could be NaN).
    for (int i = threadIdx.x; i < kTileKeys * D / 4; i += blockDim.x) {
      const int key = i / (D / 4), c = (i % (D / 4)) * 4;
      float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f), vv4 = kv4;
      if (kb + key < end) {
        kv4 = *reinterpret_cast<const float4*>(kh + static_cast<size_t>(kb + key) * D + c);
        vv4 = *reinterpret_cast<const float4*>(vh + static_cast<size_t>(kb + key) * D + c);
      }
      __half2* kd = reinterpret_cast<__half2*>(ks + key * kLd + c);
      __half2* vd = reinterpret_cast<__half2*>(vs + key * kLd + c);
      kd[0] = __floats2half2_rn(kv4.x, kv4.y);
      kd[1] = __floats2half2_rn(kv4.z, kv4.w);
      vd[0] = __floats2half2_rn(vv4.x, vv4.y);
      vd[1] = __floats2half2_rn(vv4.z, vv4.w);
    }
    __syncthreads();
    float sc[kTileKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kTileKeys / 8; ++j) {
      sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
      const __half* krow = ks + (8 * j + g) * kLd + 2 * t;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(krow + kk * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(krow + kk * 16 + 8);
        Mma(sc[j], qf[kk], b0, b1);
      }
    }
    // Mask, scale, the rows' new maxima.
    float tile_lo = -INFINITY, tile_hi = -INFINITY;
#pragma unroll
    for (int j = 0; j < kTileKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kb + 8 * j + 2 * t + (e & 1);
        const bool hi = e >= 2;
        const float x = key <= (hi ? pos_hi : pos_lo) ? sc[j][e] * scale : -INFINITY;
        sc[j][e] = x;
        if (hi) {
          tile_hi = fmaxf(tile_hi, x);
        } else {
          tile_lo = fmaxf(tile_lo, x);
        }
      }
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      tile_lo = fmaxf(tile_lo, __shfl_xor_sync(0xffffffffu, tile_lo, o));
      tile_hi = fmaxf(tile_hi, __shfl_xor_sync(0xffffffffu, tile_hi, o));
    }
    const float new_lo = fmaxf(m_lo, tile_lo), new_hi = fmaxf(m_hi, tile_hi);
    const float base_lo = new_lo == -INFINITY ? 0.f : new_lo;
    const float base_hi = new_hi == -INFINITY ? 0.f : new_hi;
    const float corr_lo = exp2f(m_lo - base_lo), corr_hi = exp2f(m_hi - base_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    l_lo *= corr_lo;
    l_hi *= corr_hi;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      acc[j][0] *= corr_lo;
      acc[j][1] *= corr_lo;
      acc[j][2] *= corr_hi;
      acc[j][3] *= corr_hi;
    }
    uint32_t pf[kTileKeys / 16][4];
#pragma unroll
    for (int j = 0; j < kTileKeys / 8; ++j) {
      const float p0 = exp2f(sc[j][0] - base_lo), p1 = exp2f(sc[j][1] - base_lo);
      const float p2 = exp2f(sc[j][2] - base_hi), p3 = exp2f(sc[j][3] - base_hi);
      l_lo += p0 + p1;
      l_hi += p2 + p3;
      pf[j / 2][(j % 2) * 2 + 0] = HalfBits2(__floats2half2_rn(p0, p1));
      pf[j / 2][(j % 2) * 2 + 1] = HalfBits2(__floats2half2_rn(p2, p3));
    }
    // O += P.V: ldmatrix.trans gives two n-tiles' B fragments per 16 keys.
    const int v_key = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < D / 8; j += 2) {
        uint32_t b[4];
        Ldmatrix4Trans(b, vs + (kk * 16 + v_key) * kLd + j * 8 + v_col);
        Mma(acc[j], pf[kk], b[0], b[1]);
        Mma(acc[j + 1], pf[kk], b[2], b[3]);
      }
    }
    __syncthreads();  // the tile is read by every warp before the next overwrites it
  }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o);
  }
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
  float* o_lo = a.out + (static_cast<size_t>(r_lo) * a.q_heads + h) * D;
  float* o_hi = a.out + (static_cast<size_t>(r_hi) * a.q_heads + h) * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int c = j * 8 + 2 * t;
    if (r_lo < a.rows) {
      *reinterpret_cast<float2*>(o_lo + c) = make_float2(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
    }
    if (r_hi < a.rows) {
      *reinterpret_cast<float2*>(o_hi + c) = make_float2(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
    }
  }
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
  if (!a.exact && (a.head_dim == 64 || a.head_dim == 128)) {
    const dim3 grid((a.rows + kTileRows - 1) / kTileRows, a.q_heads);
    if (a.head_dim == 64) {
      DenseAttentionMmaKernel<64><<<grid, 128, 0, stream>>>(a);
    } else {
      DenseAttentionMmaKernel<128><<<grid, 128, 0, stream>>>(a);
    }
    return Launched("dense attention (tensor cores)");
  }
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
