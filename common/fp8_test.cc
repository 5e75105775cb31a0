#include "common/fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace strata {
namespace {

double E4M3Value(uint8_t x) {
  const int sign = (x & 0x80) ? -1 : 1;
  const int exp = (x >> 3) & 0xf;
  const int man = x & 7;
  if (exp == 15 && man == 7) return std::numeric_limits<double>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(man, -9);
  return sign * std::ldexp(8 + man, exp - 10);
}

TEST(Fp8Test, WideningIsExactForAll256ValuesAndRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const uint8_t x = static_cast<uint8_t>(b);
    const float f = Fp8E4M3ToFloat(x);
    const double want = E4M3Value(x);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << b;
      EXPECT_EQ(FloatToFp8E4M3(f) & 0x7f, 0x7f) << b;
      continue;
    }
    EXPECT_EQ(static_cast<double>(f), want) << b;
    EXPECT_EQ(FloatToFp8E4M3(f), x) << b;
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
}

TEST(Fp8Test, NarrowingRoundsToNearestEvenAndSaturates) {
  for (int lo = 0; lo < 0x7e; ++lo) {
    const double a = E4M3Value(static_cast<uint8_t>(lo));
    const double b = E4M3Value(static_cast<uint8_t>(lo + 1));
    const float mid = static_cast<float>((a + b) / 2);
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
    const uint8_t even = (lo & 1) ? lo + 1 : lo;
    EXPECT_EQ(FloatToFp8E4M3(mid), even) << lo;
    EXPECT_EQ(FloatToFp8E4M3(-mid), even | 0x80) << lo;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(mid, 0.0f)), lo) << lo;
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(mid, 1e9f)), lo + 1) << lo;
  }
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7e);  // the tie above 448 saturates, never NaN
  EXPECT_EQ(FloatToFp8E4M3(1e6f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-INFINITY), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(0x1p-10f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(0x1.8p-10f), 0x01);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
}

// Floor and ceil: the nearest representable value on the right side, for every float in a dense
// sweep, checked against the sorted list of all finite e4m3 values.
TEST(Fp8Test, FloorAndCeilPickTheNeighboursOnTheRightSide) {
  std::vector<float> all;
  for (int b = 0; b < 256; ++b) {
    const float f = Fp8E4M3ToFloat(static_cast<uint8_t>(b));
    if (f == f) all.push_back(f);
  }
  std::sort(all.begin(), all.end());
  for (float x = -460.0f; x <= 460.0f; x += 0.0371f) {
    for (float y : {x, x * 1e-3f}) {
      const float lo = Fp8E4M3ToFloat(Fp8E4M3Floor(y));
      const float hi = Fp8E4M3ToFloat(Fp8E4M3Ceil(y));
      if (y >= -448.0f) {
        EXPECT_LE(lo, y);
        EXPECT_EQ(lo, *(std::upper_bound(all.begin(), all.end(), y) - 1)) << y;
      }
      if (y <= 448.0f) {
        EXPECT_GE(hi, y);
        EXPECT_EQ(hi, *std::lower_bound(all.begin(), all.end(), y)) << y;
      }
    }
  }
}

}  // namespace
}  // namespace strata
