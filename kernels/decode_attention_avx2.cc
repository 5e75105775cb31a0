// AVX2+FMA+F16C kernels of fused decode attention. Only the functions here are compiled for
// AVX2 (target attributes, not file-wide flags), so inline functions from shared headers stay
// portable; decode_attention.cc calls these only when the CPU has the features.
//
// Specialized: full-precision segments, fp16 blocks and the affine family at 2/3/4/8 bits, for
// 1, 2, 4 or 8 query heads per KV head and head_dim a multiple of 8. Anything else takes the
// portable kernels.

// GCC 12 warns that the AVX-512 intrinsics' "undefined" operands (a register left as it is) may
// be used uninitialized once inlined (GCC bug 105593, fixed in 13); they are not values here.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/cpu_features.h"
#include "common/half.h"
#include "kernels/internal/attention_segment.h"
#include "kernels/internal/codec_simd.h"
#include "kernels/internal/force_inline.h"
#include "kernels/internal/vector_exp.h"
#include "kernels/internal/zmm_ops.h"

#define STRATA_AVX2 __attribute__((target("avx2,fma,f16c")))
#define STRATA_AVX2_INLINE __attribute__((target("avx2,fma,f16c"))) STRATA_FORCE_INLINE inline
#define STRATA_AVX2_LAMBDA __attribute__((target("avx2,fma,f16c")))

namespace strata::kernels::internal {
namespace {

STRATA_AVX2_INLINE float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

STRATA_AVX2_INLINE float Hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Eight consecutive codes starting at channel d (a multiple of 8), as floats.
template <int kBits>
STRATA_AVX2_INLINE __m256 Unpack8(const uint8_t* row, uint32_t d) {
  if constexpr (kBits == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else {
    // 8 codes = kBits bytes; assembled in a register (a 3-byte memcpy would go through the
    // stack and stall the broadcast on store forwarding).
    const uint8_t* p = row + d * kBits / 8;
    uint32_t w;
    if constexpr (kBits == 3) {
      w = uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16);
    } else {
      std::memcpy(&w, p, kBits);
    }
    const __m256i shifts = _mm256_setr_epi32(0, kBits, 2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits,
                                             6 * kBits, 7 * kBits);
    const __m256i v =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                         _mm256_set1_epi32((1 << kBits) - 1));
    return _mm256_cvtepi32_ps(v);
  }
}

STRATA_AVX2_INLINE __m256 LoadHalf8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Dot product of n floats (any n).
STRATA_AVX2_INLINE float Dot(const float* a, const float* b, uint32_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float s = Hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[0, n) += x[0, n) * f.
STRATA_AVX2_INLINE void Axpy(float f, const float* x, float* y, uint32_t n) {
  const __m256 vf = _mm256_set1_ps(f);
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vf, _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += x[i] * f;
}

// fp32 [rows, R] to [R, rows] in out; R = 1, 2 and 4 (a rank, a head's channel groups, the
// query heads of a KV head) by shuffles, eight rows at a time.
STRATA_AVX2_INLINE void Transpose(const float* x, uint32_t rows, uint32_t R, float* out) {
  uint32_t i = 0;
  if (R == 1) {
    std::memcpy(out, x, size_t{rows} * sizeof(float));
    return;
  }
  if (R == 2) {
    for (; i + 8 <= rows; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + size_t{i} * 2), b = _mm256_loadu_ps(x + size_t{i} * 2 + 8);
      // [r0 of rows 0 1 4 5 | 2 3 6 7]: 64-bit units in the order 0 2 1 3.
      const __m256d c0 = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88));
      const __m256d c1 = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd));
      _mm256_storeu_ps(out + i, _mm256_castpd_ps(_mm256_permute4x64_pd(c0, 0xd8)));
      _mm256_storeu_ps(out + rows + i, _mm256_castpd_ps(_mm256_permute4x64_pd(c1, 0xd8)));
    }
  } else if (R == 4) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 8 <= rows; i += 8) {
      const float* p = x + size_t{i} * 4;
      const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
      const __m256 c = _mm256_loadu_ps(p + 16), d = _mm256_loadu_ps(p + 24);
      // lo_ab = [a.r0 b.r0 a.r1 b.r1 | ...] of rows (0, 2) and (1, 3); likewise cd of 4-7.
      const __m256 lo_ab = _mm256_unpacklo_ps(a, b), hi_ab = _mm256_unpackhi_ps(a, b);
      const __m256 lo_cd = _mm256_unpacklo_ps(c, d), hi_cd = _mm256_unpackhi_ps(c, d);
      // r: rows 0 2 4 6 | 1 3 5 7, put in order by the permutation.
      const __m256 r[4] = {_mm256_shuffle_ps(lo_ab, lo_cd, 0x44), _mm256_shuffle_ps(lo_ab, lo_cd, 0xee),
                           _mm256_shuffle_ps(hi_ab, hi_cd, 0x44), _mm256_shuffle_ps(hi_ab, hi_cd, 0xee)};
      for (uint32_t k = 0; k < 4; ++k) {
        _mm256_storeu_ps(out + size_t{k} * rows + i, _mm256_permutevar8x32_ps(r[k], order));
      }
    }
  }
  for (; i < rows; ++i) {
    for (uint32_t r = 0; r < R; ++r) out[size_t{r} * rows + i] = x[size_t{i} * R + r];
  }
}

// Four rows of n floats (x, x + stride, ...) to [n, 4] in out: out[i * 4 + r] = row r's i.
STRATA_AVX2_INLINE void Interleave4(const float* x, size_t stride, uint32_t n, float* out) {
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v[4];
    for (uint32_t r = 0; r < 4; ++r) v[r] = _mm256_loadu_ps(x + r * stride + i);
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    // u_k: elements k and k + 4 of the eight, four rows each.
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    float* o = out + size_t{i} * 4;
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u1, 0x20));
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
    _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
  }
  for (; i < n; ++i) {
    for (uint32_t r = 0; r < 4; ++r) out[size_t{i} * 4 + r] = x[r * stride + i];
  }
}

// fp16 [rows, R] to fp32 [R, rows] in out (a low-rank factor with rank-major rows, or a head's
// per-token group parameters by group, for vector loops); tmp is scratch.
STRATA_AVX2_INLINE const float* WidenTransposed(const uint16_t* src, uint32_t rows, uint32_t R,
                                                std::vector<float>& tmp, float* out) {
  const size_t n = size_t{rows} * R;
  if (R == 1) {
    HalfToFloat(reinterpret_cast<const Half*>(src), out, n);
    return out;
  }
  tmp.resize(n);
  HalfToFloat(reinterpret_cast<const Half*>(src), tmp.data(), n);
  Transpose(tmp.data(), rows, R, out);
  return out;
}

// The head's rows of a block's K or V into L2, in order, before a pass reads them (the value
// pass strides over them a chunk at a time; a block's head is 16-64 KiB).
STRATA_AVX2_INLINE void PrefetchRows(const TensorOperands& t, uint32_t head, uint32_t tokens) {
  const uint8_t* rows = t.codes + size_t{head} * tokens * t.row_bytes;
  for (size_t off = 0; off < size_t{tokens} * t.row_bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(rows + off), _MM_HINT_T1);
  }
}

// A head's outlier values [first, first + count) of t, widened (thread-local scratch).
STRATA_AVX2_INLINE const float* WidenOutlierValues(const TensorOperands& t, size_t first,
                                                   size_t count) {
  thread_local std::vector<float> vals;
  vals.resize(count);
  HalfToFloat(reinterpret_cast<const Half*>(t.outlier_values + first), vals.data(), count);
  return vals.data();
}

// y[idx[m * n + e] * stride + 0..3] += x[m * 4 + 0..3] * vals[m * n + e] for m < M: four query
// heads' sparse outlier terms, x as [M][4] (the token's or channel's query terms), indices as
// stored (u8 or u16).
// kN: n when known at compile time (the inner loop unrolled), else 0.
template <uint32_t kN, typename Index>
STRATA_AVX2_INLINE void ScatterOutliers4(const float* x, uint32_t M, const Index* idx,
                                         const float* vals, uint32_t n_any, float* y,
                                         size_t stride) {
  const uint32_t n = kN != 0 ? kN : n_any;
  for (uint32_t m = 0; m < M; ++m) {
    const __m128 xm = _mm_loadu_ps(x + size_t{m} * 4);
    for (uint32_t e = 0; e < n; ++e) {
      float* o = y + size_t{idx[m * n + e]} * stride;
      _mm_storeu_ps(o, _mm_fmadd_ps(xm, _mm_set1_ps(vals[m * n + e]), _mm_loadu_ps(o)));
    }
  }
}
template <typename Index>
STRATA_AVX2_INLINE void ScatterOutliers4(const float* x, uint32_t M, const Index* idx,
                                         const float* vals, uint32_t n, float* y, size_t stride) {
  switch (n) {  // (GEAR keeps a few per vector: 2 % of 128 channels or of 256 tokens is 3 or 5)
    case 1:
      return ScatterOutliers4<1>(x, M, idx, vals, n, y, stride);
    case 2:
      return ScatterOutliers4<2>(x, M, idx, vals, n, y, stride);
    case 3:
      return ScatterOutliers4<3>(x, M, idx, vals, n, y, stride);
    case 4:
      return ScatterOutliers4<4>(x, M, idx, vals, n, y, stride);
    case 5:
      return ScatterOutliers4<5>(x, M, idx, vals, n, y, stride);
    case 6:
      return ScatterOutliers4<6>(x, M, idx, vals, n, y, stride);
    default:
      return ScatterOutliers4<0>(x, M, idx, vals, n, y, stride);
  }
}
STRATA_AVX2_INLINE void ScatterOutliers4(const TensorOperands& t, size_t first, const float* x,
                                         uint32_t M, const float* vals, float* y, size_t stride) {
  const uint32_t n = t.outliers_per_vector;
  if (t.outlier_index8 != nullptr) {
    ScatterOutliers4(x, M, t.outlier_index8 + first, vals, n, y, stride);
  } else {
    ScatterOutliers4(x, M, t.outlier_index16 + first, vals, n, y, stride);
  }
}

// y[j][0, K) += sum[k][j] for the four rows j of y (K apart): a [K][4] sum of four query heads'
// terms, by shuffles (back: scratch).
STRATA_AVX2_INLINE void AddInterleaved4(const float* sum, uint32_t K, float* y,
                                        std::vector<float>& back) {
  back.resize(size_t{K} * 4);
  Transpose(sum, K, 4, back.data());
  for (uint32_t j = 0; j < 4; ++j) {
    float* row = y + size_t{j} * K;
    const float* b = &back[size_t{j} * K];
    uint32_t k = 0;
    for (; k + 8 <= K; k += 8) {
      _mm256_storeu_ps(row + k, _mm256_add_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(b + k)));
    }
    for (; k < K; ++k) row[k] += b[k];
  }
}

// y[j][idx] += x[j][m] * value over a head's sparse outliers of t from `first` (n per vector
// m < M, idx the other coordinate, vals widened), for the G rows j of x [G][M] and y [G][K].
// Four rows at a time where G allows: x as [M][4], each term one 4-wide multiply-add into a
// [K][4] sum, added to y by shuffles.
STRATA_AVX2_INLINE void AddSparseTerms(const float* x, uint32_t M, const TensorOperands& t,
                                       size_t first, const float* vals, float* y, uint32_t K,
                                       uint32_t G) {
  const uint32_t n = t.outliers_per_vector;
  if (G % 4 != 0) {
    for (uint32_t m = 0; m < M; ++m) {
      for (uint32_t e = 0; e < n; ++e) {
        const uint32_t k = t.OutlierIndex(first + m * n + e);
        const float v = vals[m * n + e];
        for (uint32_t j = 0; j < G; ++j) y[size_t{j} * K + k] += x[size_t{j} * M + m] * v;
      }
    }
    return;
  }
  thread_local std::vector<float> xt, sum, back;
  xt.resize(size_t{M} * 4);
  sum.resize(size_t{K} * 4);
  for (uint32_t j0 = 0; j0 < G; j0 += 4) {
    Interleave4(x + size_t{j0} * M, M, M, xt.data());
    std::fill(sum.begin(), sum.end(), 0.0f);
    ScatterOutliers4(t, first, xt.data(), M, vals, sum.data(), 4);
    AddInterleaved4(sum.data(), K, y + size_t{j0} * K, back);
  }
}

// GEAR's corrections, as AddScoreCorrections / AddValueCorrections (the specification) with the
// low-rank terms as vector loops: scores += A (B^T q) over tokens, acc += B (A^T p) over
// channels. Outliers stay a short scalar list per vector.
STRATA_AVX2 void AddScoreCorrectionsAvx2(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& k = seg.block->k;
  const uint32_t G = st.g, D = st.d, T = seg.tokens, h = seg.head;
  if (k.rank > 0) {
    thread_local std::vector<float> tmp, at, bt, qb;
    const uint32_t R = k.rank;
    at.resize(size_t{T} * R);
    bt.resize(size_t{D} * R);
    const float* a = WidenTransposed(k.lowrank_a + size_t{h} * T * R, T, R, tmp, at.data());
    const float* b = WidenTransposed(k.lowrank_b + size_t{h} * D * R, D, R, tmp, bt.data());
    qb.resize(R);
    for (uint32_t j = 0; j < G; ++j) {
      for (uint32_t r = 0; r < R; ++r) qb[r] = Dot(&st.q[size_t{j} * D], b + size_t{r} * D, D);
      float* s = &st.scores[size_t{j} * T];
      for (uint32_t r = 0; r < R; ++r) Axpy(qb[r], a + size_t{r} * T, s, T);
    }
  }
  const uint32_t n = k.outliers_per_vector;
  if (n > 0) {
    const size_t first = size_t{h} * D * n;
    const float* vals = WidenOutlierValues(k, first, size_t{D} * n);
    // Each outlier's term for every query head: scores[j][token] += q[j][channel] * value.
    AddSparseTerms(st.q.data(), D, k, first, vals, st.scores.data(), T, G);
  }
}

// Eight fp16 values at p (two rows of a rank-4 factor), and one, widened.
STRATA_AVX2_INLINE __m256 Half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
STRATA_AVX2_INLINE float HalfAt(const uint16_t* p) { return _cvtsh_ss(*p); }

// sum_r x[r] * f[r][0..3]: x R floats (or fp16 values), f R vectors of four.
template <typename T>
STRATA_AVX2_INLINE __m128 Combine4(const T* x, const __m128* f, uint32_t R) {
  __m128 y = _mm_setzero_ps();
  for (uint32_t r = 0; r < R; ++r) {
    float xr;
    if constexpr (std::is_same_v<T, uint16_t>) {
      xr = HalfAt(x + r);
    } else {
      xr = x[r];
    }
    y = _mm_fmadd_ps(_mm_set1_ps(xr), f[r], y);
  }
  return y;
}

// A GEAR tensor's terms for head h: the rank-R factors as stored (fp16: A [T][R], B [D][R]),
// also widened into a and b unless R is 2 or 4 (the loops read those as stored), and its outlier
// values widened (`rows` vectors of them: D for K, T for V; `first` the head's first).
struct GearTerms {
  const uint16_t* a16;
  const uint16_t* b16;
  size_t first;
  const float* vals;
};
STRATA_AVX2_INLINE GearTerms LoadGearTerms(const TensorOperands& t, uint32_t h, uint32_t T,
                                           uint32_t D, uint32_t rows, std::vector<float>& a,
                                           std::vector<float>& b) {
  const uint32_t R = t.rank, n = t.outliers_per_vector;
  GearTerms g{t.lowrank_a + size_t{h} * T * R, t.lowrank_b + size_t{h} * D * R,
              size_t{h} * rows * n, nullptr};
  if (R > 0 && R != 4 && R != 2) {
    a.resize(size_t{T} * R);
    b.resize(size_t{D} * R);
    HalfToFloat(reinterpret_cast<const Half*>(g.a16), a.data(), a.size());
    HalfToFloat(reinterpret_cast<const Half*>(g.b16), b.data(), b.size());
  }
  if (n > 0) g.vals = WidenOutlierValues(t, g.first, size_t{rows} * n);
  return g;
}

// out[r] = sum_i f[i][r] * x[i][0..3] for r < 4: a rank-4 factor f [rows][4] as stored (fp16)
// against x [rows][4] (four query heads interleaved), two rows per register.
STRATA_AVX2_INLINE void ProjectRank4(const uint16_t* f16, const float* x, uint32_t rows,
                                     __m128 out[4]) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  uint32_t i = 0;
  for (; i + 2 <= rows; i += 2) {
    const __m256 xv = _mm256_loadu_ps(x + size_t{i} * 4);
    const __m256 f = Half8(f16 + size_t{i} * 4);  // f[i][0..3], f[i + 1][0..3]
    acc[0] = _mm256_fmadd_ps(_mm256_permute_ps(f, 0x00), xv, acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_permute_ps(f, 0x55), xv, acc[1]);
    acc[2] = _mm256_fmadd_ps(_mm256_permute_ps(f, 0xaa), xv, acc[2]);
    acc[3] = _mm256_fmadd_ps(_mm256_permute_ps(f, 0xff), xv, acc[3]);
  }
  for (uint32_t r = 0; r < 4; ++r) {
    out[r] = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    for (uint32_t u = i; u < rows; ++u) {
      out[r] = _mm_fmadd_ps(_mm_loadu_ps(x + size_t{u} * 4),
                            _mm_set1_ps(HalfAt(f16 + size_t{u} * 4 + r)), out[r]);
    }
  }
}

// Lane selectors for a rank-2 factor's four rows widened into one register ([i][0], [i][1],
// [i + 1][0], ... [i + 3][1]): factor r of rows (i, i + 1) or (i + 2, i + 3), each spread over
// the four lanes of its row's half.
STRATA_AVX2_INLINE __m256i Rank2Lanes(uint32_t r, uint32_t pair) {
  const int a = static_cast<int>(4 * pair + r), b = a + 2;
  return _mm256_setr_epi32(a, a, a, a, b, b, b, b);
}

// out[r] = sum_i f[i][r] * x[i][0..3] for r < 2: a rank-2 factor f [rows][2] as stored (fp16)
// against x [rows][4], four rows per load and two per register.
STRATA_AVX2_INLINE void ProjectRank2(const uint16_t* f16, const float* x, uint32_t rows,
                                     __m128 out[2]) {
  const __m256i l00 = Rank2Lanes(0, 0), l10 = Rank2Lanes(1, 0), l01 = Rank2Lanes(0, 1),
                l11 = Rank2Lanes(1, 1);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  uint32_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    const __m256 f = Half8(f16 + size_t{i} * 2);  // f[i .. i + 3][0..1]
    const __m256 x01 = _mm256_loadu_ps(x + size_t{i} * 4);
    const __m256 x23 = _mm256_loadu_ps(x + size_t{i + 2} * 4);
    acc[0] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f, l00), x01, acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f, l10), x01, acc[1]);
    acc[2] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f, l01), x23, acc[2]);
    acc[3] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f, l11), x23, acc[3]);
  }
  for (uint32_t r = 0; r < 2; ++r) {
    const __m256 a = _mm256_add_ps(acc[r], acc[r + 2]);
    out[r] = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    for (uint32_t u = i; u < rows; ++u) {
      out[r] = _mm_fmadd_ps(_mm_loadu_ps(x + size_t{u} * 4),
                            _mm_set1_ps(HalfAt(f16 + size_t{u} * 2 + r)), out[r]);
    }
  }
}

// Two rows of four, o[0..3] and o[stride ..], from v's halves: stored, or added to what is there.
template <bool kAdd>
STRATA_AVX2_INLINE void PutRowPair(float* o, size_t stride, __m256 v) {
  if constexpr (kAdd)
    v = _mm256_add_ps(_mm256_set_m128(_mm_loadu_ps(o + stride), _mm_loadu_ps(o)), v);
  _mm_storeu_ps(o, _mm256_castps256_ps128(v));
  _mm_storeu_ps(o + stride, _mm256_extractf128_ps(v, 1));
}

// y[i][0..3] (+)= f[i][0] * c[0] + f[i][1] * c[1] for `rows` rows of a rank-2 factor f [rows][2]
// as stored (fp16), y rows `stride` floats apart (4 heads each), four rows per load.
template <bool kAdd>
STRATA_AVX2_INLINE void ExpandRank2(const uint16_t* f16, const __m128 c[2], uint32_t rows, float* y,
                                    size_t stride) {
  const __m256i l00 = Rank2Lanes(0, 0), l10 = Rank2Lanes(1, 0), l01 = Rank2Lanes(0, 1),
                l11 = Rank2Lanes(1, 1);
  const __m256 c0 = _mm256_set_m128(c[0], c[0]), c1 = _mm256_set_m128(c[1], c[1]);
  uint32_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    const __m256 f = Half8(f16 + size_t{i} * 2);
    PutRowPair<kAdd>(y + size_t{i} * stride, stride,
                     _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f, l10), c1,
                                     _mm256_mul_ps(_mm256_permutevar8x32_ps(f, l00), c0)));
    PutRowPair<kAdd>(y + size_t{i + 2} * stride, stride,
                     _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f, l11), c1,
                                     _mm256_mul_ps(_mm256_permutevar8x32_ps(f, l01), c0)));
  }
  for (; i < rows; ++i) {
    __m128 v = _mm_fmadd_ps(_mm_set1_ps(HalfAt(f16 + size_t{i} * 2 + 1)), c[1],
                            _mm_mul_ps(_mm_set1_ps(HalfAt(f16 + size_t{i} * 2)), c[0]));
    if constexpr (kAdd) v = _mm_add_ps(_mm_loadu_ps(y + size_t{i} * stride), v);
    _mm_storeu_ps(y + size_t{i} * stride, v);
  }
}

// GEAR's value corrections for G a multiple of 4, four query heads at a time in a [D][4] sum:
// the low-rank term B (A^T p) fills it (the factors read in their stored [rows][R] order, two
// rows per register at rank 4), the outliers add to it, and it is added to the output by
// shuffles once.
STRATA_AVX2 void AddValueCorrectionsGrouped(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& v = seg.block->v;
  const uint32_t G = st.g, D = st.d, T = seg.tokens, h = seg.head;
  const uint32_t R = v.rank, n = v.outliers_per_vector;
  constexpr uint32_t kMaxRank = 64;  // (PrepareBlock bounds the rank; larger takes the loop)
  thread_local std::vector<float> xp, a, b, sum, back;
  xp.resize(size_t{T} * 4);
  sum.resize(size_t{D} * 4);
  const auto [a16, b16, first, vals] = LoadGearTerms(v, h, T, D, T, a, b);
  for (uint32_t j0 = 0; j0 < G; j0 += 4) {
    Interleave4(&st.scores[size_t{j0} * T], T, T, xp.data());  // [T][4]: heads j0 .. j0 + 3
    if (R == 4) {
      // pa[r] = sum_t p[t] A[t][r], two tokens per register, then sum[d] = sum_r B[d][r] pa[r],
      // two channels per register.
      __m128 pa[4];
      __m256 pa2[4];
      ProjectRank4(a16, xp.data(), T, pa);
      for (uint32_t r = 0; r < 4; ++r) pa2[r] = _mm256_set_m128(pa[r], pa[r]);
      uint32_t d = 0;
      for (; d + 2 <= D; d += 2) {
        const __m256 bd = Half8(b16 + size_t{d} * 4);
        __m256 y = _mm256_mul_ps(_mm256_permute_ps(bd, 0x00), pa2[0]);
        y = _mm256_fmadd_ps(_mm256_permute_ps(bd, 0x55), pa2[1], y);
        y = _mm256_fmadd_ps(_mm256_permute_ps(bd, 0xaa), pa2[2], y);
        y = _mm256_fmadd_ps(_mm256_permute_ps(bd, 0xff), pa2[3], y);
        _mm256_storeu_ps(&sum[size_t{d} * 4], y);
      }
      for (; d < D; ++d) _mm_storeu_ps(&sum[size_t{d} * 4], Combine4(b16 + size_t{d} * 4, pa, 4));
    } else if (R == 2) {  // the same two steps, four rows of a factor per load
      __m128 pa[2];
      ProjectRank2(a16, xp.data(), T, pa);
      ExpandRank2</*kAdd=*/false>(b16, pa, D, sum.data(), 4);
    } else if (R > 0 && R <= kMaxRank) {
      __m128 pa[kMaxRank];
      for (uint32_t r = 0; r < R; ++r) pa[r] = _mm_setzero_ps();
      for (uint32_t t = 0; t < T; ++t) {
        const __m128 x = _mm_loadu_ps(&xp[size_t{t} * 4]);
        for (uint32_t r = 0; r < R; ++r) {
          pa[r] = _mm_fmadd_ps(x, _mm_set1_ps(a[size_t{t} * R + r]), pa[r]);
        }
      }
      for (uint32_t d = 0; d < D; ++d) {
        _mm_storeu_ps(&sum[size_t{d} * 4], Combine4(&b[size_t{d} * R], pa, R));
      }
    } else {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (uint32_t r = 0; r < R; ++r) {  // (a rank past kMaxRank, one at a time)
        __m128 pr = _mm_setzero_ps();
        for (uint32_t t = 0; t < T; ++t) {
          pr = _mm_fmadd_ps(_mm_loadu_ps(&xp[size_t{t} * 4]), _mm_set1_ps(a[size_t{t} * R + r]), pr);
        }
        for (uint32_t d = 0; d < D; ++d) {
          float* o = &sum[size_t{d} * 4];
          _mm_storeu_ps(o, _mm_fmadd_ps(pr, _mm_set1_ps(b[size_t{d} * R + r]), _mm_loadu_ps(o)));
        }
      }
    }
    // Outliers: sum[channel][heads] += p[heads][token] * value.
    if (n > 0) ScatterOutliers4(v, first, xp.data(), T, vals, sum.data(), 4);
    AddInterleaved4(sum.data(), D, &st.acc[size_t{j0} * D], back);
  }
}

STRATA_AVX2 void AddValueCorrectionsAvx2(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& v = seg.block->v;
  const uint32_t G = st.g, D = st.d, T = seg.tokens, h = seg.head;
  if (v.rank == 0 && v.outliers_per_vector == 0) return;
  if (G % 4 == 0) {
    AddValueCorrectionsGrouped(seg, st);
    return;
  }
  if (v.rank > 0) {
    thread_local std::vector<float> tmp, at, bt, pa;
    const uint32_t R = v.rank;
    at.resize(size_t{T} * R);
    bt.resize(size_t{D} * R);
    const float* a = WidenTransposed(v.lowrank_a + size_t{h} * T * R, T, R, tmp, at.data());
    const float* b = WidenTransposed(v.lowrank_b + size_t{h} * D * R, D, R, tmp, bt.data());
    pa.resize(R);
    for (uint32_t j = 0; j < G; ++j) {
      for (uint32_t r = 0; r < R; ++r) pa[r] = Dot(&st.scores[size_t{j} * T], a + size_t{r} * T, T);
      for (uint32_t r = 0; r < R; ++r) Axpy(pa[r], b + size_t{r} * D, &st.acc[size_t{j} * D], D);
    }
  }
  const uint32_t n = v.outliers_per_vector;
  if (n > 0) {
    const size_t first = size_t{h} * T * n;
    const float* vals = WidenOutlierValues(v, first, size_t{T} * n);
    // acc[j][channel] += p[j][token] * value.
    AddSparseTerms(st.scores.data(), T, v, first, vals, st.acc.data(), D, G);
  }
}

// GEAR's key corrections added to scores staged token-major ([T][G], G a multiple of 4, as the
// integer kernels make them) before they are transposed: the low-rank term A (B^T q) and the
// sparse outliers go straight into each token's G scores, four heads to a 128-bit vector, with
// no per-head pass over the tokens and no buffer to zero and add back.
STRATA_AVX2_INLINE void AddStagedScoreCorrections(const Segment& seg, HeadGroupState& st,
                                                  float* staged) {
  const TensorOperands& k = seg.block->k;
  const uint32_t G = st.g, D = st.d, T = seg.tokens, h = seg.head;
  const uint32_t R = k.rank, n = k.outliers_per_vector;
  thread_local std::vector<float> xq, a, b, qb;
  xq.resize(size_t{D} * 4);
  qb.resize(size_t{R} * 4);
  const auto [a16, b16, first, vals] = LoadGearTerms(k, h, T, D, D, a, b);
  for (uint32_t j0 = 0; j0 < G; j0 += 4) {
    Interleave4(&st.q[size_t{j0} * D], D, D, xq.data());  // [D][4]: heads j0 .. j0 + 3
    if (R > 0) {
      // qb[r] = (B^T q)_r of the four heads, then staged[t] += sum_r A[t][r] qb[r].
      if (R == 4) {  // two channels, then two tokens, per register: [d: 4 heads | d + 1: ...]
        __m128 x[4];
        __m256 q2[4];
        ProjectRank4(b16, xq.data(), D, x);
        for (uint32_t r = 0; r < 4; ++r) {
          q2[r] = _mm256_set_m128(x[r], x[r]);
          _mm_storeu_ps(&qb[size_t{r} * 4], x[r]);
        }
        uint32_t t = 0;
        for (; t + 2 <= T; t += 2) {
          const __m256 at = Half8(a16 + size_t{t} * 4);  // A[t][0..3], A[t + 1][0..3]
          float* o = staged + size_t{t} * G + j0;
          __m256 y = _mm256_set_m128(_mm_loadu_ps(o + G), _mm_loadu_ps(o));
          y = _mm256_fmadd_ps(_mm256_permute_ps(at, 0x00), q2[0], y);
          y = _mm256_fmadd_ps(_mm256_permute_ps(at, 0x55), q2[1], y);
          y = _mm256_fmadd_ps(_mm256_permute_ps(at, 0xaa), q2[2], y);
          y = _mm256_fmadd_ps(_mm256_permute_ps(at, 0xff), q2[3], y);
          _mm_storeu_ps(o, _mm256_castps256_ps128(y));
          _mm_storeu_ps(o + G, _mm256_extractf128_ps(y, 1));
        }
        for (; t < T; ++t) {
          float* o = staged + size_t{t} * G + j0;
          __m128 y = _mm_loadu_ps(o);
          for (uint32_t r = 0; r < 4; ++r) {
            y = _mm_fmadd_ps(_mm_set1_ps(HalfAt(a16 + size_t{t} * 4 + r)), _mm_loadu_ps(&qb[r * 4]), y);
          }
          _mm_storeu_ps(o, y);
        }
      } else if (R == 2) {  // four channels, then four tokens, per fp16 load
        __m128 x[2];
        ProjectRank2(b16, xq.data(), D, x);
        ExpandRank2</*kAdd=*/true>(a16, x, T, staged + j0, G);
      } else {
        for (uint32_t r = 0; r < R; ++r) {
          __m128 acc = _mm_setzero_ps();
          for (uint32_t d = 0; d < D; ++d) {
            acc = _mm_fmadd_ps(_mm_loadu_ps(&xq[size_t{d} * 4]),
                               _mm_set1_ps(b[size_t{d} * R + r]), acc);
          }
          _mm_storeu_ps(&qb[size_t{r} * 4], acc);
        }
        for (uint32_t t = 0; t < T; ++t) {
          float* o = staged + size_t{t} * G + j0;
          __m128 y = _mm_loadu_ps(o);
          for (uint32_t r = 0; r < R; ++r) {
            y = _mm_fmadd_ps(_mm_set1_ps(a[size_t{t} * R + r]), _mm_loadu_ps(&qb[size_t{r} * 4]), y);
          }
          _mm_storeu_ps(o, y);
        }
      }
    }
    // Outliers: staged[token][heads] += q[heads][channel] * value.
    if (n > 0) ScatterOutliers4(k, first, xq.data(), D, vals, staged + j0, G);
  }
}

// Scores staged token-major ([T][G], 4 floats of slack) into st.scores ([G][T]) with GEAR's key
// corrections: the integer kernels' last step.
STRATA_AVX2_INLINE void FinishStagedScores(const Segment& seg, HeadGroupState& st, float* staged) {
  const TensorOperands& k = seg.block->k;
  const bool corrections = k.rank > 0 || k.outliers_per_vector > 0;
  if (corrections && st.g % 4 == 0) AddStagedScoreCorrections(seg, st, staged);
  Transpose(staged, seg.tokens, st.g, st.scores.data());
  if (corrections && st.g % 4 != 0) AddScoreCorrectionsAvx2(seg, st);
}

// Source of a segment's rows as a template parameter: full precision (fp32), fp16, int8, fp8
// e4m3, or affine codes of kSrc > 0 bits.
constexpr int kSrcFp32 = -32, kSrcFp16 = -16, kSrcInt8 = -8, kSrcFp8 = -9;

// Eight fp8 e4m3 codes as floats / 256: the bits moved into fp16 position give the same value
// scaled by 2^-8, subnormals included (NaN never occurs: the encoder saturates). A code
// sign-extended to int16 and shifted left by 7 has its sign in bit 15 and again in bit 14, its
// exponent and mantissa in bits 13-7: clearing bit 14 leaves the fp16 bits (three instructions
// and the conversion, where masking sign and magnitude apart took six).
STRATA_AVX2_INLINE __m256 LoadFp8x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(
      _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xbfff))));
}
template <int kSrc>
STRATA_AVX2_INLINE __m256 Load8(const uint8_t* row, uint32_t d) {
  if constexpr (kSrc == kSrcFp32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (kSrc == kSrcFp16) {
    return LoadHalf8(row + 2 * d);
  } else if constexpr (kSrc == kSrcInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (kSrc == kSrcFp8) {
    return LoadFp8x8(row + d);
  } else {
    return Unpack8<kSrc>(row, d);
  }
}

// Row t of a segment's K or V for one head: fp32 rows of a full-precision segment, or codes.
STRATA_AVX2_INLINE const uint8_t* RowOf(const Segment& seg, const TensorOperands* t,
                                        const float* full_precision, uint32_t token) {
  if (t == nullptr) {
    return reinterpret_cast<const uint8_t*>(full_precision + size_t{token} * seg.stride);
  }
  return t->codes + (size_t{seg.head} * seg.tokens + token) * t->row_bytes;
}

template <int kSrc, uint32_t kG>
STRATA_AVX2 void Scores(const Segment& seg, HeadGroupState& st) {
  const uint32_t D = st.d, T = seg.tokens;
  const TensorOperands* k = seg.block ? &seg.block->k : nullptr;
  if (k != nullptr) PrefetchRows(*k, seg.head, T);
  constexpr bool kAffine = kSrc > 0;
  // [G, D] q with the token group's key scales folded in, then the G biases.
  float* qf = st.Work(size_t{kG} * D + kG);
  float* bias = qf + size_t{kG} * D;
  for (uint32_t j = 0; j < kG; ++j) bias[j] = 0;
  // The dot product's last step: the affine zero-point term, or the int8 token scale, or the
  // fp8 tensor scale (times 2^8, see LoadFp8x8).
  const auto Finish = [](float dot, const TensorOperands* k, uint32_t head, uint32_t T, uint32_t t,
                         float b) STRATA_AVX2_LAMBDA {
    if constexpr (kSrc > 0) return dot + b;
    if constexpr (kSrc == kSrcInt8) return dot * HalfBitsToFloat(k->scales[size_t{head} * T + t]);
    if constexpr (kSrc == kSrcFp8) return dot * (k->tensor_scale * 256.0f);
    (void)k, (void)head, (void)T, (void)t, (void)b;
    return dot;
  };
  const float* q = kAffine ? qf : st.q.data();
  for (uint32_t t = 0; t < T; ++t) {
    if constexpr (kAffine) {
      if (t % k->group_size == 0) {
        const size_t p0 = (size_t{seg.head} * k->groups + t / k->group_size) * D;
        for (uint32_t j = 0; j < kG; ++j) {
          __m256 b = _mm256_setzero_ps();
          for (uint32_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(&st.q[j * D + d]);
            const __m256 sc = LoadHalf8(reinterpret_cast<const uint8_t*>(k->scales + p0 + d));
            const __m256 zp = LoadHalf8(reinterpret_cast<const uint8_t*>(k->zeros + p0 + d));
            _mm256_storeu_ps(&qf[j * D + d], _mm256_mul_ps(qv, sc));
            b = _mm256_fmadd_ps(qv, zp, b);
          }
          bias[j] = Hsum(b);
        }
      }
    }
    // kT tokens at a time (same token group): kT x kG independent FMA chains hide the FMA
    // latency, and each q vector loaded serves kT tokens.
    constexpr uint32_t kT = kG >= 8 ? 1 : 8 / kG > 4 ? 4 : 8 / kG;
    uint32_t n = 1;
    if constexpr (kT > 1) {
      n = std::min<uint32_t>(kT, T - t);
      if constexpr (kAffine) n = std::min<uint32_t>(n, k->group_size - t % k->group_size);
    }
    if (n == kT) {
      const uint8_t* rows[kT];
      for (uint32_t i = 0; i < kT; ++i) rows[i] = RowOf(seg, k, seg.k, t + i);
      __m256 acc[kT][kG];
      for (uint32_t i = 0; i < kT; ++i) {
        for (uint32_t j = 0; j < kG; ++j) acc[i][j] = _mm256_setzero_ps();
      }
      for (uint32_t d = 0; d < D; d += 8) {
        __m256 c[kT];
        for (uint32_t i = 0; i < kT; ++i) c[i] = Load8<kSrc>(rows[i], d);
        for (uint32_t j = 0; j < kG; ++j) {
          const __m256 qv = _mm256_loadu_ps(&q[j * D + d]);
          for (uint32_t i = 0; i < kT; ++i) acc[i][j] = _mm256_fmadd_ps(c[i], qv, acc[i][j]);
        }
      }
      for (uint32_t i = 0; i < kT; ++i) {
        for (uint32_t j = 0; j < kG; ++j) {
          st.scores[size_t{j} * T + t + i] =
              Finish(Hsum(acc[i][j]), k, seg.head, T, t + i, bias[j]);
        }
      }
      t += kT - 1;
      continue;
    }
    const uint8_t* row = RowOf(seg, k, seg.k, t);
    __m256 acc[kG];
    for (uint32_t j = 0; j < kG; ++j) acc[j] = _mm256_setzero_ps();
    for (uint32_t d = 0; d < D; d += 8) {
      const __m256 c = Load8<kSrc>(row, d);
      for (uint32_t j = 0; j < kG; ++j)
        acc[j] = _mm256_fmadd_ps(c, _mm256_loadu_ps(&q[j * D + d]), acc[j]);
    }
    for (uint32_t j = 0; j < kG; ++j) {
      st.scores[size_t{j} * T + t] = Finish(Hsum(acc[j]), k, seg.head, T, t, bias[j]);
    }
  }
  if (k != nullptr) AddScoreCorrectionsAvx2(seg, st);
}

template <int kSrc, uint32_t kG>
STRATA_AVX2 void Accumulate(const Segment& seg, HeadGroupState& st) {
  const uint32_t D = st.d, T = seg.tokens;
  const TensorOperands* v = seg.block ? &seg.block->v : nullptr;
  constexpr bool kAffine = kSrc > 0;
  const uint32_t groups = kAffine ? v->groups : 1;  // int8: one scale per token
  // w[j][g][t]: the weight of token t's codes in channel group g (p, times the scale).
  const float* w = st.scores.data();
  if (v != nullptr) PrefetchRows(*v, seg.head, T);
  if constexpr (kAffine || kSrc == kSrcInt8) {
    // Per-token scales (and zero points) of this head, widened once with F16C and transposed to
    // [g][t], so that the weights and the zero-point sums below are vector loops over tokens.
    const size_t n = size_t{T} * groups;
    float* wt = st.Work(size_t{kG} * n + size_t{kG} * groups + 2 * n);
    float* zsum = wt + size_t{kG} * n;  // [G, groups]: sum_t p * zero point
    float* sc = zsum + size_t{kG} * groups;
    float* zp = sc + n;
    thread_local std::vector<float> tmp;
    WidenTransposed(v->scales + size_t{seg.head} * n, T, groups, tmp, sc);
    if constexpr (kAffine) WidenTransposed(v->zeros + size_t{seg.head} * n, T, groups, tmp, zp);
    for (uint32_t j = 0; j < kG; ++j) {
      const float* p = &st.scores[size_t{j} * T];
      for (uint32_t g = 0; g < groups; ++g) {
        float* wjg = wt + (size_t{j} * groups + g) * T;
        const float* scg = sc + size_t{g} * T;
        const float* zpg = zp + size_t{g} * T;
        __m256 z = _mm256_setzero_ps();
        uint32_t t = 0;
        for (; t + 8 <= T; t += 8) {
          const __m256 pv = _mm256_loadu_ps(p + t);
          _mm256_storeu_ps(wjg + t, _mm256_mul_ps(pv, _mm256_loadu_ps(scg + t)));
          if constexpr (kAffine) z = _mm256_fmadd_ps(pv, _mm256_loadu_ps(zpg + t), z);
        }
        float zs = Hsum(z);
        for (; t < T; ++t) {
          wjg[t] = p[t] * scg[t];
          if constexpr (kAffine) zs += p[t] * zpg[t];
        }
        zsum[j * groups + g] = zs;
      }
    }
    w = wt;
  } else if constexpr (kSrc == kSrcFp8) {
    // One scale for the tensor, times the 2^8 of the fp8-to-fp16 bit trick.
    const size_t n = size_t{kG} * T;
    float* wf = st.Work(n);
    const float f = v->tensor_scale * 256.0f;
    for (size_t i = 0; i < n; ++i) wf[i] = st.scores[i] * f;
    w = wf;
  }
  // Two 8-channel chunks per pass (when they share a scale group) give 2 x kG independent FMA
  // chains; with 8 query heads one chunk already has enough.
  constexpr uint32_t kC = kG >= 8 ? 1 : 2;
  const bool pairs_share_group = !kAffine || v->group_size % 16 == 0;
  const float* zsum = kAffine ? st.work.data() + size_t{kG} * T * groups : nullptr;
  // Token t's weight for query head j in channel group g.
  const auto W = [&](uint32_t j, uint32_t g, uint32_t t) -> const float* {
    return &w[(size_t{j} * groups + g) * T + t];
  };
  uint32_t d = 0;
  if (kC == 2 && pairs_share_group) {
    for (; d + 16 <= D; d += 16) {
      const uint32_t g = kAffine ? d / v->group_size : 0;
      __m256 acc[kG][2];
      for (uint32_t j = 0; j < kG; ++j) {
        acc[j][0] = _mm256_loadu_ps(&st.acc[j * D + d]);
        acc[j][1] = _mm256_loadu_ps(&st.acc[j * D + d + 8]);
      }
      for (uint32_t t = 0; t < T; ++t) {
        const uint8_t* row = RowOf(seg, v, seg.v, t);
        const __m256 c0 = Load8<kSrc>(row, d), c1 = Load8<kSrc>(row, d + 8);
        for (uint32_t j = 0; j < kG; ++j) {
          const __m256 wv = _mm256_broadcast_ss(W(j, g, t));
          acc[j][0] = _mm256_fmadd_ps(c0, wv, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(c1, wv, acc[j][1]);
        }
      }
      for (uint32_t j = 0; j < kG; ++j) {
        if constexpr (kAffine) {
          const __m256 z = _mm256_set1_ps(zsum[j * groups + g]);
          acc[j][0] = _mm256_add_ps(acc[j][0], z);
          acc[j][1] = _mm256_add_ps(acc[j][1], z);
        }
        _mm256_storeu_ps(&st.acc[j * D + d], acc[j][0]);
        _mm256_storeu_ps(&st.acc[j * D + d + 8], acc[j][1]);
      }
    }
  }
  for (; d < D; d += 8) {
    const uint32_t g = kAffine ? d / v->group_size : 0;
    __m256 acc[kG];
    for (uint32_t j = 0; j < kG; ++j) acc[j] = _mm256_loadu_ps(&st.acc[j * D + d]);
    for (uint32_t t = 0; t < T; ++t) {
      const __m256 c = Load8<kSrc>(RowOf(seg, v, seg.v, t), d);
      for (uint32_t j = 0; j < kG; ++j) {
        acc[j] =
            _mm256_fmadd_ps(c, _mm256_broadcast_ss(W(j, g, t)), acc[j]);
      }
    }
    if constexpr (kAffine) {
      for (uint32_t j = 0; j < kG; ++j)
        acc[j] = _mm256_add_ps(acc[j], _mm256_set1_ps(zsum[j * groups + g]));
    }
    for (uint32_t j = 0; j < kG; ++j) _mm256_storeu_ps(&st.acc[j * D + d], acc[j]);
  }
  if (v != nullptr) AddValueCorrectionsAvx2(seg, st);
}

// The source kind of a tensor for the templates, or 0 when not specialized.
int SourceOf(const Segment& seg, const TensorOperands* t) {
  if (seg.block == nullptr) return kSrcFp32;
  if (t->kind == CodeKind::kFloat16) return kSrcFp16;
  if (t->kind == CodeKind::kInt8) return kSrcInt8;
  if (t->kind == CodeKind::kFp8E4M3) return kSrcFp8;
  if (t->kind == CodeKind::kAffine &&
      (t->bits == 2 || t->bits == 3 || t->bits == 4 || t->bits == 8)) {
    return t->bits;
  }
  return 0;
}

template <template <int, uint32_t> class F, int kSrc>
bool DispatchG(uint32_t g, const Segment& seg, HeadGroupState& st) {
  switch (g) {
    case 1:
      F<kSrc, 1>::Run(seg, st);
      return true;
    case 2:
      F<kSrc, 2>::Run(seg, st);
      return true;
    case 4:
      F<kSrc, 4>::Run(seg, st);
      return true;
    case 8:
      F<kSrc, 8>::Run(seg, st);
      return true;
    default:
      return false;
  }
}

template <template <int, uint32_t> class F>
bool Dispatch(int src, const Segment& seg, HeadGroupState& st) {
  switch (src) {
    case kSrcFp32:
      return DispatchG<F, kSrcFp32>(st.g, seg, st);
    case kSrcFp16:
      return DispatchG<F, kSrcFp16>(st.g, seg, st);
    case kSrcInt8:
      return DispatchG<F, kSrcInt8>(st.g, seg, st);
    case kSrcFp8:
      return DispatchG<F, kSrcFp8>(st.g, seg, st);
    case 2:
      return DispatchG<F, 2>(st.g, seg, st);
    case 3:
      return DispatchG<F, 3>(st.g, seg, st);
    case 4:
      return DispatchG<F, 4>(st.g, seg, st);
    case 8:
      return DispatchG<F, 8>(st.g, seg, st);
    default:
      return false;
  }
}

template <int kSrc, uint32_t kG>
struct ScoresOp {
  static void Run(const Segment& s, HeadGroupState& st) { Scores<kSrc, kG>(s, st); }
};
template <int kSrc, uint32_t kG>
struct AccumulateOp {
  static void Run(const Segment& s, HeadGroupState& st) { Accumulate<kSrc, kG>(s, st); }
};

}  // namespace

STRATA_AVX2 void SoftmaxAvx2(uint32_t T, HeadGroupState& st) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (uint32_t j = 0; j < st.g; ++j) {
    float* s = &st.scores[size_t{j} * T];
    __m256 vmx = _mm256_set1_ps(neg_inf);
    uint32_t t = 0;
    for (; t + 8 <= T; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + t));
    float mx = Hmax(vmx);
    for (; t < T; ++t) mx = std::max(mx, s[t]);
    const float m_new = std::max(st.m[j], mx);
    if (m_new == neg_inf) {  // nothing visible yet: no weight
      std::fill(s, s + T, 0.0f);
      continue;
    }
    const float alpha = st.m[j] == neg_inf ? 0.0f : std::exp(st.m[j] - m_new);
    float* acc = &st.acc[size_t{j} * st.d];
    if (alpha != 1.0f) {
      for (uint32_t d = 0; d < st.d; ++d) acc[d] *= alpha;
    }
    const __m256 vm = _mm256_set1_ps(m_new);
    __m256 vl = _mm256_setzero_ps();
    for (t = 0; t + 8 <= T; t += 8) {
      const __m256 p = ExpAvx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
      _mm256_storeu_ps(s + t, p);
      vl = _mm256_add_ps(vl, p);
    }
    float l = st.l[j] * alpha + Hsum(vl);
    for (; t < T; ++t) {
      s[t] = std::exp(s[t] - m_new);
      l += s[t];
    }
    st.l[j] = l;
    st.m[j] = m_new;
  }
}

namespace {

// The integer-score kernels (internal/integer_dot.inc), once per instruction set.
namespace integer_avx2 {
#define STRATA_INT8_TARGET "avx2,fma,f16c"
#define STRATA_INT8_VNNI 0
#include "kernels/internal/integer_dot.inc"
#undef STRATA_INT8_TARGET
#undef STRATA_INT8_VNNI
}  // namespace integer_avx2
namespace integer_avx_vnni {
#define STRATA_INT8_TARGET "avx2,fma,f16c,avxvnni"
#define STRATA_INT8_VNNI 1
#include "kernels/internal/integer_dot.inc"
#undef STRATA_INT8_TARGET
#undef STRATA_INT8_VNNI
}  // namespace integer_avx_vnni
namespace integer_avx512_vnni {
#define STRATA_INT8_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define STRATA_INT8_VNNI 2
#include "kernels/internal/integer_dot.inc"
#undef STRATA_INT8_TARGET
#undef STRATA_INT8_VNNI
}  // namespace integer_avx512_vnni
namespace integer_avx512_zmm {
namespace zv = zmm_native;
#define STRATA_INT8_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define STRATA_INT8_VNNI 2
#define STRATA_INT8_ZMM 1
#define STRATA_INT8_FALLBACK integer_avx512_vnni
#include "kernels/internal/integer_dot.inc"
#undef STRATA_INT8_TARGET
#undef STRATA_INT8_VNNI
#undef STRATA_INT8_ZMM
#undef STRATA_INT8_FALLBACK
}  // namespace integer_avx512_zmm
namespace integer_emulated_vnni {
#define STRATA_INT8_TARGET "avx2,fma,f16c"
#define STRATA_INT8_VNNI 3
#include "kernels/internal/integer_dot.inc"
#undef STRATA_INT8_TARGET
#undef STRATA_INT8_VNNI
}  // namespace integer_emulated_vnni
// The 512-bit kernels with each AVX-512 operation done exactly on two AVX2 registers
// (zmm_ops.h), so that machines without AVX-512 run their code and test it bit for bit.
namespace integer_emulated_zmm {
namespace zv = zmm_emulated;
#define STRATA_INT8_TARGET "avx2,fma,f16c"
#define STRATA_INT8_VNNI 3
#define STRATA_INT8_ZMM 1
#define STRATA_INT8_FALLBACK integer_emulated_vnni
#include "kernels/internal/integer_dot.inc"
#undef STRATA_INT8_TARGET
#undef STRATA_INT8_VNNI
#undef STRATA_INT8_ZMM
#undef STRATA_INT8_FALLBACK
}  // namespace integer_emulated_zmm

// Op for codes `src` (affine at 2, 3, 4 or 8 bits, or kSrcInt8: IntegerSource) for the
// segment's G, of one instruction set; false when none has that G.
template <template <int, uint32_t> class Op>
bool RunBits(int src, const Segment& seg, HeadGroupState& st) {
  switch (src) {
    case 2:
      return DispatchG<Op, 2>(st.g, seg, st);
    case 3:
      return DispatchG<Op, 3>(st.g, seg, st);
    case 4:
      return DispatchG<Op, 4>(st.g, seg, st);
    case 8:
      return DispatchG<Op, 8>(st.g, seg, st);
    case kSrcInt8:
      return DispatchG<Op, kSrcInt8>(st.g, seg, st);
    default:
      return false;
  }
}

// The integer kernels' template argument for a tensor's codes: its bits when affine, kSrcInt8
// for int8.
int IntegerSource(const TensorOperands& t) { return t.kind == CodeKind::kInt8 ? kSrcInt8 : t.bits; }

// Runs Op (one instantiation per instruction set, from internal/integer_dot.inc) with the CPU's
// integer dot product for codes `bits` (RunBits) for the segment's G; false when no kernel has
// that G.
template <template <int, uint32_t> class OpAvx2, template <int, uint32_t> class OpAvxVnni,
          template <int, uint32_t> class OpAvx512Vnni, template <int, uint32_t> class OpEmulated,
          template <int, uint32_t> class OpAvx512Zmm, template <int, uint32_t> class OpEmulatedZmm>
bool RunInteger(int bits, const Segment& seg, HeadGroupState& st) {
  switch (IntegerDotIsa()) {
    case IntegerIsa::kAvx512Zmm:
      return RunBits<OpAvx512Zmm>(bits, seg, st);
    case IntegerIsa::kAvx512Vnni:
      return RunBits<OpAvx512Vnni>(bits, seg, st);
    case IntegerIsa::kAvxVnni:
      return RunBits<OpAvxVnni>(bits, seg, st);
    case IntegerIsa::kEmulatedVnni:
      return RunBits<OpEmulated>(bits, seg, st);
    case IntegerIsa::kEmulatedZmm:
      return RunBits<OpEmulatedZmm>(bits, seg, st);
    case IntegerIsa::kAvx2:
      break;
  }
  return RunBits<OpAvx2>(bits, seg, st);
}

// Whether a tensor's rows are codes the integer kernels unpack: affine at 2 or 4 bits, rows a
// multiple of 16 bytes; at 3 bits, 6 bytes per 16 channels and at least two such chunks (the
// last chunk's loads reach back 2 bytes into its own row); affine at 8 bits or int8, rows a
// multiple of 16 bytes.
bool IntegerRows(const TensorOperands& t, uint32_t d) {
  if ((t.kind != CodeKind::kAffine && t.kind != CodeKind::kInt8) ||
      t.row_bytes * 8 != d * static_cast<uint32_t>(t.bits)) {
    return false;
  }
  if (t.kind == CodeKind::kInt8) return t.bits == 8 && d % 16 == 0;
  if (t.bits == 3) return d % 16 == 0 && d >= 32;
  return (t.bits == 2 || t.bits == 4 || t.bits == 8) && t.row_bytes % 16 == 0;
}

// Whether the integer kernels take this segment's keys: IntegerRows, head dims a multiple of 32
// up to kMaxInt8Dim; int8 codes, per-channel parameters (KIVI's and KCVT's K), or at 2 and 4 bits
// per-token channel groups (SKVQ's K) of whole lanes, at most 8 per vector.
bool IntegerKeys(const Segment& seg, const HeadGroupState& st) {
  if (!st.integer_dot || seg.block == nullptr) return false;
  const TensorOperands& k = seg.block->k;
  if (!IntegerRows(k, st.d) || st.d % 32 != 0 || st.d > integer_avx2::kMaxInt8Dim) return false;
  if (k.kind == CodeKind::kInt8 || !k.token_groups) return true;
  if (k.bits != 2 && k.bits != 4) return false;
  const uint32_t lane_span = 4 * (8 / static_cast<uint32_t>(k.bits));
  return k.groups <= 8 && (k.groups == 1 || k.group_size % lane_span == 0);
}

// Whether the int16-weight value kernels take this segment's values: IntegerRows with per-token
// parameters (KIVI's and KCVT's V, int8), channel groups that one operand's channels never
// straddle (at 2 and 4 bits 8 bytes of codes, at 3 and 8 bits 16 channels), at most 4096 tokens
// below 8 bits (the int32 sums' bound; 8-bit sums are taken over 256 tokens at a time).
bool IntegerValues(const Segment& seg, const HeadGroupState& st) {
  if (!st.integer_dot || seg.block == nullptr) return false;
  const TensorOperands& v = seg.block->v;
  if (v.kind == CodeKind::kInt8) return IntegerRows(v, st.d);
  if (!v.token_groups || !IntegerRows(v, st.d) || (v.bits != 8 && seg.tokens > 4096)) return false;
  const uint32_t span = v.bits == 3 || v.bits == 8 ? 16 : 8 * (8 / static_cast<uint32_t>(v.bits));
  return v.groups == 1 || v.group_size % span == 0;
}

}  // namespace

namespace {
// SetIntegerIsa's choice (an IntegerIsa), or -1 for the CPU's best.
std::atomic<int> integer_isa_override{-1};
}  // namespace

bool IntegerIsaRuns(IntegerIsa isa) {
  const CpuFeatures& f = GetCpuFeatures();
  const bool avx2 = DecodeAttentionUsesAvx2();
  switch (isa) {
    case IntegerIsa::kAvx512Vnni:
    case IntegerIsa::kAvx512Zmm:
      return avx2 && f.avx512vnni && f.avx512vl && f.avx512bw;
    case IntegerIsa::kAvxVnni:
      return avx2 && f.avx_vnni;
    case IntegerIsa::kAvx2:
    case IntegerIsa::kEmulatedVnni:
    case IntegerIsa::kEmulatedZmm:
      return avx2;
  }
  return false;
}

bool SetIntegerIsa(std::optional<IntegerIsa> isa) {
  if (isa.has_value() && !IntegerIsaRuns(*isa)) return false;
  integer_isa_override.store(isa.has_value() ? static_cast<int>(*isa) : -1,
                             std::memory_order_relaxed);
  return true;
}

IntegerIsa IntegerDotIsa() {
  if (const int o = integer_isa_override.load(std::memory_order_relaxed); o >= 0) {
    return static_cast<IntegerIsa>(o);
  }
  // The 512-bit kernels only where asked for (see IntegerIsa).
  if (IntegerIsaRuns(IntegerIsa::kAvx512Vnni)) return IntegerIsa::kAvx512Vnni;
  if (IntegerIsaRuns(IntegerIsa::kAvxVnni)) return IntegerIsa::kAvxVnni;
  return IntegerIsa::kAvx2;
}

void ScoresAvx2(const Segment& seg, HeadGroupState& st) {
  if (IntegerKeys(seg, st)) {
    const int bits = IntegerSource(seg.block->k);
    const bool ran =
        seg.block->k.token_groups
            ? RunInteger<integer_avx2::ScoresTokenGroupsOp, integer_avx_vnni::ScoresTokenGroupsOp,
                         integer_avx512_vnni::ScoresTokenGroupsOp,
                         integer_emulated_vnni::ScoresTokenGroupsOp,
                         integer_avx512_zmm::ScoresTokenGroupsOp,
                         integer_emulated_zmm::ScoresTokenGroupsOp>(bits, seg, st)
            : RunInteger<integer_avx2::ScoresInt8Op, integer_avx_vnni::ScoresInt8Op,
                         integer_avx512_vnni::ScoresInt8Op, integer_emulated_vnni::ScoresInt8Op,
                         integer_avx512_zmm::ScoresInt8Op, integer_emulated_zmm::ScoresInt8Op>(
                  bits, seg, st);
    if (ran) return;
  }
  if (st.d % 8 != 0 || (seg.block != nullptr && seg.block->k.token_groups) ||
      !Dispatch<ScoresOp>(SourceOf(seg, seg.block ? &seg.block->k : nullptr), seg, st)) {
    ScoresPortable(seg, st);
  }
}

void AccumulateAvx2(const Segment& seg, HeadGroupState& st) {
  if (IntegerValues(seg, st) &&
      RunInteger<integer_avx2::AccumulateInt16Op, integer_avx_vnni::AccumulateInt16Op,
                 integer_avx512_vnni::AccumulateInt16Op, integer_emulated_vnni::AccumulateInt16Op,
                 integer_avx512_zmm::AccumulateInt16Op, integer_emulated_zmm::AccumulateInt16Op>(
          IntegerSource(seg.block->v), seg, st)) {
    return;
  }
  if (st.d % 8 != 0 ||
      !Dispatch<AccumulateOp>(SourceOf(seg, seg.block ? &seg.block->v : nullptr), seg, st)) {
    AccumulatePortable(seg, st);
  }
}

}  // namespace strata::kernels::internal
