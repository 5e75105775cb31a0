// AVX2 loops of the affine quantizer; see kernels/internal/codec_simd.h. Compiled for AVX2 by
// target attributes (not FMA: the portable loops multiply and add separately).
#include "kernels/internal/codec_simd.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common/cpu_features.h"
#include "common/fp8.h"
#include "common/half.h"
#include "kernels/bit_pack.h"
#include "kernels/internal/force_inline.h"
#include "kernels/internal/vector_exp.h"

#define STRATA_CODEC_AVX2 __attribute__((target("avx2,f16c")))

namespace strata::kernels::internal {

namespace {
std::atomic<bool> simd_enabled{true};
}  // namespace

bool HaveCodecSimd() {
  const CpuFeatures& f = GetCpuFeatures();
  return f.avx2 && f.f16c && simd_enabled.load(std::memory_order_relaxed);
}
void SetCodecSimdForTesting(bool enabled) { simd_enabled.store(enabled); }

STRATA_CODEC_AVX2 void DequantRowAvx2(const uint8_t* codes, const float* z, const float* s,
                                      uint32_t n, float* out) {
  uint32_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 c = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d))));
    _mm256_storeu_ps(
        out + d, _mm256_add_ps(_mm256_loadu_ps(z + d), _mm256_mul_ps(c, _mm256_loadu_ps(s + d))));
  }
  for (; d < n; ++d) out[d] = z[d] + static_cast<float>(codes[d]) * s[d];
}

namespace {
// Indices i in [0, n) with row[i] < lo[i * step] or row[i] >= hi[i * step], ascending.
STRATA_CODEC_AVX2 inline uint32_t OutlierCandidatesImpl(const float* row, uint32_t n,
                                                        const float* lo, const float* hi,
                                                        uint32_t step, uint32_t* out) {
  uint32_t count = 0, i = 0;
  const __m256 slo = _mm256_set1_ps(lo[0]), shi = _mm256_set1_ps(hi[0]);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    const __m256 l = step ? _mm256_loadu_ps(lo + i) : slo;
    const __m256 h = step ? _mm256_loadu_ps(hi + i) : shi;
    int bits = _mm256_movemask_ps(
        _mm256_or_ps(_mm256_cmp_ps(v, l, _CMP_LT_OQ), _mm256_cmp_ps(v, h, _CMP_GE_OQ)));
    while (bits != 0) {
      out[count++] = i + static_cast<uint32_t>(__builtin_ctz(static_cast<unsigned>(bits)));
      bits &= bits - 1;
    }
  }
  for (; i < n; ++i) {
    if (row[i] < lo[i * step] || row[i] >= hi[i * step]) out[count++] = i;
  }
  return count;
}
}  // namespace

namespace {
// Lanes of 8 mask bytes (nonzero: skip) as a float blend mask.
STRATA_CODEC_AVX2 inline __m256 SkipLanes(const uint8_t* mask) {
  const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_setzero_si256()));
}
}  // namespace

namespace {
// The min and max of each group of row[0, D), leaving out elements whose mask byte is nonzero
// (mask may be null): skipped lanes offer +inf to the min and -inf to the max.
STRATA_CODEC_AVX2 inline void GroupMinMax(const float* row, const uint8_t* mask, uint32_t D,
                                          uint32_t gs, float* lo, float* hi) {
  const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
  for (uint32_t d0 = 0, g = 0; d0 < D; d0 += gs, ++g) {
    const uint32_t d1 = std::min(D, d0 + gs);
    __m256 vl = inf, vh = ninf;
    uint32_t d = d0;
    for (; d + 8 <= d1; d += 8) {
      __m256 a = _mm256_loadu_ps(row + d), b = a;
      if (mask != nullptr) {
        const __m256 skip = SkipLanes(mask + d);
        a = _mm256_blendv_ps(a, inf, skip);
        b = _mm256_blendv_ps(b, ninf, skip);
      }
      vl = _mm256_min_ps(a, vl);
      vh = _mm256_max_ps(b, vh);
    }
    alignas(32) float l[8], h[8];
    _mm256_store_ps(l, vl);
    _mm256_store_ps(h, vh);
    // min and max ignore order among non-NaN values; a NaN input was skipped above as
    // std::min/std::max skip it.
    float a = l[0], b = h[0];
    for (int i = 1; i < 8; ++i) {
      a = std::min(a, l[i]);
      b = std::max(b, h[i]);
    }
    for (; d < d1; ++d) {
      if (mask != nullptr && mask[d]) continue;
      a = std::min(a, row[d]);
      b = std::max(b, row[d]);
    }
    lo[g] = a;
    hi[g] = b;
  }
}
}  // namespace

STRATA_CODEC_AVX2 void ColumnMinMaxAvx2(const float* rows, size_t stride, uint32_t n, uint32_t D,
                                        float* mn, float* mx, const uint8_t* mask) {
  const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
  uint32_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 lo = _mm256_loadu_ps(mn + d), hi = _mm256_loadu_ps(mx + d);
    for (uint32_t t = 0; t < n; ++t) {
      __m256 a = _mm256_loadu_ps(rows + t * stride + d), b = a;
      if (mask != nullptr) {  // a skipped lane offers +inf to the min and -inf to the max
        const __m256 skip = SkipLanes(mask + t * stride + d);
        a = _mm256_blendv_ps(a, inf, skip);
        b = _mm256_blendv_ps(b, ninf, skip);
      }
      lo = _mm256_min_ps(a, lo);  // (a < lo) ? a : lo, as std::min(lo, a)
      hi = _mm256_max_ps(b, hi);  // (b > hi) ? b : hi, as std::max(hi, b)
    }
    _mm256_storeu_ps(mn + d, lo);
    _mm256_storeu_ps(mx + d, hi);
  }
  for (; d < D; ++d) {
    for (uint32_t t = 0; t < n; ++t) {
      if (mask != nullptr && mask[t * stride + d]) continue;
      mn[d] = std::min(mn[d], rows[t * stride + d]);
      mx[d] = std::max(mx[d], rows[t * stride + d]);
    }
  }
}

STRATA_CODEC_AVX2 uint32_t OutlierCandidatesAvx2(const float* row, uint32_t n, const float* lo,
                                                 const float* hi, uint32_t* out) {
  return OutlierCandidatesImpl(row, n, lo, hi, 1, out);
}

STRATA_CODEC_AVX2 uint32_t OutlierCandidatesScalarAvx2(const float* row, uint32_t n, float lo,
                                                       float hi, uint32_t* out) {
  return OutlierCandidatesImpl(row, n, &lo, &hi, 0, out);
}

namespace {
template <bool kMax>
STRATA_CODEC_AVX2 inline __m256 MinOrMax(__m256 a, __m256 b) {
  if constexpr (kMax) return _mm256_max_ps(a, b);
  return _mm256_min_ps(a, b);
}
// Lane k of the result = the min (kMax: max) of v[k]'s eight lanes: a tree of unpacks, shuffles
// and 128-bit swaps, 21 instructions for eight reductions.
template <bool kMax>
STRATA_CODEC_AVX2 inline __m256 Reduce8(const __m256* v) {
  constexpr auto op = MinOrMax<kMax>;
  __m256 x[4], y[2];
  for (int i = 0; i < 4; ++i) {  // even lanes: row 2i's partial results, odd lanes: row 2i + 1's
    x[i] =
        op(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // lane r of each 128-bit half: row 4i + r's
    y[i] = op(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
              _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  }
  return op(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
}
}  // namespace

STRATA_CODEC_AVX2 void GroupMinMaxAvx2(const float* rows, uint32_t n, uint32_t D, uint32_t gs,
                                       float* lo, float* hi, const uint8_t* mask) {
  const uint32_t groups = (D + gs - 1) / gs;
  uint32_t r = 0;
  if (mask == nullptr && D % 8 == 0) {
    // Eight rows at a time: each row's group folded into vector lanes, then the eight rows'
    // lanes reduced together (Reduce8) instead of one row at a time.
    for (; r + 8 <= n; r += 8) {
      const float* const x = rows + size_t{r} * D;
      for (uint32_t g = 0; g < groups; ++g) {
        const uint32_t d0 = g * gs, d1 = std::min(D, d0 + gs);
        __m256 vl[8], vh[8];
        for (uint32_t k = 0; k < 8; ++k) {
          vl[k] = vh[k] = _mm256_loadu_ps(x + size_t{k} * D + d0);
          for (uint32_t d = d0 + 8; d < d1; d += 8) {
            const __m256 a = _mm256_loadu_ps(x + size_t{k} * D + d);
            vl[k] = _mm256_min_ps(a, vl[k]);
            vh[k] = _mm256_max_ps(a, vh[k]);
          }
        }
        alignas(32) float l[8], h[8];
        _mm256_store_ps(l, Reduce8<false>(vl));
        _mm256_store_ps(h, Reduce8<true>(vh));
        for (uint32_t k = 0; k < 8; ++k) {
          lo[size_t{r + k} * groups + g] = l[k];
          hi[size_t{r + k} * groups + g] = h[k];
        }
      }
    }
  }
  for (; r < n; ++r) {
    GroupMinMax(rows + size_t{r} * D, mask == nullptr ? nullptr : mask + size_t{r} * D, D, gs,
                lo + size_t{r} * groups, hi + size_t{r} * groups);
  }
}

namespace {

// AffineCode() of 8 values with per-lane zero point and inverse scale, as int32 lanes. A NaN y
// stays NaN through max_ps(0, y) (it returns its second operand) as through std::max(y, 0).
STRATA_CODEC_AVX2 inline __m256i Codes8(const float* x, __m256 z, __m256 inv, __m256 vq) {
  const __m256 y =
      _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), z), inv), _mm256_set1_ps(0.5f));
  const __m256 c = _mm256_max_ps(_mm256_setzero_ps(), y);
  return _mm256_cvttps_epi32(_mm256_min_ps(_mm256_cvtepi32_ps(_mm256_cvttps_epi32(c)), vq));
}

// 32 int32 lanes within [0, 255] to 32 bytes, in order (the packs interleave the 128-bit lanes).
STRATA_CODEC_AVX2 inline __m256i PackBytes(const __m256i* q) {
  const __m256i ab = _mm256_packus_epi32(q[0], q[1]), cd = _mm256_packus_epi32(q[2], q[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 8 int32 lanes within [0, 255] to 8 bytes, in order.
STRATA_CODEC_AVX2 inline void StoreBytes8(__m256i q, uint8_t* out) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w, w));
}

}  // namespace

STRATA_CODEC_AVX2 void QuantizeRowAvx2(const float* x, const float* z, const float* inv, uint32_t n,
                                       float qmax, uint8_t* codes) {
  const __m256 vq = _mm256_set1_ps(qmax);
  uint32_t d = 0;
  for (; d + 32 <= n; d += 32) {
    __m256i q[4];
    for (uint32_t u = 0; u < 4; ++u) {
      const uint32_t i = d + 8 * u;
      q[u] = Codes8(x + i, _mm256_loadu_ps(z + i), _mm256_loadu_ps(inv + i), vq);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + d), PackBytes(q));
  }
  for (; d < n; ++d) codes[d] = AffineCode(x[d], z[d], inv[d], qmax);
}

STRATA_CODEC_AVX2 void QuantizeGroupsAvx2(const float* x, const float* z, const float* inv,
                                          uint32_t n, uint32_t gs, float qmax, uint8_t* codes) {
  const __m256 vq = _mm256_set1_ps(qmax);
  uint32_t d = 0;
  // 32 values at a time where a group holds them all (gs a multiple of 32), else 8.
  if (gs % 32 == 0) {
    for (; d + 32 <= n; d += 32) {
      const __m256 vz = _mm256_set1_ps(z[d / gs]), vi = _mm256_set1_ps(inv[d / gs]);
      __m256i q[4];
      for (uint32_t u = 0; u < 4; ++u) q[u] = Codes8(x + d + 8 * u, vz, vi, vq);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + d), PackBytes(q));
    }
  }
  for (; d + 8 <= n; d += 8) {
    StoreBytes8(Codes8(x + d, _mm256_set1_ps(z[d / gs]), _mm256_set1_ps(inv[d / gs]), vq),
                codes + d);
  }
  for (; d < n; ++d) codes[d] = AffineCode(x[d], z[d / gs], inv[d / gs], qmax);
}

namespace {
// Eight groups' ranges, (0, 0) where lo > hi (every element of the group an outlier).
struct Ranges {
  __m256 lo, hi;
};
STRATA_CODEC_AVX2 inline Ranges LoadRanges(const float* lo, const float* hi) {
  const __m256 l = _mm256_loadu_ps(lo), h = _mm256_loadu_ps(hi);
  const __m256 empty = _mm256_cmp_ps(l, h, _CMP_GT_OQ);
  return {_mm256_andnot_ps(empty, l), _mm256_andnot_ps(empty, h)};
}
}  // namespace

STRATA_CODEC_AVX2 void AffineParamsAvx2(const float* lo, const float* hi, uint32_t n, float qmax,
                                        uint16_t* scale16, uint16_t* zero16, float* s, float* z,
                                        float* inv) {
  const __m256 vq = _mm256_set1_ps(qmax), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const auto [l, h] = LoadRanges(lo + i, hi + i);
    // fp16 by round to nearest even, as FloatToHalfBits (the ranges are finite).
    const __m128i sh = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(h, l), vq),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i zh = _mm256_cvtps_ph(l, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scale16 + i), sh);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(zero16 + i), zh);
    const __m256 sf = _mm256_cvtph_ps(sh);
    _mm256_storeu_ps(s + i, sf);
    _mm256_storeu_ps(z + i, _mm256_cvtph_ps(zh));
    const __m256 positive = _mm256_cmp_ps(sf, zero, _CMP_GT_OQ);
    _mm256_storeu_ps(inv + i, _mm256_and_ps(positive, _mm256_div_ps(one, sf)));
  }
  for (; i < n; ++i) {
    float l = lo[i], h = hi[i];
    if (l > h) l = h = 0;
    scale16[i] = FloatToHalfBits((h - l) / qmax);
    zero16[i] = FloatToHalfBits(l);
    s[i] = HalfBitsToFloat(scale16[i]);
    z[i] = HalfBitsToFloat(zero16[i]);
    inv[i] = s[i] > 0 ? 1.0f / s[i] : 0.0f;
  }
}

STRATA_CODEC_AVX2 bool HalfToFloatWithinAvx2(const uint16_t* src, uint32_t n, float limit,
                                             float* dst) {
  const __m256 vl = _mm256_set1_ps(limit),
               abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, v);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), vl, _CMP_LE_OQ));
  }
  bool all = _mm256_movemask_ps(ok) == 0xff;
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + i, sizeof(h));
    dst[i] = HalfBitsToFloat(h);
    all &= std::fabs(dst[i]) <= limit;
  }
  return all;
}

STRATA_CODEC_AVX2 void GatherAvx2(const float* x, const uint16_t* idx, uint32_t n, float* out) {
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i j =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(idx + i)));
    _mm256_storeu_ps(out + i, _mm256_i32gather_ps(x, j, 4));
  }
  for (; i < n; ++i) out[i] = x[idx[i]];
}

STRATA_CODEC_AVX2 bool AllWithinAvx2(const float* x, uint32_t n, float limit) {
  const __m256 vl = _mm256_set1_ps(limit),
               abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, vl, _CMP_LE_OQ));  // NaN: false
  }
  bool all = _mm256_movemask_ps(ok) == 0xff;
  for (; i < n; ++i) all &= std::fabs(x[i]) <= limit;
  return all;
}

STRATA_CODEC_AVX2 float MaxAbsAvx2(const float* x, size_t n, float init) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_set1_ps(init);
  size_t i = 0;
  // max_ps returns its second operand when either is NaN: the running maximum stays.
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = init;
  for (float v : lanes) mx = std::max(mx, v);
  for (; i < n; ++i) mx = std::max(mx, std::fabs(x[i]));
  return mx;
}

namespace {
// FloatToFp8E4M3 of eight floats, the codes in the low byte of each 32-bit lane.
STRATA_CODEC_AVX2 inline __m256i Fp8Codes(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  // Normal: exponent rebiased 127 -> 7, three mantissa bits, rounded to nearest even by adding
  // 0x7ffff plus the kept bit's lowest; past 448 saturates to 0x7e.
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(abs, 20), _mm256_set1_epi32(1));
  __m256i code =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_sub_epi32(abs, _mm256_set1_epi32(0x3c000000)),
                                         _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), lsb)),
                        20);
  code = _mm256_min_epi32(code, _mm256_set1_epi32(0x7e));
  // Below 2^-6: |f| * 2^9 (exact) rounded to nearest even by the conversion (MXCSR's default).
  const __m256i sub =
      _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(abs), _mm256_set1_ps(512.0f)));
  code = _mm256_blendv_epi8(code, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), abs));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f),
                            _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000)));  // NaN
  return _mm256_or_si256(code, sign);
}

// Fp8E4M3ToFloat of eight finite codes (int32 lanes).
STRATA_CODEC_AVX2 inline __m256 Fp8CodesToFloat(__m256i c) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i exp = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(0xf));
  const __m256i man = _mm256_and_si256(c, _mm256_set1_epi32(0x7));
  const __m256i normal =
      _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(exp, _mm256_set1_epi32(120)), 23),
                      _mm256_slli_epi32(man, 20));
  const __m256i sub = _mm256_castps_si256(
      _mm256_mul_ps(_mm256_cvtepi32_ps(man), _mm256_set1_ps(0x1p-9f)));  // man * 2^-9, exact
  const __m256i mag =
      _mm256_blendv_epi8(normal, sub, _mm256_cmpeq_epi32(exp, _mm256_setzero_si256()));
  return _mm256_castsi256_ps(_mm256_or_si256(mag, sign));
}

// Fp8E4M3Floor (ceil = false) or Fp8E4M3Ceil of eight finite floats.
STRATA_CODEC_AVX2 inline __m256i Fp8Round(__m256 f, bool ceil) {
  const __m256i c = Fp8Codes(f);
  const __m256 back = Fp8CodesToFloat(c);
  // (The predicate is an immediate: clang wants a constant expression, so one call per branch.)
  const __m256i keep = _mm256_castps_si256(ceil ? _mm256_cmp_ps(back, f, _CMP_GE_OQ)
                                                : _mm256_cmp_ps(back, f, _CMP_LE_OQ));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i negative =
      _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), _mm256_set1_epi32(0x80));
  // Away from zero by one step unless at 448 already; toward zero by one step.
  const __m256i away = _mm256_blendv_epi8(
      _mm256_add_epi32(c, one), c,
      _mm256_cmpgt_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)), _mm256_set1_epi32(0x7d)));
  const __m256i toward = _mm256_sub_epi32(c, one);
  // Floor: negative codes step away, positive toward (+0 to the smallest negative subnormal).
  // Ceil: positive codes step away, negative toward (-0 to the smallest positive subnormal).
  __m256i step = ceil ? _mm256_blendv_epi8(away, toward, negative)
                      : _mm256_blendv_epi8(toward, away, negative);
  const __m256i zero_code = _mm256_set1_epi32(ceil ? 0x80 : 0x00);
  step = _mm256_blendv_epi8(step, _mm256_set1_epi32(ceil ? 0x01 : 0x81),
                            _mm256_cmpeq_epi32(c, zero_code));
  return _mm256_blendv_epi8(step, c, keep);
}

}  // namespace

STRATA_CODEC_AVX2 void HeadMeanAvx2(float* x, uint32_t H, uint32_t T, uint32_t D,
                                    uint16_t* mean16) {
  const __m256 vh = _mm256_set1_ps(static_cast<float>(H));
  const size_t head = size_t{T} * D;
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t d = 0; d + 8 <= D; d += 8) {
      float* p = x + size_t{t} * D + d;
      __m256 sum = _mm256_setzero_ps();
      for (uint32_t h = 0; h < H; ++h) sum = _mm256_add_ps(sum, _mm256_loadu_ps(p + h * head));
      const __m128i m16 =
          _mm256_cvtps_ph(_mm256_div_ps(sum, vh), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(mean16 + size_t{t} * D + d), m16);
      const __m256 mean = _mm256_cvtph_ps(m16);
      for (uint32_t h = 0; h < H; ++h) {
        _mm256_storeu_ps(p + h * head, _mm256_sub_ps(_mm256_loadu_ps(p + h * head), mean));
      }
    }
  }
}

STRATA_CODEC_AVX2 void ChannelNormsAvx2(float* x, uint32_t H, uint32_t T, uint32_t D,
                                        uint16_t* norm16) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)),
               zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  for (uint32_t h = 0; h < H; ++h) {
    float* xh = x + size_t{h} * T * D;
    for (uint32_t d = 0; d + 8 <= D; d += 8) {
      __m256 mx = zero;
      for (uint32_t t = 0; t < T; ++t) {  // max_ps keeps its second operand for a NaN
        mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xh + size_t{t} * D + d), abs_mask), mx);
      }
      const __m256 norm =
          _mm256_blendv_ps(one, _mm256_sqrt_ps(mx), _mm256_cmp_ps(mx, zero, _CMP_GT_OQ));
      const __m128i n16 = _mm256_cvtps_ph(norm, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(norm16 + size_t{h} * D + d), n16);
      const __m256 inv = _mm256_div_ps(one, _mm256_cvtph_ps(n16));
      for (uint32_t t = 0; t < T; ++t) {
        float* p = xh + size_t{t} * D + d;
        _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), inv));
      }
    }
  }
}

STRATA_CODEC_AVX2 void ScaleToFp8E4M3Avx2(const float* x, size_t n, float mul, uint8_t* out) {
  const __m256 vmul = _mm256_set1_ps(mul);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    StoreBytes8(Fp8Codes(_mm256_mul_ps(_mm256_loadu_ps(x + i), vmul)), out + i);
  }
  for (; i < n; ++i) out[i] = FloatToFp8E4M3(x[i] * mul);
}

STRATA_CODEC_AVX2 void AffineParamsFp8Avx2(const float* lo, const float* hi, uint32_t n, float qmax,
                                           float ms, float mz, uint8_t* scale8, uint8_t* zero8,
                                           float* s, float* z, float* inv) {
  const __m256 vq = _mm256_set1_ps(qmax), vms = _mm256_set1_ps(ms), vmz = _mm256_set1_ps(mz),
               zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const auto [l, h] = LoadRanges(lo + i, hi + i);
    const __m256i zc = Fp8Round(_mm256_div_ps(l, vmz), /*ceil=*/false);
    const __m256 zf =
        _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(Fp8CodesToFloat(zc), vmz), kRound));
    const __m256i sc = Fp8Round(_mm256_div_ps(_mm256_div_ps(_mm256_sub_ps(h, zf), vq), vms),
                                /*ceil=*/true);
    const __m256 sf =
        _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(Fp8CodesToFloat(sc), vms), kRound));
    StoreBytes8(zc, zero8 + i);
    StoreBytes8(sc, scale8 + i);
    _mm256_storeu_ps(z + i, zf);
    _mm256_storeu_ps(s + i, sf);
    const __m256 positive = _mm256_cmp_ps(sf, zero, _CMP_GT_OQ);
    _mm256_storeu_ps(inv + i, _mm256_and_ps(positive, _mm256_div_ps(one, sf)));
  }
  for (; i < n; ++i) {
    float l = lo[i], h = hi[i];
    if (l > h) l = h = 0;
    zero8[i] = Fp8E4M3Floor(l / mz);
    z[i] = HalfBitsToFloat(FloatToHalfBits(Fp8E4M3ToFloat(zero8[i]) * mz));
    scale8[i] = Fp8E4M3Ceil((h - z[i]) / qmax / ms);
    s[i] = HalfBitsToFloat(FloatToHalfBits(Fp8E4M3ToFloat(scale8[i]) * ms));
    inv[i] = s[i] > 0 ? 1.0f / s[i] : 0.0f;
  }
}

STRATA_CODEC_AVX2 void QuantizeInt8Avx2(const float* x, uint32_t n, float inv, int8_t* out) {
  const __m256 vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f),
               sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
    // +0.5 where y >= 0, else -0.5 (a NaN takes -0.5, as the scalar comparison gives it)
    const __m256 neg =
        _mm256_andnot_ps(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GE_OQ), sign_bit);
    const __m256i q = _mm256_cvttps_epi32(_mm256_add_ps(y, _mm256_or_ps(half, neg)));
    const __m256i c = _mm256_max_epi32(_mm256_min_epi32(q, hi), lo);
    // int32 -> int16 -> int8 (in range, so the saturating packs only narrow), lanes in order
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    const __m128i b = _mm_packs_epi16(w, w);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), b);
  }
  for (; i < n; ++i) {
    const float y = x[i] * inv;
    const float q = static_cast<float>(static_cast<int32_t>(y + (y >= 0 ? 0.5f : -0.5f)));
    out[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
  }
}

namespace {
// 3-bit codes: each 8 codes (8 bytes) to 3 bytes with pext, which gathers every byte's low three
// bits into 24 contiguous bits, LSB first as PackBits lays them out.
__attribute__((target("bmi2"))) size_t Pack3Bmi2(const uint8_t* codes, size_t n, uint8_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    std::memcpy(&x, codes + i, 8);
    const uint32_t packed = static_cast<uint32_t>(_pext_u64(x, 0x0707070707070707ull));
    std::memcpy(out + i / 8 * 3, &packed, 3);
  }
  return i;
}
}  // namespace

STRATA_CODEC_AVX2 void PackBitsAvx2(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  if (bits == 3 && GetCpuFeatures().fast_pext) {
    const size_t i = Pack3Bmi2(codes, n, out);
    PackBits(codes + i, n - i, bits, out + i / 8 * 3);
    return;
  }
  if (bits != 2 && bits != 4) {
    PackBits(codes, n, bits, out);
    return;
  }
  size_t i = 0;
  if (bits == 4) {
    // 64 codes to 32 bytes: c0 + 16 c1 per pair.
    const __m256i w = _mm256_set1_epi16(0x1001);
    for (; i + 64 <= n; i += 64) {
      const __m256i a =
          _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)), w);
      const __m256i b = _mm256_maddubs_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i + 32)), w);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i / 2),
                          _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xd8));
    }
  } else {
    // 128 codes to 32 bytes: c0 + 4 c1 per pair, then u0 + 16 u1 per pair of pairs.
    const __m256i w = _mm256_set1_epi16(0x0401), w2 = _mm256_set1_epi32(0x00100001);
    for (; i + 128 <= n; i += 128) {
      __m256i q[4];
      for (int u = 0; u < 4; ++u) {
        const __m256i pairs = _mm256_maddubs_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i + 32 * u)), w);
        q[u] = _mm256_madd_epi16(pairs, w2);  // 8 bytes' worth, one per int32
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i / 4), PackBytes(q));
    }
  }
  PackBits(codes + i, n - i, bits, out + i * bits / 8);
}

namespace {

// Rows of an 8x8 block to its columns: on return v[c] lane k = the block's row k, column c.
STRATA_CODEC_AVX2 inline void Transpose8x8(__m256* v) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  v[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  v[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  v[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  v[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  v[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  v[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  v[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

}  // namespace

STRATA_CODEC_AVX2 void PermuteRowsAvx2(float* x, uint32_t rows, uint32_t d, const uint16_t* perm) {
  thread_local std::vector<float> tile;
  tile.resize(size_t{d} * 8);
  uint32_t r = 0;
  if (d % 8 == 0) {
    // Eight rows at a time through a channel-major tile ([d][8]): an 8x8 transpose in, then
    // the channels in the new order, eight at a time, transposed back into the rows: shuffles
    // in place of a gather per eight channels and a copy of the row.
    for (; r + 8 <= rows; r += 8) {
      float* const rows8 = x + size_t{r} * d;
      for (uint32_t c = 0; c < d; c += 8) {
        __m256 v[8];
        for (uint32_t k = 0; k < 8; ++k) v[k] = _mm256_loadu_ps(rows8 + size_t{k} * d + c);
        Transpose8x8(v);
        for (uint32_t k = 0; k < 8; ++k) _mm256_storeu_ps(&tile[(c + k) * 8], v[k]);
      }
      for (uint32_t i = 0; i < d; i += 8) {
        __m256 v[8];
        for (uint32_t k = 0; k < 8; ++k) v[k] = _mm256_loadu_ps(&tile[size_t{perm[i + k]} * 8]);
        Transpose8x8(v);
        for (uint32_t k = 0; k < 8; ++k) _mm256_storeu_ps(rows8 + size_t{k} * d + i, v[k]);
      }
    }
  }
  for (; r < rows; ++r) {
    float* const row = x + size_t{r} * d;
    GatherAvx2(row, perm, d, tile.data());
    std::copy(tile.begin(), tile.begin() + d, row);
  }
}

STRATA_CODEC_AVX2 bool HalfToFloatPermutedWithinAvx2(const uint16_t* src, size_t src_stride,
                                                     uint32_t d, const uint16_t* perm, float limit,
                                                     float* dst) {
  thread_local std::vector<float> tile;
  tile.resize(size_t{d} * 8);
  const __m256 vl = _mm256_set1_ps(limit),
               abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  // PermuteRowsAvx2's channel-major tile, filled straight from the fp16 rows: the rows are
  // widened, checked and transposed in one pass and written once, in the new order.
  for (uint32_t c = 0; c < d; c += 8) {
    __m256 v[8];
    for (uint32_t k = 0; k < 8; ++k) {
      v[k] = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * src_stride + c)));
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(v[k], abs_mask), vl, _CMP_LE_OQ));
    }
    Transpose8x8(v);
    for (uint32_t k = 0; k < 8; ++k) _mm256_storeu_ps(&tile[(c + k) * 8], v[k]);
  }
  if (_mm256_movemask_ps(ok) != 0xff) return false;
  for (uint32_t i = 0; i < d; i += 8) {
    __m256 v[8];
    for (uint32_t k = 0; k < 8; ++k) v[k] = _mm256_loadu_ps(&tile[size_t{perm[i + k]} * 8]);
    Transpose8x8(v);
    for (uint32_t k = 0; k < 8; ++k) _mm256_storeu_ps(dst + size_t{k} * d + i, v[k]);
  }
  return true;
}

STRATA_CODEC_AVX2 void TransposeAvx2(const float* src, size_t src_stride, uint32_t rows,
                                     uint32_t cols, float* dst, size_t dst_stride) {
  uint32_t r = 0;
  for (; r + 8 <= rows; r += 8) {
    uint32_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      __m256 v[8];
      for (uint32_t k = 0; k < 8; ++k) v[k] = _mm256_loadu_ps(src + (r + k) * src_stride + c);
      Transpose8x8(v);
      for (uint32_t k = 0; k < 8; ++k) _mm256_storeu_ps(dst + (c + k) * dst_stride + r, v[k]);
    }
    for (; c < cols; ++c) {
      for (uint32_t k = 0; k < 8; ++k) dst[c * dst_stride + r + k] = src[(r + k) * src_stride + c];
    }
  }
  for (; r < rows; ++r) {
    for (uint32_t c = 0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
}

__attribute__((target("avx2,fma,f16c"))) void ProbeWeightsAvx2(const float* dots, uint32_t n,
                                                               float scale, float* p) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vm = _mm256_set1_ps(-INFINITY);
  uint32_t t = 0;
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_mul_ps(_mm256_loadu_ps(dots + t), vs));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  for (; t < n; ++t) mx = std::max(mx, dots[t] * scale);
  const __m256 m = _mm256_set1_ps(mx);
  for (t = 0; t + 8 <= n; t += 8) {
    _mm256_storeu_ps(p + t,
                     ExpAvx2(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(dots + t), vs), m)));
  }
  for (; t < n; ++t) p[t] = ExpScalar(dots[t] * scale - mx);
}

namespace {

// Both of GEAR's products are out[j][x] = sum_k w[k * wk + j * wj] * m[k][x] (k ascending from
// +0, multiply then add), m's and out's rows `width` floats apart: R B from R^T (k a column of
// R, x a row) and R^T A from R (k a row, x a column). This takes kJ weight columns and kV * 8
// columns x from x0: kV * kJ sums at once, each one chain in k order, and no shuffles.
template <uint32_t kJ, uint32_t kV>
STRATA_CODEC_AVX2 inline void WeightedRows(const float* m, uint32_t n, uint32_t width,
                                           const float* w, size_t wk, size_t wj, uint32_t x0,
                                           float* out) {
  __m256 acc[kV][kJ];
  for (uint32_t u = 0; u < kV; ++u) {
    for (uint32_t j = 0; j < kJ; ++j) acc[u][j] = _mm256_setzero_ps();
  }
  for (uint32_t k = 0; k < n; ++k) {
    const float* wrow = w + k * wk;
    for (uint32_t u = 0; u < kV; ++u) {
      const __m256 v = _mm256_loadu_ps(m + size_t{k} * width + x0 + 8 * u);
      for (uint32_t j = 0; j < kJ; ++j) {
        acc[u][j] = _mm256_add_ps(acc[u][j], _mm256_mul_ps(_mm256_broadcast_ss(wrow + j * wj), v));
      }
    }
  }
  for (uint32_t u = 0; u < kV; ++u) {
    for (uint32_t j = 0; j < kJ; ++j) _mm256_storeu_ps(out + j * width + x0 + 8 * u, acc[u][j]);
  }
}
// Vectors at once for kJ weight columns: about eight accumulators (at rank 2, one vector gave
// two chains, bound by the additions' latency).
constexpr uint32_t ProductVectors(uint32_t kJ) { return kJ <= 2 ? 4 : kJ <= 4 ? 2 : 1; }

// Calls F<kJ>(args...) for kJ = n in [1, 8].
template <template <uint32_t> class F, typename... Args>
STRATA_CODEC_AVX2 inline void ByCount(uint32_t n, Args... args) {
  switch (n) {
    case 1:
      return F<1>::Run(args...);
    case 2:
      return F<2>::Run(args...);
    case 3:
      return F<3>::Run(args...);
    case 4:
      return F<4>::Run(args...);
    case 5:
      return F<5>::Run(args...);
    case 6:
      return F<6>::Run(args...);
    case 7:
      return F<7>::Run(args...);
    default:
      return F<8>::Run(args...);
  }
}
template <uint32_t kJ>
struct WeightedRowsOp {
  // Columns [0, x1) (a multiple of 8): ProductVectors(kJ) vectors at a time, then one.
  STRATA_CODEC_AVX2 static void Run(const float* m, uint32_t n, uint32_t width, const float* w,
                                    size_t wk, size_t wj, uint32_t x1, float* out) {
    constexpr uint32_t kV = ProductVectors(kJ);
    uint32_t x0 = 0;
    for (; x0 + 8 * kV <= x1; x0 += 8 * kV) WeightedRows<kJ, kV>(m, n, width, w, wk, wj, x0, out);
    for (; x0 + 8 <= x1; x0 += 8) WeightedRows<kJ, 1>(m, n, width, w, wk, wj, x0, out);
  }
};

// out [count, width] as WeightedRows, for every weight column and every x.
STRATA_CODEC_AVX2 void WeightedRowSums(const float* m, uint32_t n, uint32_t width, const float* w,
                                       size_t wk, size_t wj, uint32_t count, float* out) {
  const uint32_t whole = width / 8 * 8;
  for (uint32_t j0 = 0; j0 < count; j0 += 8) {
    ByCount<WeightedRowsOp>(std::min<uint32_t>(8, count - j0), m, n, width, w + j0 * wj, wk, wj,
                            whole, out + size_t{j0} * width);
  }
  for (uint32_t x = whole; x < width; ++x) {
    for (uint32_t j = 0; j < count; ++j) {
      float sum = 0.0f;
      for (uint32_t k = 0; k < n; ++k) sum += w[k * wk + j * wj] * m[size_t{k} * width + x];
      out[size_t{j} * width + x] = sum;
    }
  }
}

}  // namespace

namespace {
// ProbeDotsAvx2 for kV vectors of eight tokens from t and the query heads [g0, g0 + kG): one
// fused multiply-add chain per token and head, d ascending.
template <uint32_t kV, uint32_t kG>
__attribute__((target("avx2,fma,f16c"))) STRATA_FORCE_INLINE inline void ProbeTile(
    const float* kt, uint32_t T, uint32_t D, const float* q, uint32_t g0, uint32_t t, float* out) {
  __m256 acc[kG][kV];
  for (uint32_t g = 0; g < kG; ++g) {
    for (uint32_t v = 0; v < kV; ++v) acc[g][v] = _mm256_setzero_ps();
  }
  for (uint32_t d = 0; d < D; ++d) {
    __m256 k[kV];
    for (uint32_t v = 0; v < kV; ++v) k[v] = _mm256_loadu_ps(kt + size_t{d} * T + t + 8 * v);
    for (uint32_t g = 0; g < kG; ++g) {
      const __m256 qv = _mm256_broadcast_ss(q + size_t{g0 + g} * D + d);
      for (uint32_t v = 0; v < kV; ++v) acc[g][v] = _mm256_fmadd_ps(qv, k[v], acc[g][v]);
    }
  }
  for (uint32_t g = 0; g < kG; ++g) {
    for (uint32_t v = 0; v < kV; ++v) {
      _mm256_storeu_ps(out + size_t{g0 + g} * T + t + 8 * v, acc[g][v]);
    }
  }
}
}  // namespace

__attribute__((target("avx2,fma,f16c"))) void ProbeDotsAvx2(const float* kt, uint32_t T, uint32_t D,
                                                            const float* q, uint32_t G, uint32_t n,
                                                            float* out) {
  uint32_t g0 = 0;
  // Four heads by 16 tokens: eight independent chains hide the FMA latency.
  for (; g0 + 4 <= G; g0 += 4) {
    uint32_t t = 0;
    for (; t + 16 <= n; t += 16) ProbeTile<2, 4>(kt, T, D, q, g0, t, out);
    for (; t + 8 <= n; t += 8) ProbeTile<1, 4>(kt, T, D, q, g0, t, out);
  }
  for (; g0 < G; ++g0) {
    uint32_t t = 0;
    for (; t + 16 <= n; t += 16) ProbeTile<2, 1>(kt, T, D, q, g0, t, out);
    for (; t + 8 <= n; t += 8) ProbeTile<1, 1>(kt, T, D, q, g0, t, out);
  }
  for (uint32_t g = 0; g < G; ++g) {  // the tokens past the last whole vector
    for (uint32_t t = n / 8 * 8; t < n; ++t) {
      float dot = 0.0f;
      for (uint32_t d = 0; d < D; ++d)
        dot = std::fma(q[size_t{g} * D + d], kt[size_t{d} * T + t], dot);
      out[size_t{g} * T + t] = dot;
    }
  }
}

STRATA_CODEC_AVX2 void LowRankRbAvx2(const float* rt, uint32_t rows, uint32_t cols, const float* bt,
                                     uint32_t rank, float* at) {
  WeightedRowSums(rt, cols, rows, bt, 1, cols, rank, at);
}

STRATA_CODEC_AVX2 void LowRankRtaAvx2(const float* r, uint32_t rows, uint32_t cols, const float* a,
                                      uint32_t rank, float* bt) {
  WeightedRowSums(r, rows, cols, a, rank, 1, rank, bt);
}

namespace {

// Offers x to per-lane lists of the kK largest values (top, descending) and the kK smallest
// (bot, ascending): a branch-free insertion network, each new entry from the old ones.
template <uint32_t kK>
STRATA_CODEC_AVX2 inline void InsertExtremes(__m256 x, __m256* top, __m256* bot) {
  for (uint32_t j = kK - 1; j > 0; --j) {
    top[j] = _mm256_max_ps(top[j], _mm256_min_ps(top[j - 1], x));
    bot[j] = _mm256_min_ps(bot[j], _mm256_max_ps(bot[j - 1], x));
  }
  top[0] = _mm256_max_ps(top[0], x);
  bot[0] = _mm256_min_ps(bot[0], x);
}

template <uint32_t kK>
struct ColumnExtremesOp {
  STRATA_CODEC_AVX2 static void Run(const float* rows, uint32_t n, uint32_t D, float* lo,
                                    float* hi) {
    for (uint32_t c = 0; c < D; c += 8) {
      __m256 top[kK], bot[kK];
      for (uint32_t j = 0; j < kK; ++j) {
        top[j] = _mm256_set1_ps(-INFINITY);
        bot[j] = _mm256_set1_ps(INFINITY);
      }
      for (uint32_t t = 0; t < n; ++t) {
        InsertExtremes<kK>(_mm256_loadu_ps(rows + size_t{t} * D + c), top, bot);
      }
      _mm256_storeu_ps(lo + c, bot[kK - 1]);
      _mm256_storeu_ps(hi + c, top[kK - 1]);
    }
  }
};

template <uint32_t kK>
struct RowExtremesOp {
  STRATA_CODEC_AVX2 static void Run(const float* row, uint32_t D, float* lo, float* hi) {
    __m256 top[kK], bot[kK];
    for (uint32_t j = 0; j < kK; ++j) {
      top[j] = _mm256_set1_ps(-INFINITY);
      bot[j] = _mm256_set1_ps(INFINITY);
    }
    for (uint32_t d = 0; d < D; d += 8) InsertExtremes<kK>(_mm256_loadu_ps(row + d), top, bot);
    // The row's k-th largest is the k-th largest of the lanes' lists together.
    alignas(32) float t[8 * kK], b[8 * kK];
    for (uint32_t j = 0; j < kK; ++j) {
      _mm256_store_ps(t + 8 * j, top[j]);
      _mm256_store_ps(b + 8 * j, bot[j]);
    }
    if constexpr (kK == 1) {
      *hi = *std::max_element(t, t + 8);
      *lo = *std::min_element(b, b + 8);
    } else {
      std::nth_element(t, t + kK - 1, t + 8 * kK, std::greater<float>());
      std::nth_element(b, b + kK - 1, b + 8 * kK);
      *hi = t[kK - 1];
      *lo = b[kK - 1];
    }
  }
};

}  // namespace

STRATA_CODEC_AVX2 void ColumnExtremesAvx2(const float* rows, uint32_t n, uint32_t D, uint32_t k,
                                          float* lo, float* hi) {
  ByCount<ColumnExtremesOp>(k, rows, n, D, lo, hi);
}

STRATA_CODEC_AVX2 void RowExtremesAvx2(const float* row, uint32_t D, uint32_t k, float* lo,
                                       float* hi) {
  ByCount<RowExtremesOp>(k, row, D, lo, hi);
}

STRATA_CODEC_AVX2 void NearestCentroidsAvx2(const float* points, size_t n, size_t stride,
                                            const float* ct, const float* norm, uint32_t K,
                                            uint32_t C, uint8_t* codes, size_t out_stride) {
  __m256 m[8];
  for (size_t i = 0; i < n; ++i) {
    const float* p = points + i * stride;
    for (uint32_t d = 0; d < C; ++d) m[d] = _mm256_set1_ps(-2.0f * p[d]);
    __m256 best = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256i best_j = _mm256_setzero_si256();
    __m256i j8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i eight = _mm256_set1_epi32(8);
    for (uint32_t j = 0; j < K; j += 8) {
      __m256 s = _mm256_loadu_ps(norm + j);
      for (uint32_t d = 0; d < C; ++d) {
        s = _mm256_add_ps(s, _mm256_mul_ps(m[d], _mm256_loadu_ps(ct + size_t{d} * K + j)));
      }
      const __m256 less = _mm256_cmp_ps(s, best, _CMP_LT_OQ);
      best = _mm256_blendv_ps(best, s, less);
      best_j = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_j), _mm256_castsi256_ps(j8), less));
      j8 = _mm256_add_epi32(j8, eight);
    }
    // Each lane holds the first of its least scores: the least of them, the lowest j on a tie.
    alignas(32) float v[8];
    alignas(32) int32_t at[8];
    _mm256_store_ps(v, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(at), best_j);
    int32_t code = at[0];
    float least = v[0];
    for (int l = 1; l < 8; ++l) {
      if (v[l] < least || (v[l] == least && at[l] < code)) {
        least = v[l];
        code = at[l];
      }
    }
    codes[i * out_stride] = static_cast<uint8_t>(code);
  }
}

}  // namespace strata::kernels::internal
