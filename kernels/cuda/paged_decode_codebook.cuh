// The codebook paged decode kernel: kGeneral pools whose every page is CQ
// (PagedKvLayout::codebook_group: K and V as codebook codes of `codebook_bits` over runs of
// `codebook_group` channels, with or without a per-token norm, no other term; parts of plain fp16,
// attention sinks, beside them). Included by
// paged_decode.cu inside its anonymous namespace, after the general kernel.
//
// The general kernel decodes every element of K and V into shared memory and attends at fp32;
// over CQ pages that is one codebook gather per element, and CQ's pages are 8-16x smaller than
// fp16's, so it spends its time on instructions, not on bytes. This one never decodes an element:
//
//   keys    q.k = norm_t * Σ_g q_g . centroid_g[code_tg]: a table T[h][g][e] = q_h,g . K_cb[g][e]
//           is built once per block from the query (heads x groups x 2^bits dot products of
//           `group` channels), after which a token's score is one table lookup per channel
//           group (D / group of them) per query head, summed.
//   values  Σ_t p_t v_t = Σ_t (p_t * norm_t) * V_cb[g][code_tg] per group: a thread owns one
//           channel group and a share of the tile's tokens, gathers the group's centroid (group
//           halves, one vector load) from the value codebook staged in shared memory and adds it,
//           weighted, into every query head's accumulator; the shares are summed at the end.
//
// One block per (split, KV head, chunk of the GQA group's query heads, sequence), 256 threads.
// Shared memory holds the key table (fp32) and the value codebook (fp16) of the block's KV head,
// so the query heads of a group are taken in chunks that fit (CodebookHeads): a chunk of 4 at
// c4:b8 and head dim 128 (128 KiB of table); a second chunk reads the same codes again, from L2.
// The pages' codes (and norms) of the block's KV head stream through shared memory 64 tokens at
// a time, kCbStages tiles in flight (cp.async, 16-byte copies of the aligned bytes around each
// section's run: a page is 16-byte aligned and a multiple of 16 bytes long, so they stay inside
// it). Per tile: scores (4 threads per token, a quarter of the groups each, summed by shuffles),
// the online softmax (one warp per query head), the value sums. An fp16 part's tiles (sinks)
// and the window (on the last split) take the same three steps over their rows as they are in
// global memory.

constexpr int kCbThreads = 256;
constexpr int kCbTile = 64;  // tokens per tile
constexpr int kCbStages = 3;
constexpr int kCbMaxHeads = 8;
constexpr int kCbThreadsPerToken = kCbThreads / kCbTile;  // 4

// Where everything is in the codebook kernel's shared memory, for head dim D, `group` channels per
// run, `bits` per code and `heads` query heads per block.
struct CodebookSmem {
  size_t table = 0, vcb = 0, q = 0, p = 0, corr = 0, stages = 0, total = 0;
  uint32_t row_bytes = 0;  // one token's codes of one head
  uint32_t code_room = 0;  // a stage's room for a tile's codes of K (and again of V)
  uint32_t norm_room = 0;  // ... for a tile's norms of K (and of V)
  uint32_t stage_bytes = 0;
  STRATA_HOST_DEVICE CodebookSmem(int D, int group, int bits, int heads) {
    const size_t groups = static_cast<size_t>(D / group), entries = size_t{1} << bits;
    row_bytes = static_cast<uint32_t>((groups * bits + 7) / 8);
    const size_t table_bytes = static_cast<size_t>(heads) * groups * entries * sizeof(float);
    // At the end the table's room holds the value sums of every share: [shares][heads][D].
    const size_t shares = kCbThreads / groups;
    const size_t reduce_bytes = shares * heads * D * sizeof(float);
    table = 0;
    vcb = Align16(table_bytes > reduce_bytes ? table_bytes : reduce_bytes);
    q = vcb + Align16(static_cast<size_t>(D) * entries * 2);
    p = q + Align16(static_cast<size_t>(heads) * D * sizeof(float));
    corr = p + Align16(static_cast<size_t>(heads) * kCbTile * sizeof(float));
    stages = corr + Align16(kCbMaxHeads * sizeof(float));
    // A run of n bytes copied as the 16-byte words around it: at most n + 30 bytes.
    code_room = static_cast<uint32_t>(Align16(static_cast<size_t>(kCbTile) * row_bytes + 30));
    norm_room = static_cast<uint32_t>(Align16(kCbTile * 2 + 30));
    stage_bytes = 2 * code_room + 2 * norm_room;
    total = stages + static_cast<size_t>(kCbStages) * stage_bytes;
  }
};

// One tile of a page: this KV head's tokens [t0, t0 + n) of one of the page's parts, where they
// are in global memory: a CQ part's codes (and norms) and the codebooks the page names, or an
// fp16 part's rows (attention sinks). n = 0: nothing (past the page's parts, or a part that is
// neither CQ of the pool's shape nor plain fp16: the host refuses those, and the kernel reads
// nothing of it rather than past its shared memory).
struct CbTile {
  const uint8_t* k_codes = nullptr;  // CQ: codes; fp16: rows [n][D] halves
  const uint8_t* v_codes = nullptr;
  const uint8_t* k_norms = nullptr;  // CQ: fp16 per token, or null
  const uint8_t* v_norms = nullptr;
  uint32_t n = 0;
  bool fp16 = false;
  uint32_t k_codebook = 0, v_codebook = 0;  // CQ: descriptor addresses
};

// Where a block is in its split's pages: tile r of page pi, every part's tokens taken in tiles of
// kCbTile, part after part. Blocks walk their tiles with two of these (the one staged ahead, the
// one attended), so no iteration is spent on a tile that does not exist.
struct CbCursor {
  int page = 0;
  uint32_t tile = 0;
};

// The tiles of page pi: each part's tokens in tiles of kCbTile.
__device__ __forceinline__ uint32_t CbPageTiles(const PagedDecodeArgs& a, const int32_t* table,
                                                int pi) {
  const PageDesc* d = a.page_descs + a.page_desc_ids[table[pi]];
  const uint32_t parts = min(d->parts, static_cast<uint32_t>(kMaxPageParts));
  uint32_t tiles = 0;
  for (uint32_t p = 0; p < parts; ++p) tiles += (d->part[p].tokens + kCbTile - 1) / kCbTile;
  return tiles;
}

// The next tile after `c` among pages [.., p1) (c.page == p1 past the last), skipping pages of
// no tiles. The same for every thread of a block.
__device__ __forceinline__ void CbAdvance(CbCursor& c, const PagedDecodeArgs& a,
                                          const int32_t* table, int p1) {
  if (c.page < p1 && ++c.tile < CbPageTiles(a, table, c.page)) return;
  c.tile = 0;
  for (++c.page; c.page < p1 && CbPageTiles(a, table, c.page) == 0; ++c.page) {
  }
}

// The first tile of pages [p0, p1) (page == p1: none).
__device__ __forceinline__ CbCursor CbFirst(const PagedDecodeArgs& a, const int32_t* table, int p0,
                                            int p1) {
  CbCursor c{p0, 0};
  while (c.page < p1 && CbPageTiles(a, table, c.page) == 0) ++c.page;
  return c;
}

template <int D, int C>
__device__ __forceinline__ CbTile LocateCbTile(const PagedKvLayout& L, const PagedDecodeArgs& a,
                                               const int32_t* table, CbCursor at, int kvh,
                                               uint32_t row_bytes) {
  CbTile t;
  const int pi = at.page;
  uint32_t r = at.tile;
  const int64_t id = table[pi];
  const uint8_t* page = a.pages + id * static_cast<int64_t>(L.PageBytes());
  const PageDesc* d = a.page_descs + a.page_desc_ids[id];
  const uint32_t parts = min(d->parts, static_cast<uint32_t>(kMaxPageParts));
  for (uint32_t p = 0; p < parts; ++p) {
    const uint32_t T = d->part[p].tokens;
    const uint32_t tiles = (T + kCbTile - 1) / kCbTile;
    if (r >= tiles) {
      r -= tiles;
      continue;
    }
    const uint32_t t0 = r * kCbTile;
    const PageTensorDesc& k = d->part[p].k;
    const PageTensorDesc& v = d->part[p].v;
    const size_t row = static_cast<size_t>(kvh) * T + t0;
    if (k.kind == PageCode::kFp16 && v.kind == PageCode::kFp16) {
      const bool plain = k.rank == 0 && v.rank == 0 && k.outliers == 0 && v.outliers == 0 &&
                         k.channel_norm == 0 && v.channel_norm == 0 && k.channel_perm == 0 &&
                         v.channel_perm == 0 && k.head_mean == 0 && v.head_mean == 0 &&
                         k.row_bytes == D * 2 && v.row_bytes == D * 2;
      if (!plain) return t;
      t.fp16 = true;
      t.n = min(static_cast<uint32_t>(kCbTile), T - t0);
      t.k_codes = PageAddr(page, a.constants, k.codes) + row * (D * 2);
      t.v_codes = PageAddr(page, a.constants, v.codes) + row * (D * 2);
      return t;
    }
    constexpr uint32_t kGroups = D / C;
    const bool cq = k.kind == PageCode::kCodebook && v.kind == PageCode::kCodebook &&
                    k.bits == L.codebook_bits && v.bits == L.codebook_bits && k.group_size == C &&
                    v.group_size == C && k.groups == kGroups && v.groups == kGroups &&
                    k.row_bytes == row_bytes && v.row_bytes == row_bytes && k.codebook != 0 &&
                    v.codebook != 0;
    if (!cq) return t;
    t.n = min(static_cast<uint32_t>(kCbTile), T - t0);
    t.k_codes = PageAddr(page, a.constants, k.codes) + row * row_bytes;
    t.v_codes = PageAddr(page, a.constants, v.codes) + row * row_bytes;
    if (k.scales != 0) t.k_norms = PageAddr(page, a.constants, k.scales) + row * 2;
    if (v.scales != 0) t.v_norms = PageAddr(page, a.constants, v.scales) + row * 2;
    t.k_codebook = k.codebook;
    t.v_codebook = v.codebook;
    return t;
  }
  return t;
}

// The 16-byte words around [src, src + bytes) into dst (in flight; the caller commits): the run's
// first byte lands at dst + (src & 15).
__device__ __forceinline__ void StageRun(uint8_t* dst, const uint8_t* src, size_t bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(src);
  const uintptr_t first = at & ~static_cast<uintptr_t>(15);
  const uintptr_t end = (at + bytes + 15) & ~static_cast<uintptr_t>(15);
  const uint8_t* from = reinterpret_cast<const uint8_t*>(first);
  for (uintptr_t i = threadIdx.x; i < (end - first) / 16; i += blockDim.x) {
    CpAsync16(dst + i * 16, from + i * 16);
  }
}

// Where a staged run's first byte is.
__device__ __forceinline__ const uint8_t* Staged(const uint8_t* buffer, const void* src) {
  return buffer + (reinterpret_cast<uintptr_t>(src) & 15);
}

// Code g of a row of `bits`-bit codes, packed low bits first (a code may straddle a byte: the
// byte after a row's last is read, and masked off; shared memory always has one there).
__device__ __forceinline__ uint32_t CbCode(const uint8_t* row, uint32_t g, int bits) {
  if (bits == 8) return row[g];
  const uint32_t bit = g * static_cast<uint32_t>(bits);
  const uint32_t w = row[bit >> 3] | (static_cast<uint32_t>(row[(bit >> 3) + 1]) << 8);
  return (w >> (bit & 7)) & ((1u << bits) - 1u);
}

// One word at p: through the read-only cache (global memory) or a plain load (shared memory).
template <bool kGlobal, typename T>
__device__ __forceinline__ T LoadWord(const T* p) {
  if constexpr (kGlobal) {
    return __ldg(p);
  } else {
    return *p;
  }
}

// C fp16 values (C = 2, 4 or 8: one 4-, 8- or 16-byte load, aligned to it) as floats, from global
// memory (kGlobal) or shared memory.
template <int C, bool kGlobal>
__device__ __forceinline__ void LoadHalvesFrom(const __half* p, float* out) {
  using Word = std::conditional_t<C == 2, unsigned int, std::conditional_t<C == 4, uint2, uint4>>;
  const Word w = LoadWord<kGlobal>(reinterpret_cast<const Word*>(p));
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&w);
#pragma unroll
  for (int i = 0; i < C / 2; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
template <int C>
__device__ __forceinline__ void LoadHalves(const __half* p, float* out) {
  LoadHalvesFrom<C, false>(p, out);
}
template <int C>
__device__ __forceinline__ void LoadHalvesGlobal(const __half* p, float* out) {
  LoadHalvesFrom<C, true>(p, out);
}

// What a block keeps in registers: its thread's share of the value sums (one channel group, every
// query head of the chunk) and, in warp h, query head h's softmax state.
template <int C>
struct CbState {
  float acc[kCbMaxHeads][C];
  float m = -INFINITY;
  float l = 0;
};

// Online softmax of the tile's n scores of each query head (warp h: head h) in p[h][...]: leaves
// exp(s - m) there and each head's rescale factor in corr[h].
template <int C>
__device__ __forceinline__ void CbSoftmax(CbState<C>& st, float* p, float* corr, int heads, int n) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (warp >= heads) return;
  float* s = p + warp * kCbTile;
  float mx = -INFINITY;
  for (int t = lane; t < n; t += kWarp) mx = fmaxf(mx, s[t]);
  mx = WarpMax(mx);
  const float m_new = fmaxf(st.m, mx);
  const float c = st.m == -INFINITY ? 0.f : __expf(st.m - m_new);
  float sum = 0;
  for (int t = lane; t < n; t += kWarp) {
    const float e = __expf(s[t] - m_new);
    s[t] = e;
    sum += e;
  }
  sum = WarpSum(sum);
  st.l = st.l * c + sum;
  st.m = m_new;
  if (lane == 0) corr[warp] = c;
}

// Every thread's value sums times its head's rescale factor.
template <int C>
__device__ __forceinline__ void CbRescale(CbState<C>& st, const float* corr, int heads) {
#pragma unroll
  for (int h = 0; h < kCbMaxHeads; ++h) {
    if (h < heads) {
      const float c = corr[h];
#pragma unroll
      for (int i = 0; i < C; ++i) st.acc[h][i] *= c;
    }
  }
}

// Between a tile's scores (in p) and its value sums, every thread of the block: each head's online
// softmax, then every thread's sums rescaled by its head's factor.
template <int C>
__device__ __forceinline__ void CbSoftmaxStep(CbState<C>& st, float* p, float* corr, int heads,
                                              int n) {
  __syncthreads();  // the scores are in
  CbSoftmax<C>(st, p, corr, heads, n);
  __syncthreads();  // the probabilities and the factors are in
  CbRescale<C>(st, corr, heads);
}

// Attends the block's query heads over n (<= kCbTile) fp16 rows in global memory, K at k and V
// at v (row stride D halves: an fp16 part of a page, or the window): the codebook steps with the
// rows read as they are. Every thread of the block calls it (it holds barriers).
template <int D, int C>
__device__ __forceinline__ void CbAttendFp16Rows(CbState<C>& st, const __half* k, const __half* v,
                                                 int n, const float* qs, float* ps, float* corr,
                                                 int heads) {
  constexpr int kGroups = D / C;
  constexpr int kShares = kCbThreads / kGroups;
  constexpr int kSpan = D / kCbThreadsPerToken;  // key channels per scoring thread
  const int tid = threadIdx.x;
  const int score_token = tid / kCbThreadsPerToken, sub = tid % kCbThreadsPerToken;
  const int vg = tid % kGroups, share = tid / kGroups;
  {
    float s[kCbMaxHeads];
#pragma unroll
    for (int h = 0; h < kCbMaxHeads; ++h) s[h] = 0;
    if (score_token < n) {
      const __half* kr = k + static_cast<size_t>(score_token) * D + sub * kSpan;
#pragma unroll
      for (int c0 = 0; c0 < kSpan; c0 += 8) {
        float kf[8];
        LoadHalvesGlobal<8>(kr + c0, kf);
#pragma unroll
        for (int h = 0; h < kCbMaxHeads; ++h) {
          if (h < heads) {
            const float* qh = qs + h * D + sub * kSpan + c0;
#pragma unroll
            for (int i = 0; i < 8; ++i) s[h] = fmaf(qh[i], kf[i], s[h]);
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kCbMaxHeads; ++h) {
      s[h] += __shfl_xor_sync(0xffffffffu, s[h], 1);
      s[h] += __shfl_xor_sync(0xffffffffu, s[h], 2);
    }
    if (sub == 0 && score_token < n) {
#pragma unroll
      for (int h = 0; h < kCbMaxHeads; ++h) {
        if (h < heads) ps[h * kCbTile + score_token] = s[h];
      }
    }
  }
  CbSoftmaxStep<C>(st, ps, corr, heads, n);
  for (int tok = share; tok < n; tok += kShares) {
    float c[C];
    LoadHalvesGlobal<C>(v + static_cast<size_t>(tok) * D + vg * C, c);
#pragma unroll
    for (int h = 0; h < kCbMaxHeads; ++h) {
      if (h < heads) {
        const float w = ps[h * kCbTile + tok];
#pragma unroll
        for (int i = 0; i < C; ++i) st.acc[h][i] = fmaf(w, c[i], st.acc[h][i]);
      }
    }
  }
  __syncthreads();
}

template <int D, int C>
__global__ void __launch_bounds__(kCbThreads, 1)
    CodebookDecodeKernel(PagedKvLayout L, PagedDecodeArgs a, int splits, float* part_acc,
                         float* part_ml, int heads_per_block) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kGroups = D / C;
  constexpr int kGroupsPerThread = kGroups / kCbThreadsPerToken;  // scores: a quarter each
  constexpr int kShares = kCbThreads / kGroups;                   // value sums: token shares
  static_assert(kGroups % kCbThreadsPerToken == 0 && kCbThreads % kGroups == 0);
  const int bits = L.codebook_bits;
  const int entries = 1 << bits;
  const int group = a.q_heads / L.kv_heads;
  const int chunks = (group + heads_per_block - 1) / heads_per_block;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / chunks;
  const int h0 = (blockIdx.y % chunks) * heads_per_block;
  const int heads = min(heads_per_block, group - h0);
  const int seq = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / kWarp, lane = tid % kWarp;
  const CodebookSmem S(D, C, bits, heads_per_block);
  float* tab = reinterpret_cast<float*>(smem + S.table);  // [heads][groups][entries]
  __half* vcb = reinterpret_cast<__half*>(smem + S.vcb);  // [groups][entries][C]
  float* qs = reinterpret_cast<float*>(smem + S.q);       // [heads][D], scaled
  float* ps = reinterpret_cast<float*>(smem + S.p);       // [heads][kCbTile]
  float* corr = reinterpret_cast<float*>(smem + S.corr);  // [heads]
  uint8_t* stages = smem + S.stages;

  const float scale = a.scale != 0 ? a.scale : rsqrtf(static_cast<float>(D));
  const float* q = a.q + (static_cast<size_t>(seq) * a.q_heads + kvh * group + h0) * D;
  for (int i = tid; i < heads * D; i += kCbThreads) qs[i] = q[i] * scale;
  __syncthreads();  // the query is read by every thread (the table, the window's scores)

  CbState<C> st;
#pragma unroll
  for (int h = 0; h < kCbMaxHeads; ++h) {
#pragma unroll
    for (int i = 0; i < C; ++i) st.acc[h][i] = 0;
  }
  // Scores: token tid / 4 of a tile, groups [sub * kGroupsPerThread, +kGroupsPerThread).
  const int score_token = tid / kCbThreadsPerToken, sub = tid % kCbThreadsPerToken;
  // Value sums: channel group tid % kGroups, tokens tid / kGroups + kShares * i of a tile.
  const int vg = tid % kGroups, share = tid / kGroups;

  const int pages = a.page_counts[seq];
  const int per_split = (pages + splits - 1) / splits;
  const int p0 = min(pages, split * per_split);
  const int p1 = min(pages, p0 + per_split);
  const int32_t* table = a.block_table + static_cast<size_t>(seq) * a.max_pages;
  const uint32_t row_bytes = S.row_bytes;

  // Stages the tile at `at` into buffer `slot`.
  auto stage = [&](CbCursor at, int slot) {
    const CbTile t = LocateCbTile<D, C>(L, a, table, at, kvh, row_bytes);
    if (t.n == 0 || t.fp16) return;  // fp16 rows are read where they are
    uint8_t* buf = stages + static_cast<size_t>(slot) * S.stage_bytes;
    StageRun(buf, t.k_codes, static_cast<size_t>(t.n) * row_bytes);
    StageRun(buf + S.code_room, t.v_codes, static_cast<size_t>(t.n) * row_bytes);
    if (t.k_norms != nullptr) StageRun(buf + 2 * S.code_room, t.k_norms, t.n * 2);
    if (t.v_norms != nullptr) StageRun(buf + 2 * S.code_room + S.norm_room, t.v_norms, t.n * 2);
  };

  // The key table and the value codebook of the codebooks at these addresses.
  uint32_t have_k = 0, have_v = 0;
  auto load_codebooks = [&](uint32_t k_addr, uint32_t v_addr) {
    const size_t head_bytes = static_cast<size_t>(D) * entries * 2;  // one KV head's codebook
    const uint4* vsrc = reinterpret_cast<const uint4*>(PageAddr(nullptr, a.constants, v_addr) +
                                                       static_cast<size_t>(kvh) * head_bytes);
    for (size_t i = tid; i < head_bytes / 16; i += kCbThreads) {
      reinterpret_cast<uint4*>(vcb)[i] = __ldg(vsrc + i);
    }
    const __half* kcb = reinterpret_cast<const __half*>(PageAddr(nullptr, a.constants, k_addr) +
                                                        static_cast<size_t>(kvh) * head_bytes);
    const int per_head = kGroups * entries;
    for (int i = tid; i < heads * per_head; i += kCbThreads) {
      const int h = i / per_head, e = i % per_head;  // e = g * entries + code
      const int g = e >> bits;
      float c[C];
      LoadHalvesGlobal<C>(kcb + static_cast<size_t>(e) * C, c);
      const float* qg = qs + h * D + g * C;
      float s = 0;
#pragma unroll
      for (int k = 0; k < C; ++k) s = fmaf(qg[k], c[k], s);
      tab[i] = s;
    }
    have_k = k_addr;
    have_v = v_addr;
  };

  // Tile i of the split (in order) is staged into buffer i % kCbStages, kCbStages - 1 ahead of the
  // one attended.
  CbCursor ahead = CbFirst(a, table, p0, p1);
  CbCursor at = ahead;
  for (int s = 0; s < kCbStages - 1; ++s) {
    if (ahead.page < p1) {
      stage(ahead, s);
      CbAdvance(ahead, a, table, p1);
    }
    CpAsyncCommit();
  }
  for (int i = 0; at.page < p1; ++i, CbAdvance(at, a, table, p1)) {
    if (ahead.page < p1) {
      stage(ahead, (i + kCbStages - 1) % kCbStages);
      CbAdvance(ahead, a, table, p1);
    }
    CpAsyncCommit();
    CpAsyncWait<kCbStages - 1>();
    __syncthreads();  // tile i is in
    const CbTile t = LocateCbTile<D, C>(L, a, table, at, kvh, row_bytes);
    const int n = static_cast<int>(t.n);
    if (n > 0 && t.fp16) {
      CbAttendFp16Rows<D, C>(st, reinterpret_cast<const __half*>(t.k_codes),
                             reinterpret_cast<const __half*>(t.v_codes), n, qs, ps, corr, heads);
    } else if (n > 0) {
      if (t.k_codebook != have_k || t.v_codebook != have_v) {
        load_codebooks(t.k_codebook, t.v_codebook);
        __syncthreads();
      }
      const uint8_t* buf = stages + static_cast<size_t>(i % kCbStages) * S.stage_bytes;
      const uint8_t* kc = Staged(buf, t.k_codes);
      const uint8_t* vc = Staged(buf + S.code_room, t.v_codes);
      const __half* kn =
          t.k_norms != nullptr
              ? reinterpret_cast<const __half*>(Staged(buf + 2 * S.code_room, t.k_norms))
              : nullptr;
      const __half* vn = t.v_norms != nullptr ? reinterpret_cast<const __half*>(Staged(
                                                    buf + 2 * S.code_room + S.norm_room, t.v_norms))
                                              : nullptr;
      // Scores: the table's entries of the token's codes, summed over groups.
      {
        float s[kCbMaxHeads];
#pragma unroll
        for (int h = 0; h < kCbMaxHeads; ++h) s[h] = 0;
        if (score_token < n) {
          const uint8_t* row = kc + static_cast<size_t>(score_token) * row_bytes;
#pragma unroll
          for (int i = 0; i < kGroupsPerThread; ++i) {
            const int g = sub * kGroupsPerThread + i;
            const float* e = tab + (static_cast<size_t>(g) << bits) + CbCode(row, g, bits);
#pragma unroll
            for (int h = 0; h < kCbMaxHeads; ++h) {
              if (h < heads) s[h] += e[static_cast<size_t>(h) * kGroups * entries];
            }
          }
        }
#pragma unroll
        for (int h = 0; h < kCbMaxHeads; ++h) {
          s[h] += __shfl_xor_sync(0xffffffffu, s[h], 1);
          s[h] += __shfl_xor_sync(0xffffffffu, s[h], 2);
        }
        if (sub == 0 && score_token < n) {
          const float norm = kn != nullptr ? __half2float(kn[score_token]) : 1.f;
#pragma unroll
          for (int h = 0; h < kCbMaxHeads; ++h) {
            if (h < heads) ps[h * kCbTile + score_token] = s[h] * norm;
          }
        }
      }
      CbSoftmaxStep<C>(st, ps, corr, heads, n);
      // Value sums: each of the thread's tokens' centroid of its group, weighted per head.
      for (int tok = share; tok < n; tok += kShares) {
        float c[C];
        LoadHalves<C>(vcb + ((static_cast<size_t>(vg) << bits) +
                             CbCode(vc + static_cast<size_t>(tok) * row_bytes, vg, bits)) *
                                C,
                      c);
        const float norm = vn != nullptr ? __half2float(vn[tok]) : 1.f;
#pragma unroll
        for (int h = 0; h < kCbMaxHeads; ++h) {
          if (h < heads) {
            const float w = ps[h * kCbTile + tok] * norm;
#pragma unroll
            for (int i = 0; i < C; ++i) st.acc[h][i] = fmaf(w, c[i], st.acc[h][i]);
          }
        }
      }
    }
    __syncthreads();  // tile i's buffer, scores and probabilities are no longer read
  }
  CpAsyncWait<0>();

  // The window (fp16, newest tokens): the last split's.
  const int window = a.window_lens != nullptr ? a.window_lens[seq] : 0;
  if (split == splits - 1 && window > 0) {
    const int slot = a.window_slots != nullptr ? a.window_slots[seq] : seq;
    const size_t base = (static_cast<size_t>(slot) * L.kv_heads + kvh) * a.max_window * D;
    for (int w0 = 0; w0 < window; w0 += kCbTile) {
      CbAttendFp16Rows<D, C>(st, a.window_k + base + static_cast<size_t>(w0) * D,
                             a.window_v + base + static_cast<size_t>(w0) * D,
                             min(kCbTile, window - w0), qs, ps, corr, heads);
    }
  }

  // The shares' sums into the table's room, [share][head][D], then summed per (head, channel).
  float* red = tab;
#pragma unroll
  for (int h = 0; h < kCbMaxHeads; ++h) {
    if (h < heads) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        red[(static_cast<size_t>(share) * heads_per_block + h) * D + vg * C + i] = st.acc[h][i];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < heads * D; i += kCbThreads) {
    const int h = i / D, d = i % D;
    float sum = 0;
    for (int s = 0; s < kShares; ++s) {
      sum += red[(static_cast<size_t>(s) * heads_per_block + h) * D + d];
    }
    const int qh = kvh * group + h0 + h;
    const size_t row = (static_cast<size_t>(seq) * a.q_heads + qh) * splits + split;
    part_acc[row * D + d] = sum;
  }
  if (warp < heads && lane == 0) {
    const int qh = kvh * group + h0 + warp;
    const size_t row = (static_cast<size_t>(seq) * a.q_heads + qh) * splits + split;
    part_ml[row * 2] = st.m;
    part_ml[row * 2 + 1] = st.l;
  }
}

using CodebookKernelFn = void (*)(PagedKvLayout, PagedDecodeArgs, int, float*, float*, int);

// The codebook kernel for head dim D and the layout's channel runs, or null.
template <int D>
CodebookKernelFn CodebookKernelFor(const PagedKvLayout& L) {
  switch (L.codebook_group) {
    case 2:
      return CodebookDecodeKernel<D, 2>;
    case 4:
      return CodebookDecodeKernel<D, 4>;
    case 8:
      return CodebookDecodeKernel<D, 8>;
    default:
      return nullptr;
  }
}

// The device's shared memory a block may opt into (0 if unknown).
size_t OptInSharedBytes() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return 0;
  }
  return static_cast<size_t>(bytes);
}

// Query heads per block of the codebook kernel for a GQA group of `group` over a codebook pool:
// as many as fit in shared memory, at most kCbMaxHeads; 0 when the pool is not a codebook pool or
// not even one head's table fits.
int CodebookHeads(const PagedKvLayout& L, int group) {
  if (L.format != PageFormat::kGeneral || L.codebook_group == 0 ||
      (L.head_dim != 64 && L.head_dim != 128)) {
    return 0;
  }
  const size_t limit = OptInSharedBytes();
  for (int h = std::min(group, kCbMaxHeads); h >= 1; --h) {
    if (CodebookSmem(L.head_dim, L.codebook_group, L.codebook_bits, h).total <= limit) return h;
  }
  return 0;
}

// The codebook kernel's blocks that fit on one multiprocessor at once (0 if unknown).
int CodebookResidentBlocks(const PagedKvLayout& L, int group) {
  const int heads = CodebookHeads(L, group);
  if (heads == 0) return 0;
  const CodebookKernelFn kernel =
      L.head_dim == 64 ? CodebookKernelFor<64>(L) : CodebookKernelFor<128>(L);
  const size_t smem = CodebookSmem(L.head_dim, L.codebook_group, L.codebook_bits, heads).total;
  int blocks = 0;
  if (kernel == nullptr || !AllowSharedBytes(kernel, smem).ok() ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kCbThreads, smem) !=
          cudaSuccess) {
    return 0;
  }
  return blocks;
}

// Blocks per (sequence, split) of the codebook kernel: KV heads times chunks of query heads.
int CodebookBlocksPerSplit(const PagedKvLayout& L, int group) {
  const int heads = CodebookHeads(L, group);
  return heads == 0 ? L.kv_heads : L.kv_heads * ((group + heads - 1) / heads);
}

template <int D>
absl::Status LaunchCodebook(const PagedKvLayout& L, const PagedDecodeArgs& a, int splits,
                            cudaStream_t stream) {
  const int group = a.q_heads / L.kv_heads;
  const int heads = CodebookHeads(L, group);
  const CodebookKernelFn kernel = CodebookKernelFor<D>(L);
  if (heads == 0 || kernel == nullptr) {
    return absl::InvalidArgumentError("paged decode: not a codebook pool the kernel takes");
  }
  const size_t smem = CodebookSmem(D, L.codebook_group, L.codebook_bits, heads).total;
  if (absl::Status s = AllowSharedBytes(kernel, smem); !s.ok()) return s;
  float* part_acc = static_cast<float*>(a.workspace);
  float* part_ml = part_acc + static_cast<size_t>(a.batch) * a.q_heads * splits * D;
  const int chunks = (group + heads - 1) / heads;
  const dim3 grid(splits, L.kv_heads * chunks, a.batch);
  kernel<<<grid, kCbThreads, smem, stream>>>(L, a, splits, part_acc, part_ml, heads);
  MergeKernel<<<a.batch * a.q_heads, std::min(D, 128), 0, stream>>>(D, splits, part_acc, part_ml,
                                                                    a.out);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged decode: launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}
