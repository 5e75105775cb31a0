// exp(x) for x <= 0 (softmax arguments) in 8 float lanes with AVX2+FMA, and the same steps on one
// float: Cephes-style 2^n * P(r) with x = n ln2 + r, relative error ~2e-7, exactly 0 below -87.3
// (and for -inf). ExpScalar is ExpAvx2 lane for lane, bit for bit (each fused multiply-add a
// std::fma), so a vector loop and its portable twin agree exactly.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/internal/force_inline.h"

namespace strata::kernels::internal {

__attribute__((target("avx2,fma"))) STRATA_FORCE_INLINE inline __m256 ExpAvx2(__m256 x) {
  const __m256 visible = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);  // -inf -> 0
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(n)), visible);
}

inline float ExpScalar(float x) {
  if (!(x >= -87.3f)) return 0.0f;  // below the range, -inf and NaN (as the vector's mask)
  const float fx = std::nearbyint(x * 1.44269504088896341f);  // to nearest even
  float r = std::fma(-fx, 0.693359375f, x);
  r = std::fma(-fx, -2.12194440e-4f, r);
  float y = 1.9875691500e-4f;
  y = std::fma(y, r, 1.3981999507e-3f);
  y = std::fma(y, r, 8.3334519073e-3f);
  y = std::fma(y, r, 4.1665795894e-2f);
  y = std::fma(y, r, 1.6666665459e-1f);
  y = std::fma(y, r, 5.0000001201e-1f);
  const float rr = r * r, r1 = r + 1.0f;
  y = std::fma(y, rr, r1);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

}  // namespace strata::kernels::internal
