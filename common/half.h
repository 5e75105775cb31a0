// IEEE 754 binary16 ("half") and bfloat16 storage types with exact conversions to and from
// float. Narrowing conversions round to nearest, ties to even; overflow goes to infinity; NaN
// stays NaN (quiet, sign kept). Widening conversions are exact.
//
// The scalar functions are constexpr and header-only so kernels can inline them. The array
// functions use F16C where the CPU has it (runtime dispatch) and give bit-identical results.
// Thread safety: all functions are pure.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace strata {

constexpr float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) {  // Inf, or NaN made quiet (as F16C's vcvtph2ps does)
    return std::bit_cast<float>(sign | 0x7f800000u | (man != 0 ? 0x400000u : 0u) | (man << 13));
  }
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(man) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

constexpr uint16_t FloatToHalfBits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN; a NaN keeps its top payload bits and becomes quiet.
    if (abs > 0x7f800000u) return sign | 0x7e00u | ((abs >> 13) & 0x3ffu);
    return sign | 0x7c00u;
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity.
  if (abs < 0x38800000u) {                        // Below 2^-14: half subnormal or zero.
    if (abs <= 0x33000000u) return sign;          // <= 2^-25 rounds to zero (tie to even).
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // value / 2^-24 == man >> shift
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // may carry into the smallest normal
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t h = (abs - 0x38000000u) >> 13;  // rebias exponent 127 -> 15, keep 10 mantissa bits
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
  return static_cast<uint16_t>(sign | h);
}

constexpr float BFloat16BitsToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

constexpr uint16_t FloatToBFloat16Bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  const uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding_bias) >> 16);
}

// 16-bit storage types. Arithmetic happens in float: convert, compute, convert back.
struct Half {
  uint16_t bits = 0;
  static constexpr Half FromBits(uint16_t b) { return Half{b}; }
  static constexpr Half FromFloat(float f) { return Half{FloatToHalfBits(f)}; }
  constexpr float ToFloat() const { return HalfBitsToFloat(bits); }
};

struct BFloat16 {
  uint16_t bits = 0;
  static constexpr BFloat16 FromBits(uint16_t b) { return BFloat16{b}; }
  static constexpr BFloat16 FromFloat(float f) { return BFloat16{FloatToBFloat16Bits(f)}; }
  constexpr float ToFloat() const { return BFloat16BitsToFloat(bits); }
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);

// Array conversions; src and dst must not overlap. Bit-identical to the scalar functions.
void HalfToFloat(const Half* src, float* dst, size_t n);
void FloatToHalf(const float* src, Half* dst, size_t n);
void BFloat16ToFloat(const BFloat16* src, float* dst, size_t n);
void FloatToBFloat16(const float* src, BFloat16* dst, size_t n);

// True when the array conversions use the CPU's F16C instructions.
bool HalfConversionUsesF16C();

}  // namespace strata
