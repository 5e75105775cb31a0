// FP8 E4M3 (the "fn" variant used by NVIDIA and vLLM: 1 sign, 4 exponent bits with bias 7, 3
// mantissa bits, no infinities, NaN = S.1111.111, largest finite 448). Narrowing rounds to
// nearest, ties to even, and saturates to +-448; NaN stays NaN. Widening is exact.
#pragma once

#include <bit>
#include <cstdint>

namespace strata {

inline constexpr float kFp8E4M3Max = 448.0f;

constexpr float Fp8E4M3ToFloat(uint8_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t exp = (x >> 3) & 0xfu;
  const uint32_t man = x & 0x7u;
  if (exp == 0xf && man == 0x7) return std::bit_cast<float>(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {  // zero or subnormal: man * 2^-9, exact in float
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(static_cast<float>(man) * 0x1p-9f));
  }
  return std::bit_cast<float>(sign | ((exp + 120u) << 23) | (man << 20));
}

constexpr uint8_t FloatToFp8E4M3(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (abs >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and Inf) saturates to 448
  if (abs < 0x3c800000u) {                      // below 2^-6: subnormal or zero
    if (abs <= 0x3a800000u) return sign;        // <= 2^-10 rounds to zero (tie to even)
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - exp;  // value / 2^-9 == man >> shift
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint8_t>(sign | q);
  }
  uint32_t r = (abs - 0x3c000000u) >> 20;  // rebias 127 -> 7, keep 3 mantissa bits
  const uint32_t rem = abs & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) ++r;
  if (r > 0x7eu) r = 0x7eu;  // rounding up past 448 saturates (0x7f would be NaN)
  return static_cast<uint8_t>(sign | r);
}

// The largest e4m3 value <= f (round toward -inf), saturating at -448; f must not be NaN.
constexpr uint8_t Fp8E4M3Floor(float f) {
  uint8_t c = FloatToFp8E4M3(f);
  if (Fp8E4M3ToFloat(c) <= f) return c;
  if (c == 0x00u) return 0x81u;                    // +0 -> the smallest negative subnormal
  if ((c & 0x80u) == 0) return c - 1;              // smaller positive
  return (c & 0x7fu) < 0x7eu ? c + 1 : c;          // larger negative magnitude
}

// The smallest e4m3 value >= f (round toward +inf), saturating at 448; f must not be NaN.
constexpr uint8_t Fp8E4M3Ceil(float f) {
  uint8_t c = FloatToFp8E4M3(f);
  if (Fp8E4M3ToFloat(c) >= f) return c;
  if (c == 0x80u) return 0x01u;                    // -0 -> the smallest positive subnormal
  if ((c & 0x80u) != 0) return c - 1;              // smaller negative magnitude
  return (c & 0x7fu) < 0x7eu ? c + 1 : c;          // larger positive
}

}  // namespace strata
