#include "common/crc32c.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cpu_features.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

// Bitwise definition of CRC-32C, the slowest and plainest form, to hold the others to.
uint32_t Crc32cBitwise(const uint8_t* p, size_t n) {
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82f63b78u : 0u);
  }
  return ~c;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(Crc32cTest, KnownVectorsFromRfc3720) {
  const std::string check = "123456789";
  EXPECT_EQ(Crc32c(check.data(), check.size()), 0xe3069283u);
  std::vector<uint8_t> buf(32, 0x00);
  EXPECT_EQ(Crc32c(buf.data(), buf.size()), 0x8a9136aau);
  std::fill(buf.begin(), buf.end(), 0xff);
  EXPECT_EQ(Crc32c(buf.data(), buf.size()), 0x62a8ab43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(buf.data(), buf.size()), 0x46dd794eu);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

// Lengths around every loop boundary of the interleaved paths (3 x 256, 3 x 8192), at several
// misalignments.
TEST(Crc32cTest, AllPathsAgreeWithTheBitwiseDefinition) {
  const std::vector<uint8_t> data = RandomBytes(3 * 8192 * 2 + 3 * 256 * 2 + 64, 42);
  const size_t lengths[] = {0,    1,    7,     8,     9,     63,    767,   768,   769,
                            1000, 4096, 24575, 24576, 24577, 25344, 49151, 49152, 49920};
  for (size_t offset : {0, 1, 3, 8}) {
    for (size_t n : lengths) {
      if (offset + n > data.size()) continue;
      const uint8_t* p = data.data() + offset;
      const uint32_t want = Crc32cBitwise(p, n);
      EXPECT_EQ(Crc32c(p, n), want) << "n=" << n << " offset=" << offset;
      EXPECT_EQ(Crc32cExtendPortable(0, p, n), want) << "n=" << n << " offset=" << offset;
    }
  }
}

TEST(Crc32cTest, ExtendAndCombineEqualTheWholeBuffer) {
  const std::vector<uint8_t> data = RandomBytes(100'000, 7);
  const uint32_t whole = Crc32c(data.data(), data.size());
  std::mt19937 rng(9);
  for (int trial = 0; trial < 50; ++trial) {
    const size_t cut = rng() % (data.size() + 1);
    const uint32_t a = Crc32c(data.data(), cut);
    const uint32_t b = Crc32c(data.data() + cut, data.size() - cut);
    EXPECT_EQ(Crc32cExtend(a, data.data() + cut, data.size() - cut), whole) << cut;
    EXPECT_EQ(Crc32cCombine(a, b, data.size() - cut), whole) << cut;
  }
}

TEST(Crc32cTest, DetectsEverySingleBitFlip) {
  std::vector<uint8_t> data = RandomBytes(512, 3);
  const uint32_t crc = Crc32c(data.data(), data.size());
  for (size_t i = 0; i < data.size() * 8; ++i) {
    data[i / 8] ^= static_cast<uint8_t>(1u << (i % 8));
    EXPECT_NE(Crc32c(data.data(), data.size()), crc) << "bit " << i;
    data[i / 8] ^= static_cast<uint8_t>(1u << (i % 8));
  }
}

TEST(Crc32cTest, ReportsWhetherHardwareIsUsed) {
  EXPECT_EQ(Crc32cIsHardwareAccelerated(), GetCpuFeatures().sse42);
}

}  // namespace
}  // namespace strata
