#include "common/half.h"

#include <immintrin.h>

#include "common/cpu_features.h"

namespace strata {
namespace {

// F16C's conversions are IEEE round-to-nearest-even with the same NaN quieting as the scalar
// code, so both paths produce identical bits (half_test.cc checks every input class).
__attribute__((target("avx,f16c"))) void HalfToFloatF16C(const Half* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = src[i].ToFloat();
}

__attribute__((target("avx,f16c"))) void FloatToHalfF16C(const float* src, Half* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = Half::FromFloat(src[i]);
}

const bool kHaveF16C = GetCpuFeatures().f16c;

}  // namespace

bool HalfConversionUsesF16C() { return kHaveF16C; }

void HalfToFloat(const Half* src, float* dst, size_t n) {
  if (kHaveF16C) return HalfToFloatF16C(src, dst, n);
  for (size_t i = 0; i < n; ++i) dst[i] = src[i].ToFloat();
}

void FloatToHalf(const float* src, Half* dst, size_t n) {
  if (kHaveF16C) return FloatToHalfF16C(src, dst, n);
  for (size_t i = 0; i < n; ++i) dst[i] = Half::FromFloat(src[i]);
}

void BFloat16ToFloat(const BFloat16* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = src[i].ToFloat();  // a shift; compilers vectorize it
}

void FloatToBFloat16(const float* src, BFloat16* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = BFloat16::FromFloat(src[i]);
}

}  // namespace strata
