#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/page_desc.h"
#include "kernels/cuda/page_tiles.h"
#include "kernels/cuda/paged_decode.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreadsPerToken = 8;  // a key row's dot product: 8 lanes, reduced by 3 shuffles
constexpr int kTokensPerStep = kWarp / kThreadsPerToken;

// ---- device helpers ---------------------------------------------------------------------------

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Starts copying `bytes` (a multiple of 16) from global to shared memory, 16 bytes per
// cp.async (sm_80+), all threads: every copy is in flight at once and none passes through
// registers. The caller commits the group and waits for it (CpAsyncWait) before a barrier.
// One 16-byte cp.async from global `src` to shared `dst`.
__device__ __forceinline__ void CpAsync16(uint8_t* dst, const uint8_t* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void StageAsync(uint8_t* dst, const uint8_t* src, size_t bytes) {
  const size_t n = bytes / 16;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) CpAsync16(dst + i * 16, src + i * 16);
}
// Starts copying KV head h's slice `sub` of the page at `page` (global) into `dst` (shared).
__device__ __forceinline__ void StageTile(uint8_t* dst, const uint8_t* page, const PagedKvLayout& L,
                                          int h, int sub) {
  for (int i = 0; i < PartCount(L); ++i) {
    const TilePart part = PartOf(L, i, h, sub);
    StageAsync(dst + part.dst, page + part.src, part.bytes);
  }
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A code of `bits` bits (< 2^23) as a float without a conversion instruction: its bits OR'd
// into the mantissa of 2^23, less 2^23 (exact).
__device__ __forceinline__ float CodeToFloat(uint32_t code) {
  return __uint_as_float(0x4B000000u | code) - 8388608.f;
}

// What one warp (one query head) keeps across the pages of its split.
template <int D>
struct HeadState {
  static constexpr int kPerLane = D / kWarp;        // value channels a lane accumulates
  static constexpr int kKeyPerLane = D / kThreadsPerToken;  // key channels a lane multiplies
  float q[kKeyPerLane];  // the lane's key channels of the query (scaled by the softmax scale)
  float acc[kPerLane];
  float zero_acc = 0;    // affine values: Σ p·zero of the lane's value group
  float m = -INFINITY;
  float l = 0;
};

// Online softmax over `n` scores in `sc` (already scaled): updates m, l and rescales the
// accumulators; leaves p = exp(s - m) in `sc`.
template <int D>
__device__ __forceinline__ void Softmax(HeadState<D>& h, float* sc, int n) {
  const int lane = threadIdx.x % kWarp;
  float mx = -INFINITY;
  for (int t = lane; t < n; t += kWarp) mx = fmaxf(mx, sc[t]);
  mx = WarpMax(mx);
  const float m_new = fmaxf(h.m, mx);
  const float correction = h.m == -INFINITY ? 0.f : __expf(h.m - m_new);
  float sum = 0;
  for (int t = lane; t < n; t += kWarp) {
    const float p = sc[t] == -INFINITY ? 0.f : __expf(sc[t] - m_new);
    sc[t] = p;
    sum += p;
  }
  sum = WarpSum(sum);
  h.l = h.l * correction + sum;
  for (int i = 0; i < HeadState<D>::kPerLane; ++i) h.acc[i] *= correction;
  h.zero_acc *= correction;
  h.m = m_new;
  __syncwarp();
}

// fp16 rows in shared memory: K [n][D] then V [n][D] (row stride D halves).
template <int D>
__device__ void AttendFp16(HeadState<D>& h, const __half* k, const __half* v, int n, float* sc) {
  const int lane = threadIdx.x % kWarp;
  const int sub = lane % kThreadsPerToken;
  const int slot = lane / kThreadsPerToken;
  constexpr int kKey = HeadState<D>::kKeyPerLane;
#pragma unroll 4
  for (int t0 = 0; t0 < n; t0 += kTokensPerStep) {
    const int t = t0 + slot;
    float dot0 = 0, dot1 = 0;  // two sums: half the dependent chain
    if (t < n) {  // the lane's kKey halves: 16-byte loads
      const uint4* row = reinterpret_cast<const uint4*>(k + static_cast<size_t>(t) * D + sub * kKey);
#pragma unroll
      for (int i = 0; i < kKey / 8; ++i) {
        const uint4 w = row[i];
        const __half2* h2 = reinterpret_cast<const __half2*>(&w);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(h2[j]);
          dot0 = fmaf(h.q[8 * i + 2 * j], f.x, dot0);
          dot1 = fmaf(h.q[8 * i + 2 * j + 1], f.y, dot1);
        }
      }
    }
    float dot = dot0 + dot1;
#pragma unroll
    for (int o = kThreadsPerToken / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (sub == 0 && t < n) sc[t] = dot;
  }
  __syncwarp();
  Softmax<D>(h, sc, n);
  constexpr int kPer = HeadState<D>::kPerLane;
#pragma unroll 8
  for (int t = 0; t < n; ++t) {
    const float p = sc[t];
    // The lane's kPer halves (4 or 2) in one 8- or 4-byte load.
    const __half* row = v + static_cast<size_t>(t) * D + lane * kPer;
    __half2 w[kPer / 2];
    if constexpr (kPer == 4) {
      *reinterpret_cast<uint2*>(w) = *reinterpret_cast<const uint2*>(row);
    } else {
      w[0] = *reinterpret_cast<const __half2*>(row);
    }
#pragma unroll
    for (int i = 0; i < kPer; i += 2) {
      const float2 f = __half22float2(w[i / 2]);
      h.acc[i] = fmaf(p, f.x, h.acc[i]);
      h.acc[i + 1] = fmaf(p, f.y, h.acc[i + 1]);
    }
  }
  __syncwarp();
}

// `count` codes of `bits` bits starting at code `first` of a packed row (never straddles a word:
// count * bits divides 32 and first is a multiple of count).
template <int BITS>
__device__ __forceinline__ uint32_t Codes(const uint8_t* row, int first, int count) {
  const int bit = first * BITS;
  const uint32_t word = reinterpret_cast<const uint32_t*>(row)[bit / 32];
  const int width = count * BITS;
  return width == 32 ? word : (word >> (bit % 32)) & ((1u << width) - 1u);
}

// One affine slice of a page of one KV head, staged in shared memory.
template <int D, int KB, int VB>
__device__ void AttendAffine(HeadState<D>& h, const uint8_t* page, const TileLayout& L, float* sc) {
  const int lane = threadIdx.x % kWarp;
  const int sub = lane % kThreadsPerToken;
  const int slot = lane / kThreadsPerToken;
  const int n = L.tokens;
  constexpr int kKey = HeadState<D>::kKeyPerLane;
  constexpr int kKeyRow = D * KB / 8;
  constexpr int kValueRow = D * VB / 8;
  const uint8_t* key_codes = page + L.KeyCodes();
  const __half* key_scales = reinterpret_cast<const __half*>(page + L.KeyScales());
  const __half* key_zeros = reinterpret_cast<const __half*>(page + L.KeyZeros());
  const uint8_t* value_codes = page + L.ValueCodes();
  const __half* value_scales = reinterpret_cast<const __half*>(page + L.ValueScales());
  const __half* value_zeros = reinterpret_cast<const __half*>(page + L.ValueZeros());

  // Keys: per group, the scales folded into the query once (q'_c = q_c * scale_c) and the zeros
  // into one bias per lane (Σ q_c * zero_c over the lane's channels).
  float qs[kKey];
  for (int g0 = 0; g0 < n; g0 += L.k_group) {
    const int g = g0 / L.k_group;
    float bias = 0;
#pragma unroll
    for (int i = 0; i < kKey; ++i) {
      const int c = sub * kKey + i;
      qs[i] = h.q[i] * __half2float(key_scales[g * D + c]);
      bias += h.q[i] * __half2float(key_zeros[g * D + c]);
    }
#pragma unroll 2
    for (int t0 = g0; t0 < g0 + L.k_group; t0 += kTokensPerStep) {
      const int t = t0 + slot;
      const uint8_t* row = key_codes + static_cast<size_t>(t) * kKeyRow;
      float dot0 = bias, dot1 = 0;
      // The lane's kKey codes: kKey * KB bits (16 to 64) from bit `first`, in one or two words
      // (a 64-bit code group starts on a word boundary).
      const int first = sub * kKey * KB;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(row) + first / 32;
      const uint64_t bits =
          (kKey * KB > 32 ? (static_cast<uint64_t>(words[1]) << 32) : 0ull) | words[0];
      const int shift = first % 32;
#pragma unroll
      for (int i = 0; i < kKey; i += 2) {
        dot0 = fmaf(
            qs[i], CodeToFloat(static_cast<uint32_t>(bits >> (shift + i * KB)) & ((1u << KB) - 1u)),
            dot0);
        dot1 = fmaf(
            qs[i + 1],
            CodeToFloat(static_cast<uint32_t>(bits >> (shift + (i + 1) * KB)) & ((1u << KB) - 1u)),
            dot1);
      }
      float dot = dot0 + dot1;
#pragma unroll
      for (int o = kThreadsPerToken / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (sub == 0) sc[t] = dot;
    }
  }
  __syncwarp();
  Softmax<D>(h, sc, n);
  // Values: Σ_t (p_t * scale_tg) * code_tc, and Σ_t p_t * zero_tg once per token and group.
  constexpr int kPer = HeadState<D>::kPerLane;
  const int c0 = lane * kPer;
  const int groups = D / L.v_group;
  const int g = c0 / L.v_group;
#pragma unroll 4
  for (int t = 0; t < n; ++t) {
    const float p = sc[t];
    const float ps = p * __half2float(value_scales[t * groups + g]);
    h.zero_acc += p * __half2float(value_zeros[t * groups + g]);
    const uint32_t codes = Codes<VB>(value_codes + static_cast<size_t>(t) * kValueRow, c0, kPer);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      h.acc[i] = fmaf(ps, CodeToFloat((codes >> (i * VB)) & ((1u << VB) - 1u)), h.acc[i]);
    }
  }
  __syncwarp();
}

// Shared memory of one block: S slice buffers, then each warp's scores. A buffer is a staged
// slice, and at least 32 rows (or the slice's) of fp16 K and V, so that the window, staged in the
// S buffers together (WindowRows), goes at least that many rows at a time. Sized by the slice
// alone, not by a whole slice of fp16 window: that made affine slices of 112-128 tokens at
// D = 128 need more shared memory than an A100 has (198,656 bytes at three stages).
template <int D>
__host__ __device__ inline size_t StageBytes(const TileLayout& T) {
  const size_t rows = T.tokens < 32 ? T.tokens : 32;
  const size_t window = Align16(rows * D * sizeof(__half) * 2);
  return T.HeadBytes() > window ? T.HeadBytes() : window;
}

// Window rows attended at a time: as many as the S buffers hold as K then V, up to a slice.
template <int D>
__host__ __device__ inline int WindowRows(const TileLayout& T, int stages) {
  const size_t fit = stages * StageBytes<D>(T) / (static_cast<size_t>(D) * sizeof(__half) * 2);
  return static_cast<int>(fit < static_cast<size_t>(T.tokens) ? fit : T.tokens);
}

// One block per (split, KV head, sequence); the split's slices (each page's TileTokens() tokens at
// a time) stream through S shared-memory buffers: while the warps compute on slice j, slices
// j+1 .. j+S-1 are on their way (cp.async).
template <int D, PageFormat F, int KB, int VB, int S>
__global__ void DecodeKernel(PagedKvLayout L, PagedDecodeArgs a, int splits, float* part_acc,
                             float* part_ml) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int seq = blockIdx.z;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int group = a.q_heads / L.kv_heads;
  const int qh = kvh * group + warp;
  const TileLayout T(L);
  const int tile = T.tokens;
  const size_t stage_bytes = StageBytes<D>(T);
  float* scores = reinterpret_cast<float*>(smem + S * stage_bytes) + warp * tile;

  HeadState<D> h;
  const float scale = a.scale != 0 ? a.scale : rsqrtf(static_cast<float>(D));
  const float* q = a.q + (static_cast<size_t>(seq) * a.q_heads + qh) * D;
  constexpr int kKey = HeadState<D>::kKeyPerLane;
  const int sub = lane % kThreadsPerToken;
#pragma unroll
  for (int i = 0; i < kKey; ++i) h.q[i] = q[sub * kKey + i] * scale;
#pragma unroll
  for (int i = 0; i < HeadState<D>::kPerLane; ++i) h.acc[i] = 0;

  const int tpp = T.tiles_per_page;
  const int tiles = a.page_counts[seq] * tpp;
  const int per_split = (tiles + splits - 1) / splits;
  const int p0 = min(tiles, split * per_split);
  const int p1 = min(tiles, p0 + per_split);
  const int32_t* table = a.block_table + static_cast<size_t>(seq) * a.max_pages;
  auto issue = [&](int p) {  // slice p of the split into its buffer; one group per call
    if (p < p1) {
      const int64_t id = table[p / tpp];
      StageTile(smem + ((p - p0) % S) * stage_bytes,
                a.pages + id * static_cast<int64_t>(L.PageBytes()), L, kvh, p % tpp);
    }
    CpAsyncCommit();  // empty past the end: the group count stays one per slice
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(p0 + i);
  for (int p = p0; p < p1; ++p) {
    __syncthreads();  // the buffer page p + S - 1 goes to was read (page p - 1)
    issue(p + S - 1);
    CpAsyncWait<S - 1>();  // this thread's copies of page p have landed...
    __syncthreads();       // ... and everyone's
    const uint8_t* page = smem + ((p - p0) % S) * stage_bytes;
    if (warp < group) {
      if constexpr (F == PageFormat::kFp16) {
        const __half* k = reinterpret_cast<const __half*>(page);
        AttendFp16<D>(h, k, k + static_cast<size_t>(tile) * D, tile, scores);
      } else {
        AttendAffine<D, KB, VB>(h, page, T, scores);
      }
    }
  }
  CpAsyncWait<0>();  // no copy in flight into the buffers the window reuses
  // The window (full precision, newest tokens): the last split's.
  const int window = a.window_lens != nullptr ? a.window_lens[seq] : 0;
  if (split == splits - 1 && window > 0) {
    const int slot = a.window_slots != nullptr ? a.window_slots[seq] : seq;
    const size_t base = (static_cast<size_t>(slot) * L.kv_heads + kvh) * a.max_window * D;
    const int rows = WindowRows<D>(T, S);  // <= tile: the scores fit
    for (int w0 = 0; w0 < window; w0 += rows) {
      const int n = min(rows, window - w0);
      __syncthreads();
      __half* k = reinterpret_cast<__half*>(smem);
      __half* v = k + static_cast<size_t>(rows) * D;
      for (int i = threadIdx.x; i < n * D / 8; i += blockDim.x) {
        reinterpret_cast<uint4*>(k)[i] =
            __ldg(reinterpret_cast<const uint4*>(a.window_k + base + static_cast<size_t>(w0) * D) + i);
        reinterpret_cast<uint4*>(v)[i] =
            __ldg(reinterpret_cast<const uint4*>(a.window_v + base + static_cast<size_t>(w0) * D) + i);
      }
      __syncthreads();
      if (warp < group) AttendFp16<D>(h, k, v, n, scores);
    }
  }
  if (warp >= group) return;
  // The partial result of this split: unnormalized sums with their max and denominator.
  constexpr int kPer = HeadState<D>::kPerLane;
  const size_t row = (static_cast<size_t>(seq) * a.q_heads + qh) * splits + split;
  float* acc = part_acc + row * D;
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[lane * kPer + i] = h.acc[i] + h.zero_acc;
  if (lane == 0) {
    part_ml[row * 2] = h.m;
    part_ml[row * 2 + 1] = h.l;
  }
}

// out[seq][h] = Σ_s acc_s e^(m_s - M) / Σ_s l_s e^(m_s - M): one block per (sequence, head).
__global__ void MergeKernel(int head_dim, int splits, const float* part_acc, const float* part_ml,
                            float* out) {
  const size_t head = blockIdx.x;  // seq * q_heads + h
  const float* ml = part_ml + head * splits * 2;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, ml[s * 2]);
  float l = 0;
  for (int s = 0; s < splits; ++s) {
    if (ml[s * 2] != -INFINITY) l += ml[s * 2 + 1] * __expf(ml[s * 2] - m);
  }
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    float sum = 0;
    for (int s = 0; s < splits; ++s) {
      if (ml[s * 2] != -INFINITY) {
        sum += part_acc[(head * splits + s) * head_dim + c] * __expf(ml[s * 2] - m);
      }
    }
    out[head * head_dim + c] = l > 0 ? sum / l : 0.f;
  }
}

// Pages in flight per block: three where a KV head's page is small (affine codes), two for fp16.
template <PageFormat F>
constexpr int StagesFor() {
  return F == PageFormat::kFp16 ? 2 : 3;
}

template <int D, PageFormat F, int KB, int VB>
size_t SharedBytes(const PagedKvLayout& L, int group) {
  const TileLayout T(L);
  return StagesFor<F>() * StageBytes<D>(T) + static_cast<size_t>(group) * T.tokens * sizeof(float);
}

using KernelFn = void (*)(PagedKvLayout, PagedDecodeArgs, int, float*, float*);

// Raises `kernel`'s dynamic shared-memory limit on the current device to at least `smem` bytes,
// never lowering it. The limit is the function's, not a launch's, and a CUDA graph does not
// capture it: a mix's codebook layers share one kernel with tables of different sizes (b8 and b6
// layers of c4), and a lowered limit would fail the replay of a graph captured with the larger
// launch. So each (kernel, device) keeps the largest limit asked of it. (A cudaDeviceReset would
// drop the limits behind this record's back; nothing in Strata resets a device.)
absl::Status RaiseSharedLimit(const void* kernel, size_t smem) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("paged decode: no current device: ", cudaGetErrorString(e)));
  }
  static std::mutex mu;
  static auto* raised = new std::map<std::pair<const void*, int>, size_t>();
  std::lock_guard<std::mutex> lock(mu);
  size_t& limit = (*raised)[{kernel, device}];
  if (smem <= limit) return absl::OkStatus();
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged decode: ", smem, " bytes of shared memory: ",
                                            cudaGetErrorString(e)));
  }
  limit = smem;
  return absl::OkStatus();
}

template <typename Kernel>
absl::Status AllowSharedBytes(Kernel kernel, size_t smem) {
  return RaiseSharedLimit(reinterpret_cast<const void*>(kernel), smem);
}

#include "kernels/cuda/paged_decode_codebook.cuh"
#include "kernels/cuda/paged_decode_general.cuh"
#include "kernels/cuda/paged_decode_mma.cuh"

// The tensor-core kernel takes tiles of whole 16-token slices, key groups of whole slices and
// value groups of whole 32-channel blocks; other layouts (and PagedKernel::kSimt, for
// comparison) take the one-warp-per-query-head kernel.
bool UseMma(const PagedKvLayout& L, PagedKernel kernel) {
  const TileLayout T(L);
  if (kernel == PagedKernel::kSimt || T.tokens % kSlice != 0) return false;
  return L.format == PageFormat::kFp16 || (T.k_group % kSlice == 0 && L.v_group % 32 == 0);
}

// Pages in flight per block on the tensor-core path.
template <PageFormat F>
constexpr int MmaStages() {
  return F == PageFormat::kFp16 ? 2 : 4;
}

struct Plan {
  KernelFn kernel = nullptr;
  size_t smem = 0;
  int threads = 0;
};

// The kernel for (D, F, KB, VB) and `L`, its shared memory and threads, with the kernel's
// dynamic shared-memory limit raised to that.
template <int D, PageFormat F, int KB, int VB>
absl::Status MakePlan(const PagedKvLayout& L, int group, PagedKernel kernel, Plan* plan) {
  if (UseMma(L, kernel)) {
    constexpr int kStages = MmaStages<F>();
    plan->kernel = MmaDecodeKernel<D, F, KB, VB, kStages>;
    if constexpr (F == PageFormat::kAffine) {
      if (kernel == PagedKernel::kMmaFourBlocks)
        plan->kernel = MmaDecodeKernel<D, F, KB, VB, kStages, 4>;
    }
    plan->smem = MmaSmem<D>(TileLayout(L), kStages, group).total;
    plan->threads = kMmaWarps * kWarp;
  } else {
    plan->kernel = DecodeKernel<D, F, KB, VB, StagesFor<F>()>;
    plan->smem = SharedBytes<D, F, KB, VB>(L, group);
    plan->threads = group * kWarp;
  }
  return AllowSharedBytes(plan->kernel, plan->smem);
}

template <int D, PageFormat F, int KB, int VB>
absl::Status Launch(const PagedKvLayout& L, const PagedDecodeArgs& a, int splits,
                    cudaStream_t stream) {
  const int group = a.q_heads / L.kv_heads;
  Plan plan;
  if (absl::Status s = MakePlan<D, F, KB, VB>(L, group, a.kernel, &plan); !s.ok()) return s;
  float* part_acc = static_cast<float*>(a.workspace);
  float* part_ml = part_acc + static_cast<size_t>(a.batch) * a.q_heads * splits * D;
  const dim3 grid(splits, L.kv_heads, a.batch);
  plan.kernel<<<grid, plan.threads, plan.smem, stream>>>(L, a, splits, part_acc, part_ml);
  MergeKernel<<<a.batch * a.q_heads, std::min(D, 128), 0, stream>>>(D, splits, part_acc, part_ml,
                                                                    a.out);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged decode: launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

// Blocks of the (D, F, KB, VB) kernel that fit on one multiprocessor at once (0 if unknown).
template <int D, PageFormat F, int KB, int VB>
int ResidentBlocks(const PagedKvLayout& L, int group, PagedKernel kernel) {
  Plan plan;
  int blocks = 0;
  if (!MakePlan<D, F, KB, VB>(L, group, kernel, &plan).ok() ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, plan.kernel, plan.threads,
                                                    plan.smem) != cudaSuccess) {
    return 0;
  }
  return blocks;
}

// Calls `fn.template operator()<D, F, KB, VB>()` for the layout's kernel.
template <int D, typename Fn>
auto DispatchBits(const PagedKvLayout& L, Fn&& fn) {
  if (L.format == PageFormat::kFp16) return fn.template operator()<D, PageFormat::kFp16, 16, 16>();
  switch (L.key_bits * 10 + L.value_bits) {
    case 22:
      return fn.template operator()<D, PageFormat::kAffine, 2, 2>();
    case 24:
      return fn.template operator()<D, PageFormat::kAffine, 2, 4>();
    case 42:
      return fn.template operator()<D, PageFormat::kAffine, 4, 2>();
    default:
      return fn.template operator()<D, PageFormat::kAffine, 4, 4>();
  }
}

template <int D>
absl::Status LaunchFor(const PagedKvLayout& L, const PagedDecodeArgs& a, int splits,
                       cudaStream_t stream) {
  // (PagedDecode has validated the layout: code bits are 2 or 4.)
  return DispatchBits<D>(L, [&]<int DD, PageFormat F, int KB, int VB>() {
    return Launch<DD, F, KB, VB>(L, a, splits, stream);
  });
}

// Whether PagedDecode runs the codebook kernel for `layout` and `args`.
bool UsesCodebookKernel(const PagedKvLayout& layout, const PagedDecodeArgs& args) {
  if (layout.format != PageFormat::kGeneral || layout.codebook_group == 0 ||
      args.kernel != PagedKernel::kAuto || layout.kv_heads < 1 || args.q_heads < layout.kv_heads) {
    return false;
  }
  return CodebookHeads(layout, args.q_heads / layout.kv_heads) > 0;
}

}  // namespace

absl::Status PagedKvLayout::Validate() const {
  auto bad = [](auto... parts) {
    return absl::InvalidArgumentError(absl::StrCat("paged decode: ", parts...));
  };
  if (head_dim != 64 && head_dim != 128) return bad("head_dim must be 64 or 128, got ", head_dim);
  if (kv_heads < 1 || kv_heads > 1024) return bad("kv_heads must be in [1, 1024], got ", kv_heads);
  if (format == PageFormat::kGeneral) {  // each page's sections are its descriptor's
    if (page_tokens < 1 || page_tokens > 65536) {
      return bad("page_tokens must be in [1, 65536], got ", page_tokens);
    }
    if (page_bytes == 0 || page_bytes % 16 != 0) {
      return bad("page_bytes must be a positive multiple of 16, got ", page_bytes);
    }
    if (codebook_group != 0 &&
        ((codebook_group != 2 && codebook_group != 4 && codebook_group != 8) || codebook_bits < 4 ||
         codebook_bits > 8)) {
      return bad("codebook pages take runs of 2, 4 or 8 channels and 4..8 bits, got ",
                 codebook_group, " and ", codebook_bits);
    }
    return absl::OkStatus();
  }
  if (codebook_group != 0) return bad("codebook_group is for general pools only");
  if (page_tokens < 8 || page_tokens > 512 || page_tokens % 8 != 0 ||
      (page_tokens > 128 && page_tokens % 64 != 0)) {
    return bad("page_tokens must be a multiple of 8 up to 128 or of 64 up to 512, got ",
               page_tokens);
  }
  const int tile = TileTokens();
  if (format == PageFormat::kAffine) {
    for (int b : {key_bits, value_bits}) {
      if (b != 2 && b != 4) return bad("code bits must be 2 or 4, got ", b);
    }
    if (k_group < kTokensPerStep || page_tokens % k_group != 0 || k_group % kTokensPerStep != 0 ||
        (tile % k_group != 0 && k_group % tile != 0)) {
      return bad("k_group must divide page_tokens, be a multiple of ", kTokensPerStep,
                 " and divide or be a multiple of ", tile, " tokens, got ", k_group);
    }
    if (v_group < head_dim / kWarp || head_dim % v_group != 0) {
      return bad("v_group must divide head_dim and be at least ", head_dim / kWarp, ", got ",
                 v_group);
    }
  }
  // The sections: 16-byte aligned, inside the page, not overlapping.
  struct Section {
    const char* name;
    size_t offset, bytes;
  };
  const size_t heads = static_cast<size_t>(kv_heads);
  Section sections[6] = {{"key codes", key_codes, heads * KeyCodeBytes()},
                         {"value codes", value_codes, heads * ValueCodeBytes()}};
  int n = 2;
  if (format == PageFormat::kAffine) {
    sections[n++] = {"key scales", key_scales, heads * KeyMetaBytes()};
    sections[n++] = {"key zeros", key_zeros, heads * KeyMetaBytes()};
    sections[n++] = {"value scales", value_scales, heads * ValueMetaBytes()};
    sections[n++] = {"value zeros", value_zeros, heads * ValueMetaBytes()};
  }
  if (page_bytes == 0 || page_bytes % 16 != 0) {
    return bad("page_bytes must be a positive multiple of 16, got ", page_bytes);
  }
  for (int i = 0; i < n; ++i) {
    const Section& x = sections[i];
    if (x.offset % 16 != 0) return bad(x.name, " at ", x.offset, ": not 16-byte aligned");
    if (x.offset + x.bytes > page_bytes) {
      return bad(x.name, " [", x.offset, ", ", x.offset + x.bytes, ") past the page's ", page_bytes,
                 " bytes");
    }
    for (int j = 0; j < i; ++j) {
      const Section& y = sections[j];
      if (x.offset < y.offset + y.bytes && y.offset < x.offset + x.bytes) {
        return bad(x.name, " and ", y.name, " overlap");
      }
    }
  }
  return absl::OkStatus();
}

bool RunsCodebookKernel(const PagedKvLayout& layout, const PagedDecodeArgs& args) {
  return layout.Validate().ok() && UsesCodebookKernel(layout, args);
}

size_t WorkspaceBytes(int batch, int q_heads, int head_dim, int splits) {
  const size_t rows = static_cast<size_t>(batch) * q_heads * splits;
  return rows * head_dim * sizeof(float) + rows * 2 * sizeof(float);
}

int ChooseSplits(const PagedKvLayout& layout, const PagedDecodeArgs& args, int max_pages_in_batch) {
  if (args.splits > 0) return args.splits;
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int group = layout.kv_heads > 0 && args.q_heads >= layout.kv_heads
                        ? std::min(8, args.q_heads / layout.kv_heads)
                        : 4;
  int per_sm = 0;
  int blocks_per_seq = layout.kv_heads;
  if (layout.Validate().ok() && UsesCodebookKernel(layout, args)) {
    per_sm = CodebookResidentBlocks(layout, group);
    blocks_per_seq = CodebookBlocksPerSplit(layout, group);
  } else if (layout.format == PageFormat::kGeneral && layout.Validate().ok()) {
    per_sm = layout.head_dim == 64 ? GeneralResidentBlocks<64>(group)
                                   : GeneralResidentBlocks<128>(group);
  } else if (layout.Validate().ok()) {
    auto resident = [&]<int D, PageFormat F, int KB, int VB>() {
      return ResidentBlocks<D, F, KB, VB>(layout, group, args.kernel);
    };
    per_sm = layout.head_dim == 64 ? DispatchBits<64>(layout, resident)
                                   : DispatchBits<128>(layout, resident);
  }
  // About four times as many blocks as fit on the device at once, so that the last wave is
  // short and uneven splits even out; each split at least 4 slices.
  const int slots = sms * std::max(1, per_sm);
  const int blocks = std::max(1, args.batch * blocks_per_seq);
  int splits = std::max(1, (4 * slots + blocks - 1) / blocks);
  const int tiles = layout.page_tokens > 0 && layout.format != PageFormat::kGeneral
                        ? max_pages_in_batch * (layout.page_tokens / layout.TileTokens())
                        : max_pages_in_batch;
  splits = std::min(splits, std::max(1, tiles / 4));
  // At most 64: more (up to 256, tried on an H200) made one long sequence slower, 0.198 ->
  // 0.241 ms at 128k tokens, though 64 leaves it 1.3 waves of blocks: each block's pipeline
  // fill and the merge's partials cost more than the idle tail (cuda_decode_notes.md).
  return std::min(splits, 64);
}

absl::Status PagedDecode(const PagedKvLayout& layout, const PagedDecodeArgs& args,
                         int max_pages_in_batch, cudaStream_t stream) {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  if (args.batch < 1 || args.q_heads < layout.kv_heads || args.q_heads % layout.kv_heads != 0 ||
      args.q_heads / layout.kv_heads > 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged decode: q_heads (", args.q_heads, ") must be 1..8 times kv_heads (",
        layout.kv_heads, "), batch (", args.batch, ") >= 1"));
  }
  if (args.pages == nullptr || args.block_table == nullptr || args.page_counts == nullptr ||
      args.q == nullptr || args.out == nullptr || args.workspace == nullptr) {
    return absl::InvalidArgumentError("paged decode: a device pointer is null");
  }
  if (args.window_lens != nullptr &&
      (args.window_k == nullptr || args.window_v == nullptr || args.max_window < 1)) {
    return absl::InvalidArgumentError("paged decode: window_lens without window_k/v/max_window");
  }
  if (layout.format == PageFormat::kGeneral &&
      (args.page_descs == nullptr || args.page_desc_ids == nullptr)) {
    return absl::InvalidArgumentError(
        "paged decode: general pages need page_descs and page_desc_ids");
  }
  const int splits = ChooseSplits(layout, args, max_pages_in_batch);
  if (UsesCodebookKernel(layout, args)) {
    return layout.head_dim == 64 ? LaunchCodebook<64>(layout, args, splits, stream)
                                 : LaunchCodebook<128>(layout, args, splits, stream);
  }
  if (layout.format == PageFormat::kGeneral) {
    return layout.head_dim == 64 ? LaunchGeneral<64>(layout, args, splits, stream)
                                 : LaunchGeneral<128>(layout, args, splits, stream);
  }
  return layout.head_dim == 64 ? LaunchFor<64>(layout, args, splits, stream)
                               : LaunchFor<128>(layout, args, splits, stream);
}

}  // namespace strata::kernels::cuda
