// The tensor-core path of the paged decode attention (included by paged_decode.cu inside its
// anonymous namespace; uses its StageAsync, CpAsync16, CpAsync* and kWarp, and mma_ptx.cuh's
// instructions).
//
// One block per (split, KV head, sequence), four warps. Each warp takes its own 16-token slices
// of every page (warp w: tokens 16w.., 16(w+4).., ...) and keeps its own online softmax; the
// four warps' states are merged once, at the end of the block. A slice is two matrix products
// on the tensor cores (mma.sync m16n8k16, fp16 operands, fp32 sums):
//
//   scores  S[16 x 16 tokens]  = Q[16 x D] . K^T        (8 or 4 k-steps of 16 channels)
//   output  O[16 x D]         += P[16 x 16 tokens] . V  (one k-step, D/8 tiles)
//
// The 16 rows hold the query heads of the KV head's group twice: row h the fp16 rounding of head
// h's operand ("hi"), row h + 8 the fp16 rounding of what hi missed ("lo"). Rows h and h + 8 of a
// result sit in the same lane (c0,c1 and c2,c3 of the accumulator), so hi + lo is one add, and
// the products carry about 22 bits of the fp32 operand: the tensor cores' speed at nearly fp32
// precision, for groups of up to 8 query heads (rows 2G..15 unused when G < 8).
//
// fp16 pages are staged with their 16-byte chunks swizzled (chunk c of row r at c ^ (r & 7)), so
// that ldmatrix reads 8 rows without bank conflicts; K through ldmatrix, V through ldmatrix.trans.
// Affine codes become fp16 in registers by the 0x6400 trick (a code OR'd into the mantissa of
// 1024, less 1024: exact), two per instruction. For the keys, each lane's channel pairs are the
// ones a 32-bit word of codes yields (the dot product does not care about channel order: Q's
// fragments take the same order). For the values, a pair is one channel of two tokens (PRMT of
// the two tokens' words); output tiles are 8 consecutive channels in every format, so an fp16
// window adds into the same accumulators. Key scales are folded into Q per
// key group, the zeros into one bias per head; value scales into P per token and value group, the
// zeros into Σ p·zero per head and group.

constexpr int kMmaWarps = 4;
constexpr int kSlice = 16;  // tokens of one warp step

// x and y as an fp16 pair (hi) and the fp16 pair of what it missed (lo).
__device__ __forceinline__ void SplitHiLo(float x, float y, uint32_t* hi, uint32_t* lo) {
  const __half2 h = __floats2half2_rn(x, y);
  const float2 f = __half22float2(h);
  *hi = HalfBits2(h);
  *lo = HalfBits2(__floats2half2_rn(x - f.x, y - f.y));
}

// Two codes (at bits [0, B) and [16, 16 + B) of `w`, the rest of `w` ignored) as an fp16 pair.
template <int B>
__device__ __forceinline__ uint32_t CodePair(uint32_t w) {
  constexpr uint32_t kMask = ((1u << B) - 1u) * 0x00010001u;
  const uint32_t h = (w & kMask) | 0x64006400u;  // 1024 + code, exact in fp16
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&h), __float2half2_rn(1024.f));
  return HalfBits2(r);
}

// Byte offset of the 16-byte chunk `c` of row `r` in a swizzled fp16 tile of D halves per row.
template <int D>
__device__ __forceinline__ int Swizzled(int r, int c) {
  return r * D * 2 + ((c ^ (r & 7)) << 4);
}

// Where a lane's slice state lives. Lane (g = lane / 4, q = lane % 4) holds, of every result,
// rows g (hi) and g + 8 (lo) and, of a slice's scores, tokens 2q, 2q + 1, 8 + 2q, 9 + 2q.
template <int D>
struct MmaState {
  static constexpr int kTiles = D / 8;
  float o[kTiles][4];
  float z[D / 32];      // affine: Σ p·zero of head g, per 32-channel block (this lane's tokens)
  float m = -INFINITY;  // head g's running max (the same in the four lanes of the quad)
  float l = 0;          // this lane's part of head g's denominator
};

// Online softmax over a slice: s[4] (scores of the lane's tokens, -inf where masked) to p[4].
template <int D>
__device__ __forceinline__ void SliceSoftmax(MmaState<D>& st, const float (&s)[4], float (&p)[4]) {
  float mx = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(st.m, mx);
  if (m_new == -INFINITY) {  // nothing seen yet and nothing here
    p[0] = p[1] = p[2] = p[3] = 0;
    return;
  }
  const float corr = st.m == -INFINITY ? 0.f : __expf(st.m - m_new);
  float sum = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    p[i] = s[i] == -INFINITY ? 0.f : __expf(s[i] - m_new);
    sum += p[i];
  }
  st.l = st.l * corr + sum;
  if (corr != 1.f) {
#pragma unroll
    for (int n = 0; n < MmaState<D>::kTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[n][i] *= corr;
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i) st.z[i] *= corr;
  }
  st.m = m_new;
}

// Q's fragments (hi/lo) for fp16 keys, channels in natural order: per k-step kk, a0/a1 channels
// 16 kk + 2q, +1 and a2/a3 channels + 8, + 9 of head row g (zeros where the row is unused).
template <int D>
__device__ __forceinline__ void NaturalQFragments(uint32_t (&qa)[D / 16][4], const float* qp,
                                                  float q_norm, int q, bool row_used) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = 16 * kk + 2 * q;
    const float x0 = row_used ? qp[c] * q_norm : 0.f, x1 = row_used ? qp[c + 1] * q_norm : 0.f;
    const float x8 = row_used ? qp[c + 8] * q_norm : 0.f;
    const float x9 = row_used ? qp[c + 9] * q_norm : 0.f;
    SplitHiLo(x0, x1, &qa[kk][0], &qa[kk][1]);
    SplitHiLo(x8, x9, &qa[kk][2], &qa[kk][3]);
  }
}

// An fp16 slice: K and V tiles (swizzled, D halves per row) of which tokens [t0, t0 + 16) are
// read, `valid` of them real. qa: Q's fragments (hi/lo) per k-step, already scaled.
template <int D>
__device__ __forceinline__ void SliceFp16(MmaState<D>& st, const uint32_t (&qa)[D / 16][4],
                                          float score_scale, const uint8_t* k, const uint8_t* v,
                                          int t0, int valid) {
  const int lane = threadIdx.x % kWarp;
  const int q = lane % 4;
  float s[4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // two n-tiles of 8 tokens
    float c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
    const int row = t0 + 8 * j + (lane & 7);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
      uint32_t b[4];
      Ldmatrix4(b, k + Swizzled<D>(row, 2 * kk + (lane >> 3)));
      Mma(c0, qa[kk], b[0], b[1]);
      Mma(c1, qa[kk + 1], b[2], b[3]);
    }
    s[2 * j] = (c0[0] + c0[2] + c1[0] + c1[2]) * score_scale;
    s[2 * j + 1] = (c0[1] + c0[3] + c1[1] + c1[3]) * score_scale;
  }
  const int tok[4] = {2 * q, 2 * q + 1, 8 + 2 * q, 9 + 2 * q};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (tok[i] >= valid) s[i] = -INFINITY;
  }
  float p[4];
  SliceSoftmax<D>(st, s, p);
  uint32_t pa[4];
  SplitHiLo(p[0], p[1], &pa[0], &pa[1]);
  SplitHiLo(p[2], p[3], &pa[2], &pa[3]);
  const int vrow = t0 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int m = 0; m < D / 16; ++m) {
    uint32_t b[4];
    Ldmatrix4Trans(b, v + Swizzled<D>(vrow, 2 * m + (lane >> 4)));
    Mma(st.o[2 * m], pa, b[0], b[1]);
    Mma(st.o[2 * m + 1], pa, b[2], b[3]);
  }
}

// Value codes are staged with the 16-byte chunks of a row permuted: lanes read the rows of
// tokens 2q (and 2q + 1, ...) for q = 0..3 at the same column, rows that would otherwise share
// banks (a 64-byte row: 4 of them in one bank group). Chunk c of row r goes to
// c ^ ((r / rows-per-128-bytes) & (chunks per row - 1)).
template <int D, int VB>
__device__ __forceinline__ int ValueChunk(int r, int c) {
  constexpr int kRow = D * VB / 8;
  constexpr int kChunks = kRow / 16;
  constexpr int kRowsPer128 = 128 / kRow;
  return kChunks > 1 ? c ^ ((r / kRowsPer128) & (kChunks - 1)) : c;
}

// The six parts of each of an affine page's slices for one KV head (PartOf: source offset in the
// page, offset in the staged slice, bytes), written to shared memory once per block so that the
// page loop keeps none of it in registers: [tiles_per_page][6][3].
__device__ __forceinline__ void WriteAffineParts(uint32_t* parts, const PagedKvLayout& L, int h,
                                                 int tiles_per_page) {
  for (int i = threadIdx.x; i < tiles_per_page * 6; i += blockDim.x) {
    const TilePart part = PartOf(L, i % 6, h, i / 6);
    parts[3 * i] = static_cast<uint32_t>(part.src);
    parts[3 * i + 1] = static_cast<uint32_t>(part.dst);
    parts[3 * i + 2] = static_cast<uint32_t>(part.bytes);
  }
}

// Starts copying slice `sub` of an affine page (its parts in `parts`, WriteAffineParts), its value
// codes swizzled (ValueChunk).
template <int D, int VB>
__device__ __forceinline__ void StageAffineAsync(uint8_t* dst, const uint8_t* page,
                                                 const uint32_t* parts, int sub) {
  constexpr int kRow = D * VB / 8;
  const uint32_t* desc = parts + sub * 18;
#pragma unroll
  for (int i = 0; i < 6; ++i) {
    const uint8_t* src = page + desc[3 * i];
    const int to0 = static_cast<int>(desc[3 * i + 1]);
    const int n = static_cast<int>(desc[3 * i + 2]) / 16;
    for (int j = threadIdx.x; j < n; j += kMmaWarps * kWarp) {
      int to = to0 + j * 16;
      if (i == 3) {  // value codes
        const int rel = j * 16;
        const int r = rel / kRow, c = (rel % kRow) / 16;  // kRow: a power of two
        to = to0 + r * kRow + ValueChunk<D, VB>(r, c) * 16;
      }
      CpAsync16(dst + to, src + j * 16);
    }
  }
}

// Where an affine page's parts are, computed once per block (the layout's offsets are
// arithmetic, and a division by a group size costs dozens of instructions: not per slice).
template <int D>
struct AffinePlan {
  int key_scales, key_zeros, value_codes, value_scales, value_zeros;
  int value_groups;    // value groups per token (D / v_group)
  int vgroup[D / 32];  // value group of each 32-channel block
  __device__ explicit AffinePlan(const TileLayout& L) {
    key_scales = static_cast<int>(L.KeyScales());
    key_zeros = static_cast<int>(L.KeyZeros());
    value_codes = static_cast<int>(L.ValueCodes());
    value_scales = static_cast<int>(L.ValueScales());
    value_zeros = static_cast<int>(L.ValueZeros());
    value_groups = D / L.v_group;
#pragma unroll
    for (int b = 0; b < D / 32; ++b) vgroup[b] = (32 * b) / L.v_group;
  }
};

// An affine slice: tokens [t0, t0 + 16) of a staged tile (all real), in key group `kgroup`.
template <int D, int KB, int VB>
__device__ __forceinline__ void SliceAffine(MmaState<D>& st, const float* qn_smem,
                                            float score_scale, const uint8_t* page,
                                            const AffinePlan<D>& L, int t0, int kgroup) {
  const int lane = threadIdx.x % kWarp;
  const int g = lane / 4;
  const int q = lane % 4;
  constexpr int kCpl = D / 4;  // channels of a lane in the key product
  constexpr int kKeyWords = kCpl * KB / 32;
  constexpr int kKpw = 32 / KB;        // key codes per word
  constexpr int kKeyRow = D * KB / 8;  // bytes
  constexpr int kValueRow = D * VB / 8;
  const int base = q * kCpl;
  const __half* ks = reinterpret_cast<const __half*>(page + L.key_scales) + kgroup * D + base;
  const __half* kz = reinterpret_cast<const __half*>(page + L.key_zeros) + kgroup * D + base;

  // Q's fragments with the key scales folded in, in the order the code words give the channels:
  // pair i of word j is channels (kKpw j + i, kKpw j + i + kKpw / 2) of the lane's block.
  uint32_t qa[D / 16][4];
  float bias = 0;
  // The lane's kCpl scales and zeros, 8 halves per 16-byte load.
  __half2 ksh[kCpl / 2], kzh[kCpl / 2];
#pragma unroll
  for (int i = 0; i < kCpl / 8; ++i) {
    reinterpret_cast<uint4*>(ksh)[i] = reinterpret_cast<const uint4*>(ks)[i];
    reinterpret_cast<uint4*>(kzh)[i] = reinterpret_cast<const uint4*>(kz)[i];
  }
  // The lane's kCpl channels of its head's scaled query (QueryBlocks), 16 bytes at a time.
  float qn[kCpl];
#pragma unroll
  for (int i = 0; i < kCpl / 4; ++i) {
    reinterpret_cast<float4*>(qn)[i] = reinterpret_cast<const float4*>(qn_smem)[i];
  }
  auto half_at = [](const __half2* h, int c) {
    return c % 2 ? __high2float(h[c / 2]) : __low2float(h[c / 2]);
  };
#pragma unroll
  for (int j = 0; j < kKeyWords; ++j) {
#pragma unroll
    for (int i = 0; i < kKpw / 2; ++i) {
      const int ca = kKpw * j + i, cb = ca + kKpw / 2;
      const float xa = qn[ca] * half_at(ksh, ca);
      const float xb = qn[cb] * half_at(ksh, cb);
      bias = fmaf(qn[ca], half_at(kzh, ca), fmaf(qn[cb], half_at(kzh, cb), bias));
      const int pair = (kKpw / 2) * j + i;  // k-step pair / 2, register (pair % 2) * 2
      SplitHiLo(xa, xb, &qa[pair / 2][(pair % 2) * 2], &qa[pair / 2][(pair % 2) * 2 + 1]);
    }
  }
  bias += __shfl_xor_sync(0xffffffffu, bias, 1);
  bias += __shfl_xor_sync(0xffffffffu, bias, 2);

  const uint8_t* key_codes = page;  // key codes first
  float s[4];
#pragma unroll
  for (int jt = 0; jt < 2; ++jt) {  // n-tile: tokens t0 + 8 jt + g of this lane
    const uint32_t* w =
        reinterpret_cast<const uint32_t*>(key_codes + (t0 + 8 * jt + g) * kKeyRow) + q * kKeyWords;
    uint32_t words[kKeyWords];
    if constexpr (kKeyWords == 4) {
      *reinterpret_cast<uint4*>(words) = *reinterpret_cast<const uint4*>(w);
    } else if constexpr (kKeyWords == 2) {
      *reinterpret_cast<uint2*>(words) = *reinterpret_cast<const uint2*>(w);
    } else {
      words[0] = w[0];
    }
    float c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pair = 2 * kk + r;
        const int j = pair / (kKpw / 2), i = pair % (kKpw / 2);
        b[r] = CodePair<KB>(words[j] >> (i * KB));
      }
      Mma(kk % 2 ? c1 : c0, qa[kk], b[0], b[1]);
    }
    s[2 * jt] = (c0[0] + c0[2] + c1[0] + c1[2] + bias) * score_scale;
    s[2 * jt + 1] = (c0[1] + c0[3] + c1[1] + c1[3] + bias) * score_scale;
  }
  // Key tiles: lane holds tokens (g of tile jt) for the B operand, but its scores are tokens
  // 2q, 2q + 1 (+ 8) of the C layout: s above is already in the C layout (c0..c3 of the mma).
  float p[4];
  SliceSoftmax<D>(st, s, p);

  // Values: per 32-channel block b, P with the value scales folded in (tokens 2q, 2q+1, 8+2q,
  // 9+2q of head g), the zeros into z[b], and four tiles of 8 channels each.
  const uint8_t* value_codes = page + L.value_codes;
  const __half* vs = reinterpret_cast<const __half*>(page + L.value_scales);
  const __half* vz = reinterpret_cast<const __half*>(page + L.value_zeros);
  const int groups = L.value_groups;
  const int tok[4] = {t0 + 2 * q, t0 + 2 * q + 1, t0 + 8 + 2 * q, t0 + 9 + 2 * q};
  constexpr int kVpw = 32 / VB;  // value codes per word
#pragma unroll
  for (int b = 0; b < D / 32; ++b) {
    const int vg = L.vgroup[b];
    float pv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pv[i] = p[i] * __half2float(vs[tok[i] * groups + vg]);
      st.z[b] += p[i] * __half2float(vz[tok[i] * groups + vg]);
    }
    uint32_t pa[4];
    SplitHiLo(pv[0], pv[1], &pa[0], &pa[1]);
    SplitHiLo(pv[2], pv[3], &pa[2], &pa[3]);
    // The four tokens' codes of this 32-channel block: VB words each, one load per token.
    uint32_t wv[4][VB];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Block b's VB words: bytes [16 VB b / 4, ...) of the row, in chunk (VB b / 4) (swizzled).
      const uint8_t* row = value_codes + tok[i] * kValueRow +
                           ValueChunk<D, VB>(tok[i], (b * VB * 4) / 16) * 16 + (b * VB * 4) % 16;
      if constexpr (VB == 4) {
        *reinterpret_cast<uint4*>(wv[i]) = *reinterpret_cast<const uint4*>(row);
      } else {
        *reinterpret_cast<uint2*>(wv[i]) = *reinterpret_cast<const uint2*>(row);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      // The B operand of tile (b, u): column g is channel 32b + 8u + g; rows are tokens 2q,
      // 2q + 1 (b0) and 8 + 2q, 9 + 2q (b1). PRMT puts the two tokens' 16-bit halves holding
      // that channel's code side by side. g < 8 <= codes per word, so the word is 8u / kVpw.
      const int word = (8 * u) / kVpw, index = (8 * u) % kVpw + g;
      const uint32_t sel = (index * VB) / 16 ? 0x7632u : 0x5410u;
      const int sh = (index * VB) % 16;
      const uint32_t w0 = wv[0][word], w1 = wv[1][word], w2 = wv[2][word], w3 = wv[3][word];
      const uint32_t b0 = CodePair<VB>(__byte_perm(w0, w1, sel) >> sh);
      const uint32_t b1 = CodePair<VB>(__byte_perm(w2, w3, sel) >> sh);
      Mma(st.o[4 * b + u], pa, b0, b1);
    }
  }
}

// Stages `n` (<= rows) window rows of fp16 K and V into swizzled tiles, rows n .. 16-rounded zero.
template <int D>
__device__ void StageWindow(uint8_t* k, uint8_t* v, const __half* wk, const __half* wv, int n) {
  constexpr int kChunks = D / 8;
  const int rows = (n + kSlice - 1) / kSlice * kSlice;
  for (int i = threadIdx.x; i < rows * kChunks; i += blockDim.x) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
    if (r < n) {
      kx = __ldg(reinterpret_cast<const uint4*>(wk + static_cast<size_t>(r) * D) + c);
      vx = __ldg(reinterpret_cast<const uint4*>(wv + static_cast<size_t>(r) * D) + c);
    }
    *reinterpret_cast<uint4*>(k + Swizzled<D>(r, c)) = kx;
    *reinterpret_cast<uint4*>(v + Swizzled<D>(r, c)) = vx;
  }
}

// Starts copying KV head h's slice `sub` of an fp16 page into swizzled K and V tiles (no run-time
// division in the index arithmetic: it runs for every 16 bytes).
template <int D>
__device__ __forceinline__ void StageFp16Async(uint8_t* dst, const uint8_t* page,
                                               const PagedKvLayout& L, int h, int sub, int tokens) {
  constexpr int kChunks = D / 8;
  const int per_tensor = tokens * kChunks;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const TilePart part = PartOf(L, t, h, sub);
    const uint8_t* src = page + part.src;
    for (int rc = threadIdx.x; rc < per_tensor; rc += kMmaWarps * kWarp) {
      const int r = rc / kChunks, c = rc % kChunks;  // kChunks: a power of two
      CpAsync16(dst + part.dst + Swizzled<D>(r, c), src + static_cast<size_t>(rc) * 16);
    }
  }
}

// The affine kernel's scaled query in shared memory, once for the block's four warps instead of
// 32 registers in every thread: lane (g, q) reads head row g's channels [q D/4, (q + 1) D/4) as
// 16-byte vectors; each such block is padded by 16 bytes so that the eight lanes of a quarter-warp
// (two rows, four blocks) fall in eight different groups of four banks.
template <int D>
struct QueryBlocks {
  static constexpr int kBlock = D / 4 + 4;  // floats
  static constexpr size_t kBytes = static_cast<size_t>(8) * 4 * kBlock * sizeof(float);
  __device__ static float* At(float* base, int g, int q) { return base + (g * 4 + q) * kBlock; }
};

// Shared memory of the tensor-core kernel: `stages` slice buffers (an fp16 window tile of
// window_tile rows fits in them; after the slices, the warps' states for the merge), then the
// affine slices' parts (WriteAffineParts).
template <int D>
struct MmaSmem {
  size_t buffer = 0;     // bytes of one slice buffer
  int window_tile = 16;  // rows of fp16 window attended at a time
  size_t parts = 0;      // offset of the affine slices' parts
  size_t query = 0;      // offset of the affine kernel's query blocks (QueryBlocks)
  size_t total = 0;
  __host__ __device__ MmaSmem(const TileLayout& L, int stages, int group) {
    buffer = L.HeadBytes();
    const size_t pages = buffer * stages;
    const size_t row = static_cast<size_t>(D) * 2 * 2;  // one token of K and V
    window_tile = static_cast<int>(pages / row / kSlice * kSlice);
    if (window_tile > 128) window_tile = 128;
    if (window_tile < kSlice) window_tile = kSlice;
    const size_t window = static_cast<size_t>(window_tile) * row;
    const size_t merge = static_cast<size_t>(kMmaWarps) * group * (D + 2) * sizeof(float);
    total = pages;
    if (window > total) total = window;
    if (merge > total) total = merge;
    parts = Align16(total);
    if (L.format == PageFormat::kAffine) {
      query = parts + Align16(static_cast<size_t>(L.tiles_per_page) * 18 * sizeof(uint32_t));
      total = query + QueryBlocks<D>::kBytes;
    }
  }
};

// Registers capped for three blocks per multiprocessor (168 a thread, no spills): on the H200
// that beat the compiler's own choice (185-209) at every shape, 0.67 -> 0.58 ms for fp16 at
// batch 16 x 32k (cuda_decode_bench-NVIDIA_H200-2026-11-27-a5dce54.txt and its run's
// comparison).
// B: blocks per multiprocessor the registers are capped for. 3 (168 a thread) is the default;
// 4 (128 a thread, PagedKernel::kMmaFourBlocks, affine pages) trades spills for a third more warps
// in flight, to measure (cuda_decode_notes.md, version 6).
template <int D, PageFormat F, int KB, int VB, int S, int B = 3>
__global__ void __launch_bounds__(kMmaWarps* kWarp, B)
    MmaDecodeKernel(PagedKvLayout L, PagedDecodeArgs a, int splits, float* part_acc,
                    float* part_ml) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int seq = blockIdx.z;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int g = lane / 4, q = lane % 4;
  const int group = a.q_heads / L.kv_heads;
  const bool row_used = g < group;
  const TileLayout T(L);
  const MmaSmem<D> layout(T, S, group);

  // Head g's query (lanes of rows g >= group: zeros), softmax-scaled, normalized by a power of
  // two so that its largest |q| is in [0.5, 1): its fp16 hi/lo (and, affine, its products with
  // fp16 key scales) stay in range; score_scale puts the power of two back.
  const float scale = a.scale != 0 ? a.scale : rsqrtf(static_cast<float>(D));
  const float* qp = a.q + (static_cast<size_t>(seq) * a.q_heads + kvh * group + g) * D;
  float mx = 0;
  for (int c = q; c < D; c += 4) mx = row_used ? fmaxf(mx, fabsf(qp[c] * scale)) : mx;
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  int e = 0;
  if (mx > 0 && isfinite(mx)) frexpf(mx, &e);
  const float q_norm = ldexpf(scale, -e);
  const float score_scale = ldexpf(1.f, e);

  MmaState<D> st;
#pragma unroll
  for (int n = 0; n < MmaState<D>::kTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) st.o[n][i] = 0;
  }
#pragma unroll
  for (int i = 0; i < D / 32; ++i) st.z[i] = 0;

  // fp16: Q's fragments once (natural channel order); affine: the lane's channels of q, written
  // by the first warp to shared memory (QueryBlocks) for all four (the barrier after the parts
  // orders them).
  uint32_t qa[D / 16][4];
  [[maybe_unused]] float* qn_smem = nullptr;
  if constexpr (F == PageFormat::kFp16) {
    NaturalQFragments<D>(qa, qp, q_norm, q, row_used);
  } else {
    float* blocks = reinterpret_cast<float*>(smem + layout.query);
    qn_smem = QueryBlocks<D>::At(blocks, g, q);
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < D / 4; ++i) qn_smem[i] = row_used ? qp[q * (D / 4) + i] * q_norm : 0.f;
    }
  }

  // The split's slices: each page TileTokens() tokens at a time.
  const int tpp = T.tiles_per_page;
  const int tiles = a.page_counts[seq] * tpp;
  const int per_split = (tiles + splits - 1) / splits;
  const int p0 = min(tiles, split * per_split);
  const int p1 = min(tiles, p0 + per_split);
  const int32_t* table = a.block_table + static_cast<size_t>(seq) * a.max_pages;
  const int tile = T.tokens;
  const int64_t page_bytes = static_cast<int64_t>(L.PageBytes());
  [[maybe_unused]] const AffinePlan<D> plan(T);
  [[maybe_unused]] const uint32_t* parts = reinterpret_cast<const uint32_t*>(smem + layout.parts);
  if constexpr (F == PageFormat::kAffine) {
    WriteAffineParts(reinterpret_cast<uint32_t*>(smem + layout.parts), L, kvh, tpp);
    __syncthreads();
  }
  auto issue = [&](int p) {
    if (p < p1) {
      const uint8_t* page = a.pages + table[p / tpp] * page_bytes;
      uint8_t* dst = smem + ((p - p0) % S) * layout.buffer;
      if constexpr (F == PageFormat::kFp16) {
        StageFp16Async<D>(dst, page, L, kvh, p % tpp, tile);
      } else {
        StageAffineAsync<D, VB>(dst, page, parts, p % tpp);
      }
    }
    CpAsyncCommit();
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(p0 + i);
  for (int p = p0; p < p1; ++p) {
    __syncthreads();
    issue(p + S - 1);
    CpAsyncWait<S - 1>();
    __syncthreads();
    const uint8_t* page = smem + ((p - p0) % S) * layout.buffer;
    for (int t0 = warp * kSlice; t0 < tile; t0 += kMmaWarps * kSlice) {
      if constexpr (F == PageFormat::kFp16) {
        SliceFp16<D>(st, qa, score_scale, page, page + T.FpValues(), t0, kSlice);
      } else {
        SliceAffine<D, KB, VB>(st, qn_smem, score_scale, page, plan, t0, t0 / T.k_group);
      }
    }
  }
  CpAsyncWait<0>();

  // The window (fp16, newest tokens): the last split's, in swizzled tiles.
  const int window = a.window_lens != nullptr ? a.window_lens[seq] : 0;
  if (split == splits - 1 && window > 0) {
    if constexpr (F != PageFormat::kFp16) {
      // Affine kernels attend the fp16 window with Q's natural-order fragments.
      NaturalQFragments<D>(qa, qp, q_norm, q, row_used);
    }
    const int wt = layout.window_tile;
    uint8_t* k = smem;
    uint8_t* v = smem + static_cast<size_t>(wt) * D * 2;
    const int slot = a.window_slots != nullptr ? a.window_slots[seq] : seq;
    const size_t base = (static_cast<size_t>(slot) * L.kv_heads + kvh) * a.max_window * D;
    for (int w0 = 0; w0 < window; w0 += wt) {
      const int n = min(wt, window - w0);
      __syncthreads();
      StageWindow<D>(k, v, a.window_k + base + static_cast<size_t>(w0) * D,
                     a.window_v + base + static_cast<size_t>(w0) * D, n);
      __syncthreads();
      for (int t0 = warp * kSlice; t0 < n; t0 += kMmaWarps * kSlice) {
        SliceFp16<D>(st, qa, score_scale, k, v, t0, n - t0);
      }
    }
  }

  // Merge the four warps: each writes head g's m, l and output row; then every thread combines.
  __syncthreads();
  float* mm = reinterpret_cast<float*>(smem);  // [warps][group]
  float* ll = mm + kMmaWarps * group;          // [warps][group]
  float* oo = ll + kMmaWarps * group;          // [warps][group][D]
  float l = st.l;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float z[D / 32];
#pragma unroll
  for (int b = 0; b < D / 32; ++b) {
    z[b] = st.z[b];
    z[b] += __shfl_xor_sync(0xffffffffu, z[b], 1);
    z[b] += __shfl_xor_sync(0xffffffffu, z[b], 2);
  }
  if (row_used) {
    if (q == 0) {
      mm[warp * group + g] = st.m;
      ll[warp * group + g] = l;
    }
    float* row = oo + (static_cast<size_t>(warp) * group + g) * D;
#pragma unroll
    for (int n = 0; n < MmaState<D>::kTiles; ++n) {
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const float x = st.o[n][e2] + st.o[n][2 + e2];
        const int ch = 8 * n + 2 * q + e2;
        row[ch] = x + z[ch / 32];  // z: 0 for fp16
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int h = i / D, c = i % D;
    float m = -INFINITY;
    for (int w = 0; w < kMmaWarps; ++w) m = fmaxf(m, mm[w * group + h]);
    float acc = 0, den = 0;
    if (m != -INFINITY) {
      for (int w = 0; w < kMmaWarps; ++w) {
        const float mw = mm[w * group + h];
        if (mw == -INFINITY) continue;
        const float f = __expf(mw - m);
        acc += oo[(static_cast<size_t>(w) * group + h) * D + c] * f;
        den += ll[w * group + h] * f;
      }
    }
    const size_t row = (static_cast<size_t>(seq) * a.q_heads + kvh * group + h) * splits + split;
    part_acc[row * D + c] = acc;
    if (c == 0) {
      part_ml[row * 2] = m;
      part_ml[row * 2 + 1] = den;
    }
  }
}
