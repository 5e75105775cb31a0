// Internal to kernels/: the 512-bit operations of the integer attention kernels' zmm paths
// (internal/integer_dot.inc with STRATA_INT8_ZMM), twice with the same names and meaning:
//   zmm_native    AVX-512 (F, BW, VNNI) instructions on zmm registers;
//   zmm_emulated  the same results exactly, on a pair of AVX2 registers (lanes 0-7 in lo, 8-15
//                 in hi), so that machines without AVX-512 run the zmm kernels' code and test it
//                 bit for bit (IntegerIsa::kEmulatedZmm). zmm_ops_test holds each one to SIMDe's
//                 emulation of the instruction, and to the instruction where the CPU has it.
// Lanes are int32 unless named otherwise; a "quarter" is a 128-bit lane.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/internal/force_inline.h"

namespace strata::kernels::internal {

#define STRATA_ZMM_AVX2 __attribute__((target("avx2,fma,f16c"))) STRATA_FORCE_INLINE inline
#define STRATA_ZMM_AVX512                                                       \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) \
  STRATA_FORCE_INLINE inline

// vpdpbusd's sum on 256 bits, exactly, in AVX2: acc + per int32 lane the four products of u8 a
// and s8 b bytes. The even and the odd bytes as int16 (u8 a, s8 b): each vpmaddwd lane is two
// products of at most 255 * 128 (no saturation), and the int32 sums wrap as vpdpbusd's.
STRATA_ZMM_AVX2 __m256i EmulatedDpbusd(__m256i acc, __m256i a, __m256i b) {
  const __m256i low = _mm256_set1_epi16(0x00ff);
  const __m256i even =
      _mm256_madd_epi16(_mm256_and_si256(a, low), _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8));
  const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(a, 8), _mm256_srai_epi16(b, 8));
  return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
}

// vpdpwssd's sum on 256 bits: acc + per int32 lane the two products of int16 pairs (vpmaddwd's
// one overflow, both products -32768 * -32768, wraps as vpdpwssd's).
STRATA_ZMM_AVX2 __m256i EmulatedDpwssd(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

namespace zmm_native {

using Zi = __m512i;

STRATA_ZMM_AVX512 Zi Zero() { return _mm512_setzero_si512(); }
STRATA_ZMM_AVX512 Zi Set1Epi8(char c) { return _mm512_set1_epi8(c); }
STRATA_ZMM_AVX512 Zi Set1Epi64(int64_t x) { return _mm512_set1_epi64(x); }
STRATA_ZMM_AVX512 Zi Load(const void* p) { return _mm512_loadu_si512(p); }
STRATA_ZMM_AVX512 Zi And(Zi a, Zi b) { return _mm512_and_si512(a, b); }
STRATA_ZMM_AVX512 Zi Add32(Zi a, Zi b) { return _mm512_add_epi32(a, b); }
// Each int16 lane shifted right by kN (logical).
template <int kN>
STRATA_ZMM_AVX512 Zi Srli16(Zi a) {
  return _mm512_srli_epi16(a, kN);
}
// Each int32 lane shifted left by kN.
template <int kN>
STRATA_ZMM_AVX512 Zi Slli32(Zi a) {
  return _mm512_slli_epi32(a, kN);
}
// vpdpbusd, vpdpwssd.
STRATA_ZMM_AVX512 Zi Dpbusd(Zi acc, Zi a, Zi b) { return _mm512_dpbusd_epi32(acc, a, b); }
STRATA_ZMM_AVX512 Zi Dpwssd(Zi acc, Zi a, Zi b) { return _mm512_dpwssd_epi32(acc, a, b); }
// Per quarter: unpack of the int32 lanes (low or high two of each), or of the int64 ones.
STRATA_ZMM_AVX512 Zi UnpackLo32(Zi a, Zi b) { return _mm512_unpacklo_epi32(a, b); }
STRATA_ZMM_AVX512 Zi UnpackHi32(Zi a, Zi b) { return _mm512_unpackhi_epi32(a, b); }
STRATA_ZMM_AVX512 Zi UnpackLo64(Zi a, Zi b) { return _mm512_unpacklo_epi64(a, b); }
STRATA_ZMM_AVX512 Zi UnpackHi64(Zi a, Zi b) { return _mm512_unpackhi_epi64(a, b); }
// The quarters in the order 1 0 3 2, and 2 3 0 1.
STRATA_ZMM_AVX512 Zi SwapAdjacentQuarters(Zi a) { return _mm512_shuffle_i32x4(a, a, 0xb1); }
STRATA_ZMM_AVX512 Zi SwapHalves(Zi a) { return _mm512_shuffle_i32x4(a, a, 0x4e); }
// Quarter q (0-3).
STRATA_ZMM_AVX512 __m128i Quarter(Zi a, uint32_t q) {
  switch (q) {
    case 0:
      return _mm512_castsi512_si128(a);
    case 1:
      return _mm512_extracti32x4_epi32(a, 1);
    case 2:
      return _mm512_extracti32x4_epi32(a, 2);
    default:
      return _mm512_extracti32x4_epi32(a, 3);
  }
}
// The 32 bytes lo, hi as int16 lanes, sign-extended.
STRATA_ZMM_AVX512 Zi WidenBytes(__m128i lo, __m128i hi) {
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(hi, lo));
}
// Lane m (0-7) = lanes 2m + 2m + 1 of a (wrapping).
STRATA_ZMM_AVX512 __m256i PairLaneSums(Zi a) {
  return _mm512_cvtepi64_epi32(_mm512_add_epi32(a, _mm512_srli_epi64(a, 32)));
}

}  // namespace zmm_native

namespace zmm_emulated {

struct Zi {
  __m256i lo, hi;  // lanes 0-7 (quarters 0, 1) and 8-15 (quarters 2, 3)
};

STRATA_ZMM_AVX2 Zi Zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
STRATA_ZMM_AVX2 Zi Set1Epi8(char c) { return {_mm256_set1_epi8(c), _mm256_set1_epi8(c)}; }
STRATA_ZMM_AVX2 Zi Set1Epi64(int64_t x) { return {_mm256_set1_epi64x(x), _mm256_set1_epi64x(x)}; }
STRATA_ZMM_AVX2 Zi Load(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
STRATA_ZMM_AVX2 Zi And(Zi a, Zi b) {
  return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
STRATA_ZMM_AVX2 Zi Add32(Zi a, Zi b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
template <int kN>
STRATA_ZMM_AVX2 Zi Srli16(Zi a) {
  return {_mm256_srli_epi16(a.lo, kN), _mm256_srli_epi16(a.hi, kN)};
}
template <int kN>
STRATA_ZMM_AVX2 Zi Slli32(Zi a) {
  return {_mm256_slli_epi32(a.lo, kN), _mm256_slli_epi32(a.hi, kN)};
}
STRATA_ZMM_AVX2 Zi Dpbusd(Zi acc, Zi a, Zi b) {
  return {EmulatedDpbusd(acc.lo, a.lo, b.lo), EmulatedDpbusd(acc.hi, a.hi, b.hi)};
}
STRATA_ZMM_AVX2 Zi Dpwssd(Zi acc, Zi a, Zi b) {
  return {EmulatedDpwssd(acc.lo, a.lo, b.lo), EmulatedDpwssd(acc.hi, a.hi, b.hi)};
}
// (AVX2's unpacks work per quarter too.)
STRATA_ZMM_AVX2 Zi UnpackLo32(Zi a, Zi b) {
  return {_mm256_unpacklo_epi32(a.lo, b.lo), _mm256_unpacklo_epi32(a.hi, b.hi)};
}
STRATA_ZMM_AVX2 Zi UnpackHi32(Zi a, Zi b) {
  return {_mm256_unpackhi_epi32(a.lo, b.lo), _mm256_unpackhi_epi32(a.hi, b.hi)};
}
STRATA_ZMM_AVX2 Zi UnpackLo64(Zi a, Zi b) {
  return {_mm256_unpacklo_epi64(a.lo, b.lo), _mm256_unpacklo_epi64(a.hi, b.hi)};
}
STRATA_ZMM_AVX2 Zi UnpackHi64(Zi a, Zi b) {
  return {_mm256_unpackhi_epi64(a.lo, b.lo), _mm256_unpackhi_epi64(a.hi, b.hi)};
}
STRATA_ZMM_AVX2 Zi SwapAdjacentQuarters(Zi a) {
  return {_mm256_permute2x128_si256(a.lo, a.lo, 0x01), _mm256_permute2x128_si256(a.hi, a.hi, 0x01)};
}
STRATA_ZMM_AVX2 Zi SwapHalves(Zi a) { return {a.hi, a.lo}; }
STRATA_ZMM_AVX2 __m128i Quarter(Zi a, uint32_t q) {
  switch (q) {
    case 0:
      return _mm256_castsi256_si128(a.lo);
    case 1:
      return _mm256_extracti128_si256(a.lo, 1);
    case 2:
      return _mm256_castsi256_si128(a.hi);
    default:
      return _mm256_extracti128_si256(a.hi, 1);
  }
}
STRATA_ZMM_AVX2 Zi WidenBytes(__m128i lo, __m128i hi) {
  return {_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)};
}
STRATA_ZMM_AVX2 __m256i PairLaneSums(Zi a) {
  // Per quarter of the result: [lo's pair sums, hi's pair sums]; then in lane order.
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a.lo, a.hi), 0xd8);
}

}  // namespace zmm_emulated

#undef STRATA_ZMM_AVX2
#undef STRATA_ZMM_AVX512

}  // namespace strata::kernels::internal
