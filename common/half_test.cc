#include "common/half.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace strata {
namespace {

// Independent definition of a binary16 value, computed in double.
double HalfValue(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  if (exp == 0x1f) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(man, -24);
  return sign * std::ldexp(1024 + man, exp - 25);
}

double BFloat16Value(uint16_t b) {
  const int sign = (b >> 15) ? -1 : 1;
  const int exp = (b >> 7) & 0xff;
  const int man = b & 0x7f;
  if (exp == 0xff) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(man, -133);
  return sign * std::ldexp(128 + man, exp - 134);
}

// All finite non-negative encodings in increasing order, for the midpoint tests.
std::vector<uint16_t> PositiveFinite(uint16_t first_non_finite) {
  std::vector<uint16_t> v;
  for (uint32_t b = 0; b < first_non_finite; ++b) v.push_back(static_cast<uint16_t>(b));
  return v;
}

TEST(HalfTest, WideningIsExactForAll65536Values) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = HalfBitsToFloat(h);
    const double want = HalfValue(h);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << b;
      EXPECT_EQ(std::signbit(f), (b >> 15) != 0) << std::hex << b;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << std::hex << b;
      EXPECT_EQ(std::signbit(f), (b >> 15) != 0) << std::hex << b;  // keeps -0
    }
  }
}

TEST(HalfTest, RoundTripIsIdentityForAllNonNaN) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const uint16_t back = FloatToHalfBits(HalfBitsToFloat(h));
    if (std::isnan(HalfValue(h))) {
      EXPECT_EQ(back & 0x7c00, 0x7c00) << std::hex << b;
      EXPECT_NE(back & 0x3ff, 0) << std::hex << b;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << b;
    } else {
      EXPECT_EQ(back, h) << std::hex << b;
    }
  }
}

// For every pair of adjacent finite halves (and the pair max-finite / infinity), the exact
// midpoint rounds to the even one, and the floats just below/above it go to the nearer one.
TEST(HalfTest, NarrowingRoundsToNearestEvenAtEveryMidpoint) {
  const std::vector<uint16_t> pos = PositiveFinite(0x7c00);
  for (size_t i = 0; i < pos.size(); ++i) {
    const uint16_t lo = pos[i];
    const uint16_t hi = static_cast<uint16_t>(lo + 1);  // 0x7c00 (infinity) after the max
    const double mid_d = (HalfValue(lo) + (hi == 0x7c00 ? 65536.0 : HalfValue(hi))) / 2;
    const float mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d) << "midpoint must be exact in float";
    const uint16_t even = (lo & 1) ? hi : lo;
    for (int s = 0; s < 2; ++s) {
      const uint16_t sgn = s ? 0x8000 : 0;
      const float m = s ? -mid : mid;
      EXPECT_EQ(FloatToHalfBits(m), even | sgn) << std::hex << lo;
      EXPECT_EQ(FloatToHalfBits(std::nextafter(m, 0.0f)), lo | sgn) << std::hex << lo;
      EXPECT_EQ(FloatToHalfBits(std::nextafter(m, s ? -INFINITY : INFINITY)), hi | sgn)
          << std::hex << lo;
    }
  }
}

TEST(HalfTest, NarrowingEdgeCases) {
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(1e30f), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-1e30f), 0xfc00);
  EXPECT_EQ(FloatToHalfBits(INFINITY), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToHalfBits(0x1p-24f), 0x0001);
  EXPECT_EQ(FloatToHalfBits(0x1p-25f), 0x0000);         // tie to even (zero)
  EXPECT_EQ(FloatToHalfBits(0x1.000002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(FloatToHalfBits(0x1.ff8p-15f), 0x03ff);     // the largest subnormal
  EXPECT_EQ(FloatToHalfBits(0x1.ffcp-15f), 0x0400);     // its tie carries into the normals
  const uint16_t nan = FloatToHalfBits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7e00, 0x7e00);
  // A signalling NaN whose payload lies only in the dropped bits must stay NaN, not become Inf.
  const uint16_t snan = FloatToHalfBits(std::bit_cast<float>(0xff800001u));
  EXPECT_EQ(snan, 0xfe00);
}

// The GCC/libgcc _Float16 conversion is an independent implementation of the same rounding.
TEST(HalfTest, NarrowingMatchesCompilerFloat16OnRandomFloats) {
#if defined(__FLT16_MAX__)
  std::mt19937 rng(1234);
  for (int i = 0; i < 2'000'000; ++i) {
    uint32_t x = rng();
    // Half the samples near half's range so that rounding, not overflow, is exercised.
    if (i & 1) x = (x & 0x807fffffu) | ((100u + (rng() % 50u)) << 23);
    const float f = std::bit_cast<float>(x);
    if (std::isnan(f)) continue;
    const _Float16 g = static_cast<_Float16>(f);
    ASSERT_EQ(FloatToHalfBits(f), std::bit_cast<uint16_t>(g)) << std::hex << x;
  }
#else
  GTEST_SKIP() << "compiler has no _Float16";
#endif
}

TEST(BFloat16Test, WideningIsExactForAll65536Values) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = BFloat16BitsToFloat(static_cast<uint16_t>(b));
    const double want = BFloat16Value(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << b;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << std::hex << b;
    }
    const uint16_t back = FloatToBFloat16Bits(f);
    if (std::isnan(want)) {
      EXPECT_EQ(back & 0x7f80, 0x7f80);
      EXPECT_EQ(back & 0x8000, b & 0x8000);
      EXPECT_NE(back & 0x7f, 0);
    } else {
      EXPECT_EQ(back, b) << std::hex << b;
    }
  }
}

TEST(BFloat16Test, NarrowingRoundsToNearestEvenAtEveryMidpoint) {
  const std::vector<uint16_t> pos = PositiveFinite(0x7f80);
  for (uint16_t lo : pos) {
    const uint16_t hi = static_cast<uint16_t>(lo + 1);
    // The midpoint has one more mantissa bit than bfloat16: exact in float.
    const uint32_t mid_bits = (static_cast<uint32_t>(lo) << 16) | 0x8000u;
    const float mid = std::bit_cast<float>(mid_bits);
    const uint16_t even = (lo & 1) ? hi : lo;
    EXPECT_EQ(FloatToBFloat16Bits(mid), even) << std::hex << lo;
    EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(mid_bits - 1)), lo) << std::hex << lo;
    EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(mid_bits + 1)), hi) << std::hex << lo;
    EXPECT_EQ(FloatToBFloat16Bits(-mid), even | 0x8000) << std::hex << lo;
  }
  EXPECT_EQ(FloatToBFloat16Bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds to Inf
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x7f800001u)) & 0x7fc0, 0x7fc0);
}

TEST(HalfArrayTest, ArrayConversionsMatchScalarOnEveryValue) {
  // Odd length so the vector loop's tail runs too.
  std::vector<Half> all(65536 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = Half::FromBits(static_cast<uint16_t>(i));
  std::vector<float> f(all.size());
  HalfToFloat(all.data(), f.data(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(f[i]), std::bit_cast<uint32_t>(all[i].ToFloat())) << i;
  }
  std::mt19937 rng(7);
  std::vector<float> src(100'003);
  for (float& x : src) x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  for (size_t i = 0; i < 64; ++i) src[i] = f[i * 1023];  // exact halves, NaNs and Infs included
  std::vector<Half> h(src.size());
  FloatToHalf(src.data(), h.data(), src.size());
  std::vector<BFloat16> b(src.size());
  FloatToBFloat16(src.data(), b.data(), src.size());
  std::vector<float> bf(src.size());
  BFloat16ToFloat(b.data(), bf.data(), b.size());
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(h[i].bits, FloatToHalfBits(src[i])) << i << " f16c=" << HalfConversionUsesF16C();
    ASSERT_EQ(b[i].bits, FloatToBFloat16Bits(src[i])) << i;
    ASSERT_EQ(std::bit_cast<uint32_t>(bf[i]), std::bit_cast<uint32_t>(b[i].ToFloat())) << i;
  }
}

}  // namespace
}  // namespace strata
