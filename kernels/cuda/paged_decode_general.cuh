// The general paged decode kernel (PageFormat::kGeneral): every codec's pages, through their
// descriptors (page_desc.h). Included by paged_decode.cu inside its anonymous namespace, after
// MergeKernel and the helpers it uses.
//
// One block per (split, KV head, sequence), one warp per query head of the GQA group. For each
// page of the split: its descriptor into shared memory (and the next page prefetched into L2);
// for each part of the page, 16 tokens at a time, each thread decodes whole columns of K and V
// (PageDecodeColumn: one stored channel over the rows, with what depends on the channel alone
// computed once; the CPU reference's arithmetic) into fp32 rows in shared memory, each at its
// original channel, and a second pass adds outliers; then each warp scores its query against
// the 16 keys, updates its online softmax and accumulates the values. The full-precision window
// follows on the last split, as in the other kernels. It makes every codec run on the GPU; the
// fp16 and affine kernels stay the fast paths (cuda_decode_notes.md, versions 5 and 6).

constexpr int kGeneralRows = 16;  // tokens decoded and attended at a time

template <int D>
struct GeneralSmem {
  // fp32 rows padded by 16 bytes: a quarter-warp's 16-byte reads of 8 rows at one column fall in
  // 8 different groups of 4 banks, and rows stay 16-byte aligned.
  static constexpr int kStride = D + 4;
  size_t desc = 0, k = 0, v = 0, q = 0, p = 0, total = 0;
  __host__ __device__ explicit GeneralSmem(int group) {
    desc = 0;
    k = Align16(sizeof(PageDesc));
    v = k + Align16(static_cast<size_t>(kGeneralRows) * kStride * sizeof(float));
    q = v + Align16(static_cast<size_t>(kGeneralRows) * kStride * sizeof(float));
    p = q + Align16(static_cast<size_t>(group) * D * sizeof(float));
    total = p + Align16(static_cast<size_t>(group) * kGeneralRows * sizeof(float));
  }
};

// One warp's query head over `n` (1..16) rows of fp32 K and V in shared memory.
template <int D>
struct GeneralHead {
  static constexpr int kPer = D / kWarp;  // value channels per lane: lane + 32 * i
  float acc[kPer];
  float m = -INFINITY;
  float l = 0;

  __device__ void Attend(const float* k, const float* v, const float* q, float* p, int n) {
    constexpr int kStride = GeneralSmem<D>::kStride;
    constexpr int kHalf = D / 2;
    const int lane = threadIdx.x % kWarp;
    const int t = lane % kGeneralRows;
    const int half = lane / kGeneralRows;
    // Lane (t, half) takes half of token t's channels, four at a time (16-byte reads; the
    // query's are the same address across the quarter-warp: one broadcast).
    float s = 0;
    if (t < n) {
      const float4* kr = reinterpret_cast<const float4*>(k + t * kStride + half * kHalf);
      const float4* qr = reinterpret_cast<const float4*>(q + half * kHalf);
#pragma unroll 8
      for (int j = 0; j < kHalf / 4; ++j) {
        const float4 x = kr[j], y = qr[j];
        s = fmaf(x.x, y.x, s);
        s = fmaf(x.y, y.y, s);
        s = fmaf(x.z, y.z, s);
        s = fmaf(x.w, y.w, s);
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, kGeneralRows);
    if (t >= n) s = -INFINITY;
    float mx = s;
#pragma unroll
    for (int o = kGeneralRows / 2; o > 0; o >>= 1)
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m, mx);
    const float correction = m == -INFINITY ? 0.f : __expf(m - m_new);
    const float pt = t < n ? __expf(s - m_new) : 0.f;
    float sum = pt;
#pragma unroll
    for (int o = kGeneralRows / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    l = l * correction + sum;
    m = m_new;
    if (half == 0) p[t] = pt;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] *= correction;
    for (int r = 0; r < n; ++r) {
      const float pr = p[r];
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[i] = fmaf(pr, v[r * kStride + lane + kWarp * i], acc[i]);
    }
    __syncwarp();
  }
};

// Registers capped at 128 a thread (two blocks of the largest group, 8 warps; four of the usual
// 4): without the cap the compiler took 176, two blocks of 4 warps per multiprocessor, too few
// to cover the columns' load latency.
template <int D>
__global__ void __launch_bounds__(8 * kWarp, 2)
    GeneralDecodeKernel(PagedKvLayout L, PagedDecodeArgs a, int splits, float* part_acc,
                        float* part_ml) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kStride = GeneralSmem<D>::kStride;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int seq = blockIdx.z;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int group = a.q_heads / L.kv_heads;
  const GeneralSmem<D> S(group);
  PageDesc* desc = reinterpret_cast<PageDesc*>(smem + S.desc);
  float* ks = reinterpret_cast<float*>(smem + S.k);
  float* vs = reinterpret_cast<float*>(smem + S.v);
  float* qs = reinterpret_cast<float*>(smem + S.q);
  float* ps = reinterpret_cast<float*>(smem + S.p) + warp * kGeneralRows;

  const float scale = a.scale != 0 ? a.scale : rsqrtf(static_cast<float>(D));
  const float* q = a.q + (static_cast<size_t>(seq) * a.q_heads + kvh * group) * D;
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) qs[i] = q[i] * scale;
  GeneralHead<D> head;
#pragma unroll
  for (int i = 0; i < GeneralHead<D>::kPer; ++i) head.acc[i] = 0;

  const int pages = a.page_counts[seq];
  const int per_split = (pages + splits - 1) / splits;
  const int p0 = min(pages, split * per_split);
  const int p1 = min(pages, p0 + per_split);
  const int32_t* table = a.block_table + static_cast<size_t>(seq) * a.max_pages;
  const uint32_t D32 = static_cast<uint32_t>(D);
  const int64_t page_bytes = static_cast<int64_t>(L.PageBytes());
  // Column work of this thread: with at least D threads, channel tid % D of every (threads / D)-th
  // row (threads past a multiple of D idle); with fewer, channels tid, tid + threads, ... of
  // every row.
  const int threads = blockDim.x;
  const int row_step = threads >= D ? threads / D : 1;
  const bool decodes = threads < D || threadIdx.x < row_step * D;
  const int first_row = threads >= D ? threadIdx.x / D : 0;
  auto smem_add = [](float* at, float x) { atomicAdd(at, x); };
  for (int pi = p0; pi < p1; ++pi) {
    const int64_t id = table[pi];
    const uint8_t* page = a.pages + id * page_bytes;
    // The next page into L2 while this one is decoded: this block's share of it (1 / kv_heads:
    // the blocks of the page's other KV heads, which run at about the same time, take the rest;
    // a head's sections are spread over the page, so the shares are slices, not heads).
    if (pi + 1 < p1) {
      const uint8_t* next = a.pages + static_cast<int64_t>(table[pi + 1]) * page_bytes;
      const int64_t share = (page_bytes / L.kv_heads + 127) / 128 * 128;
      const int64_t end = min(page_bytes, share * (kvh + 1));
      for (int64_t off = share * kvh + threadIdx.x * 128; off < end; off += threads * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(next + off));
      }
    }
    __syncthreads();  // the previous page's descriptor and rows are no longer read
    {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(a.page_descs + a.page_desc_ids[id]);
      uint32_t* dst = reinterpret_cast<uint32_t*>(desc);
      for (int i = threadIdx.x; i < static_cast<int>(sizeof(PageDesc) / 4); i += blockDim.x) {
        dst[i] = __ldg(src + i);
      }
    }
    __syncthreads();
    const uint32_t parts = desc->parts;
    for (uint32_t part = 0; part < parts; ++part) {
      const uint32_t T = desc->part[part].tokens;
      const PageTensorDesc tk = desc->part[part].k;
      const PageTensorDesc tv = desc->part[part].v;
      for (uint32_t t0 = 0; t0 < T; t0 += kGeneralRows) {
        const uint32_t n = min(static_cast<uint32_t>(kGeneralRows), T - t0);
        __syncthreads();  // the rows of the previous 16 tokens were attended
        if (decodes) {
          for (int d = threads >= D ? threadIdx.x % D : threadIdx.x; d < D; d += threads) {
            PageDecodeColumn(page, a.constants, tk, T, D32, kvh, t0, n, d, first_row, row_step, ks,
                             kStride);
            PageDecodeColumn(page, a.constants, tv, T, D32, kvh, t0, n, d, first_row, row_step, vs,
                             kStride);
            if (threads >= D) break;
          }
        }
        if (tk.outliers > 0 || tv.outliers > 0) {
          __syncthreads();
          const uint32_t nk = PageOutlierItems(tk, true, D32, n);
          const uint32_t nv = PageOutlierItems(tv, false, D32, n);
          for (uint32_t i = threadIdx.x; i < nk + nv; i += threads) {
            if (i < nk) {
              PageOutlier(page, a.constants, tk, true, T, D32, kvh, t0, n, i, ks, kStride,
                          smem_add);
            } else {
              PageOutlier(page, a.constants, tv, false, T, D32, kvh, t0, n, i - nk, vs, kStride,
                          smem_add);
            }
          }
        }
        __syncthreads();
        if (warp < group) head.Attend(ks, vs, qs + warp * D, ps, static_cast<int>(n));
      }
    }
  }
  // The window (full precision, newest tokens): the last split's.
  const int window = a.window_lens != nullptr ? a.window_lens[seq] : 0;
  if (split == splits - 1 && window > 0) {
    const int slot = a.window_slots != nullptr ? a.window_slots[seq] : seq;
    const size_t base = (static_cast<size_t>(slot) * L.kv_heads + kvh) * a.max_window * D;
    for (int w0 = 0; w0 < window; w0 += kGeneralRows) {
      const int n = min(kGeneralRows, window - w0);
      __syncthreads();
      for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        const size_t at = base + static_cast<size_t>(w0 + r) * D + d;
        ks[r * kStride + d] = __half2float(a.window_k[at]);
        vs[r * kStride + d] = __half2float(a.window_v[at]);
      }
      __syncthreads();
      if (warp < group) head.Attend(ks, vs, qs + warp * D, ps, n);
    }
  }
  if (warp >= group) return;
  const int qh = kvh * group + warp;
  const size_t row = (static_cast<size_t>(seq) * a.q_heads + qh) * splits + split;
  float* acc = part_acc + row * D;
#pragma unroll
  for (int i = 0; i < GeneralHead<D>::kPer; ++i) acc[lane + kWarp * i] = head.acc[i];
  if (lane == 0) {
    part_ml[row * 2] = head.m;
    part_ml[row * 2 + 1] = head.l;
  }
}

template <int D>
absl::Status LaunchGeneral(const PagedKvLayout& L, const PagedDecodeArgs& a, int splits,
                           cudaStream_t stream) {
  const int group = a.q_heads / L.kv_heads;
  const size_t smem = GeneralSmem<D>(group).total;
  if (absl::Status s = AllowSharedBytes(GeneralDecodeKernel<D>, smem); !s.ok()) return s;
  float* part_acc = static_cast<float*>(a.workspace);
  float* part_ml = part_acc + static_cast<size_t>(a.batch) * a.q_heads * splits * D;
  const dim3 grid(splits, L.kv_heads, a.batch);
  GeneralDecodeKernel<D><<<grid, group * kWarp, smem, stream>>>(L, a, splits, part_acc, part_ml);
  MergeKernel<<<a.batch * a.q_heads, std::min(D, 128), 0, stream>>>(D, splits, part_acc, part_ml,
                                                                    a.out);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged decode: launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

template <int D>
int GeneralResidentBlocks(int group) {
  const size_t smem = GeneralSmem<D>(group).total;
  int blocks = 0;
  if (!AllowSharedBytes(GeneralDecodeKernel<D>, smem).ok() ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, GeneralDecodeKernel<D>, group * kWarp,
                                                    smem) != cudaSuccess) {
    return 0;
  }
  return blocks;
}
