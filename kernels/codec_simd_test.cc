#include "kernels/internal/codec_simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/fp8.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/bit_pack.h"
#include "kernels/codebook.h"
#include "kernels/codec.h"
#include "kernels/internal/vector_exp.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels {
namespace {

using internal::HaveCodecSimd;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Values that meet the loops' edge cases: both zeros, exact halves after scaling, a group's
// constant value, magnitudes far apart.
std::vector<float> Values(size_t n, uint64_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 2);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (rng() % 8) {
      case 0:
        v[i] = 0.0f;
        break;
      case 1:
        v[i] = -0.0f;
        break;
      case 2:
        v[i] = static_cast<float>(static_cast<int>(rng() % 16)) * 0.25f;  // ties after scaling
        break;
      case 3:
        v[i] = normal(rng) * 1000.0f;
        break;
      default:
        v[i] = normal(rng);
    }
  }
  return v;
}

TEST(CodecSimdTest, LoopsEqualThePortableLoopsBitForBit) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  for (uint32_t D : {1u, 7u, 8u, 32u, 64u, 100u, 128u}) {
    for (uint32_t n : {1u, 5u, 32u}) {
      const std::vector<float> rows = Values(size_t{n} * D, D * 31 + n);
      std::vector<float> mn(D, INFINITY), mx(D, -INFINITY), rmn = mn, rmx = mx;
      internal::ColumnMinMaxAvx2(rows.data(), D, n, D, mn.data(), mx.data());
      for (uint32_t t = 0; t < n; ++t) {
        for (uint32_t d = 0; d < D; ++d) {
          rmn[d] = std::min(rmn[d], rows[size_t{t} * D + d]);
          rmx[d] = std::max(rmx[d], rows[size_t{t} * D + d]);
        }
      }
      for (uint32_t d = 0; d < D; ++d) {
        ASSERT_EQ(Bits(mn[d]), Bits(rmn[d])) << "D=" << D << " n=" << n << " d=" << d;
        ASSERT_EQ(Bits(mx[d]), Bits(rmx[d])) << "D=" << D << " n=" << n << " d=" << d;
      }
    }
    // Row counts around the eight-row blocks, with and without a mask.
    for (uint32_t gs : {8u, 16u, 32u, 64u}) {
      for (uint32_t n : {1u, 8u, 19u}) {
        for (bool masked : {false, true}) {
          const std::vector<float> rows = Values(size_t{n} * D, D + gs + n);
          std::vector<uint8_t> mask;
          if (masked) {
            std::mt19937 rng(D + gs);
            for (size_t i = 0; i < rows.size(); ++i) mask.push_back(rng() % 5 == 0);
          }
          const uint32_t groups = (D + gs - 1) / gs;
          std::vector<float> lo(size_t{n} * groups), hi(size_t{n} * groups);
          internal::GroupMinMaxAvx2(rows.data(), n, D, gs, lo.data(), hi.data(),
                                    masked ? mask.data() : nullptr);
          for (uint32_t r = 0; r < n; ++r) {
            for (uint32_t g = 0; g < groups; ++g) {
              float a = INFINITY, b = -INFINITY;
              for (uint32_t d = g * gs; d < std::min(D, g * gs + gs); ++d) {
                const size_t i = size_t{r} * D + d;
                if (masked && mask[i]) continue;
                a = std::min(a, rows[i]);
                b = std::max(b, rows[i]);
              }
              // Equal as values; which zero a scan keeps depends on its order (the codec takes
              // +0).
              const size_t i = size_t{r} * groups + g;
              EXPECT_EQ(Bits(lo[i] + 0.0f), Bits(a + 0.0f))
                  << "D=" << D << " gs=" << gs << " n=" << n << " row " << r << " group " << g;
              EXPECT_EQ(Bits(hi[i] + 0.0f), Bits(b + 0.0f))
                  << "D=" << D << " gs=" << gs << " n=" << n << " row " << r << " group " << g;
            }
          }
        }
      }
    }
    for (float qmax : {3.0f, 15.0f, 255.0f}) {
      const std::vector<float> x = Values(D, D), z = Values(D, D + 1);
      std::vector<float> inv(D);
      std::mt19937 rng(D);
      for (float& v : inv) v = static_cast<float>(rng() % 64) * 0.5f;  // 0 included
      std::vector<uint8_t> codes(D), ref(D);
      internal::QuantizeRowAvx2(x.data(), z.data(), inv.data(), D, qmax, codes.data());
      for (uint32_t d = 0; d < D; ++d) {
        const float y = std::max((x[d] - z[d]) * inv[d] + 0.5f, 0.0f);
        ref[d] = static_cast<uint8_t>(
            std::min(static_cast<float>(static_cast<int32_t>(std::min(y, 1e9f))), qmax));
      }
      EXPECT_EQ(codes, ref) << "D=" << D << " qmax=" << qmax;
    }
  }
  for (int bits : {2, 3, 4, 8}) {
    for (size_t n : {0, 1, 31, 63, 64, 65, 127, 128, 129, 300}) {
      std::mt19937 rng(static_cast<uint32_t>(n * 8 + bits));
      std::vector<uint8_t> codes(n);
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % (1u << bits));
      std::vector<uint8_t> a(PackedBytes(n, bits) + 1, 0xAA), b = a;
      internal::PackBitsAvx2(codes.data(), n, bits, a.data());
      PackBits(codes.data(), n, bits, b.data());
      EXPECT_EQ(a, b) << "bits=" << bits << " n=" << n;
    }
  }
}

TEST(CodecSimdTest, MaxAbsEqualsTheScalarScan) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  for (size_t n : {0u, 1u, 7u, 8u, 9u, 64u, 1001u}) {
    std::vector<float> x = Values(n, n + 5);
    if (n > 3) x[n / 2] = NAN;  // skipped by both
    for (const float init : {0.0f, 1e-20f, 5000.0f}) {
      float want = init;
      for (float v : x) want = std::max(want, std::fabs(v));
      EXPECT_EQ(Bits(internal::MaxAbsAvx2(x.data(), n, init)), Bits(want))
          << "n=" << n << " init=" << init;
    }
  }
}

TEST(CodecSimdTest, Fp8NarrowingEqualsTheScalarConversion) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::vector<float> x;
  // Every e4m3 value, the ties between neighbours and the floats just either side of them.
  for (int c = 0; c < 0x7f; ++c) {
    const float lo = Fp8E4M3ToFloat(static_cast<uint8_t>(c)),
                hi = Fp8E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = c + 1 < 0x7f ? (lo + hi) / 2 : 464.0f;
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  for (float v : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-40f, -1e-45f, 0x1p-10f,
                  std::nextafter(0x1p-10f, 1.0f), 0x1p-6f, std::nextafter(0x1p-6f, 0.0f), 448.0f,
                  464.0f, std::nextafter(464.0f, 0.0f), 1e6f, 3e38f}) {
    x.push_back(v);
  }
  std::mt19937 rng(11);  // any bit pattern
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  for (const float mul : {1.0f, 3.7f, 1.0f / 448.0f}) {
    for (const size_t offset : {size_t{0}, size_t{3}}) {  // and a tail of every length
      const size_t n = x.size() - offset;
      std::vector<uint8_t> got(n);
      internal::ScaleToFp8E4M3Avx2(x.data() + offset, n, mul, got.data());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], FloatToFp8E4M3(x[offset + i] * mul))
            << "x=" << x[offset + i] << " (bits " << std::hex << Bits(x[offset + i])
            << ") mul=" << mul;
      }
    }
  }
}

TEST(CodecSimdTest, PermutedRowsAreTheGatheredRows) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::mt19937 rng(11);
  // Row counts around the eight-row tiles; widths with and without whole vectors.
  for (uint32_t d : {8u, 12u, 64u, 128u, 256u}) {
    for (uint32_t rows : {1u, 7u, 8u, 9u, 16u, 23u}) {
      std::vector<uint16_t> perm(d);
      for (uint32_t i = 0; i < d; ++i) perm[i] = static_cast<uint16_t>(i);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<float> x(size_t{rows} * d);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
      std::vector<float> got = x;
      internal::PermuteRowsAvx2(got.data(), rows, d, perm.data());
      for (uint32_t r = 0; r < rows; ++r) {
        for (uint32_t i = 0; i < d; ++i) {
          ASSERT_EQ(got[size_t{r} * d + i], x[size_t{r} * d + perm[i]])
              << "d=" << d << " rows=" << rows << " row " << r << " channel " << i;
        }
      }
    }
  }
}

// SKVQ's fp16 input: eight rows widened, range-checked and permuted in one pass, against the
// widened rows gathered; any value past the limit, or NaN, in any row fails and writes nothing.
TEST(CodecSimdTest, HalfRowsAreWidenedAndPermutedInOnePass) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0, 4);
  const float limit = 60000.0f;
  for (uint32_t d : {8u, 40u, 128u, 256u}) {
    const size_t stride = size_t{3} * d;  // the rows of one head among three
    std::vector<float> x(8 * stride);
    for (float& v : x) v = normal(rng);
    x[5] = limit;  // at the limit: within
    x[stride + d - 1] = -limit;
    std::vector<Half> h(x.size());
    FloatToHalf(x.data(), h.data(), h.size());
    std::vector<uint16_t> perm(d);
    for (uint32_t i = 0; i < d; ++i) perm[i] = static_cast<uint16_t>(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    const auto* src = reinterpret_cast<const uint16_t*>(h.data());
    std::vector<float> got(size_t{8} * d, -1.0f);
    ASSERT_TRUE(
        internal::HalfToFloatPermutedWithinAvx2(src, stride, d, perm.data(), limit, got.data()))
        << "d=" << d;
    for (uint32_t r = 0; r < 8; ++r) {
      for (uint32_t i = 0; i < d; ++i) {
        ASSERT_EQ(got[size_t{r} * d + i], h[r * stride + perm[i]].ToFloat())
            << "d=" << d << " row " << r << " channel " << i;
      }
    }
    // One bad value at a time, in the first, a middle and the last row and channel.
    for (uint32_t r : {0u, 3u, 7u}) {
      for (uint32_t c : {0u, d / 2 + 1, d - 1}) {
        for (float bad : {std::nanf(""), 65504.0f, -61000.0f}) {
          std::vector<Half> hb = h;
          hb[r * stride + c] = Half::FromFloat(bad);
          std::vector<float> out(size_t{8} * d, -1.0f);
          EXPECT_FALSE(
              internal::HalfToFloatPermutedWithinAvx2(reinterpret_cast<const uint16_t*>(hb.data()),
                                                      stride, d, perm.data(), limit, out.data()))
              << "d=" << d << " row " << r << " channel " << c << " value " << bad;
          EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == -1.0f; }))
              << "wrote rows for a failed check, d=" << d;
        }
      }
    }
  }
}

// GEAR's power-iteration products, element for element the scalar sums in their order (mul,
// then add; c or i ascending from +0): every rank 1-9 (the kernels take 1-8 columns of the
// factor at a time, and several column vectors at once at ranks up to 4), widths with and
// without whole vectors and groups of them, rows with and without whole tiles.
TEST(CodecSimdTest, LowRankProductsAreTheScalarSums) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0, 1);
  for (uint32_t rows : {8u, 13u, 64u}) {
    for (uint32_t cols : {8u, 20u, 40u, 64u, 72u}) {
      for (uint32_t rank = 1; rank <= 9; ++rank) {
        std::vector<float> r(size_t{rows} * cols), bt(size_t{rank} * cols), a(size_t{rows} * rank);
        for (float& x : r) x = normal(rng);
        for (float& x : bt) x = normal(rng);
        for (float& x : a) x = normal(rng);
        std::vector<float> at(size_t{rank} * rows, NAN), b(size_t{rank} * cols, NAN);
        std::vector<float> rt(r.size());  // R^T, which LowRankRbAvx2 takes
        for (uint32_t i = 0; i < rows; ++i) {
          for (uint32_t c = 0; c < cols; ++c) rt[size_t{c} * rows + i] = r[size_t{i} * cols + c];
        }
        internal::LowRankRbAvx2(rt.data(), rows, cols, bt.data(), rank, at.data());
        internal::LowRankRtaAvx2(r.data(), rows, cols, a.data(), rank, b.data());
        // The scalar chain: sum over k < n of product(k), multiplied then added, k ascending.
        auto chain = [](uint32_t n, auto product) {
          float sum = 0.0f;
          for (uint32_t k = 0; k < n; ++k) sum += product(k);
          return sum;
        };
        for (uint32_t j = 0; j < rank; ++j) {
          for (uint32_t i = 0; i < rows; ++i) {
            const float sum = chain(cols, [&](uint32_t c) {
              return bt[size_t{j} * cols + c] * r[size_t{i} * cols + c];
            });
            ASSERT_EQ(Bits(at[size_t{j} * rows + i]), Bits(sum))
                << "R B: rows=" << rows << " cols=" << cols << " rank=" << rank << " [" << j << "]["
                << i << "]";
          }
          for (uint32_t c = 0; c < cols; ++c) {
            const float sum = chain(rows, [&](uint32_t i) {
              return a[size_t{i} * rank + j] * r[size_t{i} * cols + c];
            });
            ASSERT_EQ(Bits(b[size_t{j} * cols + c]), Bits(sum))
                << "R^T A: rows=" << rows << " cols=" << cols << " rank=" << rank << " [" << j
                << "][" << c << "]";
          }
        }
      }
    }
  }
}

TEST(CodecSimdTest, ProbeDotsAreTheScalarFmaChains) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  // Head counts around the four-head tiles, token counts around the 8- and 16-token vectors.
  for (uint32_t D : {8u, 64u, 128u}) {
    for (uint32_t G : {1u, 3u, 4u, 5u, 8u}) {
      const uint32_t T = 45;
      std::vector<float> kt(size_t{D} * T), q(size_t{G} * D);
      for (float& x : kt) x = normal(rng);
      for (float& x : q) x = normal(rng);
      for (uint32_t n : {1u, 7u, 8u, 16u, 23u, 45u}) {
        std::vector<float> out(size_t{G} * T, NAN);
        internal::ProbeDotsAvx2(kt.data(), T, D, q.data(), G, n, out.data());
        for (uint32_t g = 0; g < G; ++g) {
          for (uint32_t t = 0; t < n; ++t) {
            float dot = 0.0f;
            for (uint32_t d = 0; d < D; ++d) {
              dot = std::fma(q[size_t{g} * D + d], kt[size_t{d} * T + t], dot);
            }
            ASSERT_EQ(Bits(out[size_t{g} * T + t]), Bits(dot))
                << "D=" << D << " G=" << G << " n=" << n << " head " << g << " token " << t;
          }
        }
      }
    }
  }
}

TEST(CodecSimdTest, ExpLanesAreTheScalarExpAndCloseToStdExp) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::vector<float> x = {0.0f,
                          -0.0f,
                          -1e-30f,
                          -0.5f,
                          -1.0f,
                          -87.3f,
                          -87.29f,
                          -87.31f,
                          -100.0f,
                          -INFINITY,
                          -std::nextafter(87.3f, 0.0f)};
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-90.0f, 0.0f);
  for (int i = 0; i < 100000; ++i) x.push_back(u(rng));
  while (x.size() % 8 != 0) x.push_back(-2.0f);
  std::vector<float> p(x.size());
  const std::vector<float> ones(x.size(), 1.0f);
  internal::ProbeWeightsAvx2(x.data(), static_cast<uint32_t>(x.size()), 1.0f, p.data());
  // The largest x is 0: p = exp(x).
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(Bits(p[i]), Bits(internal::ExpScalar(x[i]))) << "x=" << x[i];
    if (x[i] >= -87.3f) {
      EXPECT_NEAR(p[i], std::exp(double{x[i]}), 3e-7 * std::exp(double{x[i]})) << "x=" << x[i];
    } else {
      EXPECT_EQ(p[i], 0.0f) << "x=" << x[i];
    }
  }
}

TEST(CodecSimdTest, ProbeWeightsAreTheScalarLoop) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0, 30);
  for (uint32_t n : {1u, 7u, 8u, 9u, 64u, 101u}) {
    std::vector<float> dots(n);
    for (float& d : dots) d = normal(rng);
    const float scale = 1.0f / std::sqrt(128.0f);
    std::vector<float> p(n);
    internal::ProbeWeightsAvx2(dots.data(), n, scale, p.data());
    float mx = -INFINITY;
    for (float d : dots) mx = std::max(mx, d * scale);
    for (uint32_t t = 0; t < n; ++t) {
      ASSERT_EQ(Bits(p[t]), Bits(internal::ExpScalar(dots[t] * scale - mx))) << "n=" << n;
    }
  }
}

TEST(CodecSimdTest, TransposeMovesEveryElement) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  for (uint32_t rows : {1u, 8u, 13u, 24u}) {
    for (uint32_t cols : {1u, 8u, 12u, 17u}) {
      const size_t src_stride = cols + 3, dst_stride = rows + 5;
      std::vector<float> src(rows * src_stride), dst(cols * dst_stride, -1.0f);
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
      internal::TransposeAvx2(src.data(), src_stride, rows, cols, dst.data(), dst_stride);
      for (uint32_t c = 0; c < cols; ++c) {
        for (uint32_t r = 0; r < dst_stride; ++r) {
          const float want = r < rows ? src[r * src_stride + c] : -1.0f;  // padding untouched
          ASSERT_EQ(dst[c * dst_stride + r], want)
              << rows << "x" << cols << " r=" << r << " c=" << c;
        }
      }
    }
  }
}

TEST(CodecSimdTest, Int8CodesEqualTheScalarLoop) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  for (uint32_t n : {1u, 7u, 8u, 64u, 131u}) {
    const std::vector<float> x = Values(n, n + 17);  // zeros of both signs, ties after scaling
    for (const float inv : {1.0f, 2.0f, 0.01f, 300.0f, 0.0f}) {
      std::vector<int8_t> got(n);
      internal::QuantizeInt8Avx2(x.data(), n, inv, got.data());
      for (uint32_t i = 0; i < n; ++i) {
        const float y = x[i] * inv;
        const float q = static_cast<float>(static_cast<int32_t>(y + (y >= 0 ? 0.5f : -0.5f)));
        ASSERT_EQ(got[i], static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)))
            << "x=" << x[i] << " inv=" << inv;
      }
    }
  }
}

// fp8 parameters (m8) as the quantizer's scalar code makes them, on ranges that take every
// rounding step: zero points of both signs near zero, empty groups (lo > hi), constant groups,
// ranges at the multipliers' limits and past them (saturating at 448).
TEST(CodecSimdTest, Fp8ParametersEqualTheScalarCode) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  const float qmax = 3.0f, maxabs = 37.5f;
  const float ms = 2.1f * maxabs / qmax / kFp8E4M3Max, mz = maxabs / kFp8E4M3Max;
  std::vector<float> lo = Values(203, 5), hi = Values(203, 6);
  for (size_t i = 0; i < lo.size(); ++i) {
    lo[i] = std::clamp(lo[i], -maxabs, maxabs);
    hi[i] = std::clamp(hi[i], -maxabs, maxabs);
    if (i % 5 == 0) std::swap(lo[i], hi[i]);  // some empty, some not
    if (i % 7 == 0) lo[i] = hi[i];
    if (i % 11 == 0) lo[i] = -1e-9f * static_cast<float>(i);
    if (i % 13 == 0) lo[i] = -maxabs, hi[i] = maxabs;
    if (i % 17 == 0) lo[i] = -3 * maxabs, hi[i] = 9 * maxabs;  // past 448: saturates
  }
  const uint32_t n = static_cast<uint32_t>(lo.size());
  std::vector<uint8_t> s8(n), z8(n);
  std::vector<float> s(n), z(n), inv(n);
  internal::AffineParamsFp8Avx2(lo.data(), hi.data(), n, qmax, ms, mz, s8.data(), z8.data(),
                                s.data(), z.data(), inv.data());
  for (uint32_t i = 0; i < n; ++i) {
    float l = lo[i], h = hi[i];
    if (l > h) l = h = 0;
    const uint8_t zc = Fp8E4M3Floor(l / mz);
    const float zf = HalfBitsToFloat(FloatToHalfBits(Fp8E4M3ToFloat(zc) * mz));
    const uint8_t sc = Fp8E4M3Ceil((h - zf) / qmax / ms);
    const float sf = HalfBitsToFloat(FloatToHalfBits(Fp8E4M3ToFloat(sc) * ms));
    ASSERT_EQ(z8[i], zc) << "lo=" << lo[i] << " hi=" << hi[i];
    ASSERT_EQ(s8[i], sc) << "lo=" << lo[i] << " hi=" << hi[i];
    ASSERT_EQ(Bits(z[i]), Bits(zf));
    ASSERT_EQ(Bits(s[i]), Bits(sf));
    ASSERT_EQ(Bits(inv[i]), Bits(sf > 0 ? 1.0f / sf : 0.0f));
  }
}

// Whether `codec` encodes `in` to the same bytes with the AVX2 loops and with the portable ones.
testing::AssertionResult SameBytesWithAndWithoutAvx2(const Codec& codec, const KvChunkView& in) {
  absl::StatusOr<AlignedBuffer> fast = codec.Encode(in, {});
  internal::SetCodecSimdForTesting(false);
  absl::StatusOr<AlignedBuffer> portable = codec.Encode(in, {});
  internal::SetCodecSimdForTesting(true);
  if (!fast.ok() || !portable.ok()) {
    return testing::AssertionFailure()
           << "encode failed: " << fast.status() << " / " << portable.status();
  }
  if (fast->size() != portable->size()) {
    return testing::AssertionFailure() << "sizes " << fast->size() << " vs " << portable->size();
  }
  if (std::memcmp(fast->data(), portable->data(), fast->size()) != 0) {
    return testing::AssertionFailure() << "the bytes differ";
  }
  return testing::AssertionSuccess();
}

// Every codec's blocks are the same bytes with the AVX2 loops and without.
TEST(CodecSimdTest, BlocksAreTheSameBytesWithAndWithoutAvx2) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  for (const char* spec :
       {"kivi:k2v2:g32", "kivi:k4v4:g32", "kivi:k3v3:g64", "kivi:k8v8:g16", "kcvt:k2v2",
        "kivi:k2v2:g32:m8", "gear:k2v2:g32:r4:s2", "zipcache:k2v2:h4:s10", "tada:k2v2:g32",
        "kivi:k4v2:g32:sink4", "skvq:k2v2:g32", "skvq:k4v4:g16:m8", "skvq:k2v2:g64:m8",
        "kcvt:k4v4:m8", "gear:k2v2:g32:r4:s2:m8", "fp8e4m3", "int8"}) {
    for (uint32_t dim : {64u, 128u, 40u}) {
      const SyntheticKv kv = MakeSyntheticKv(77, 4, dim, 9, 0);
      const KvChunkView view{kv.k.data(), kv.v.data(), SourceDType::kFloat32, 77, 4, dim};
      const bool skvq = std::string(spec).starts_with("skvq");
      auto codec = Codec::Create(
          spec, skvq ? MakeSyntheticCalibration(*CodecSpec::Parse(spec), 4, dim, dim) : nullptr);
      ASSERT_TRUE(codec.ok()) << spec;
      // fp32 and fp16 input (the fp16 rows are widened and range-checked in one pass).
      std::vector<Half> k16(kv.k.size()), v16(kv.v.size());
      FloatToHalf(kv.k.data(), k16.data(), k16.size());
      FloatToHalf(kv.v.data(), v16.data(), v16.size());
      const KvChunkView view16{k16.data(), v16.data(), SourceDType::kFloat16, 77, 4, dim};
      // With queries too (ZipCache's probe attention; 8 query heads over the 4 KV heads).
      std::vector<float> q(size_t{77} * 8 * dim);
      std::mt19937 rng(dim);
      std::normal_distribution<float> normal(0, 1);
      for (float& x : q) x = normal(rng);
      KvChunkView with_q = view;
      with_q.q = q.data();
      with_q.q_heads = 8;
      for (const KvChunkView& in : {view, view16, with_q}) {
        EXPECT_TRUE(SameBytesWithAndWithoutAvx2(**codec, in))
            << spec << " d=" << dim << " fp16 input=" << (in.dtype == SourceDType::kFloat16)
            << " queries=" << (in.q != nullptr);
      }
    }
  }
}

// GEAR's outliers with one to many per side (the thresholds found first up to 8, the lists'
// scan beyond), on values on a coarse grid: many ties at the thresholds, broken by index.
TEST(CodecSimdTest, OutliersAreTheSameWithTiesAndEveryCount) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 on this CPU";
  for (const char* spec : {"gear:k2v2:g32:r2:s2", "gear:k4v4:g32:r2:s6", "gear:k2v2:g32:r2:s10",
                           "gear:k2v2:g32:r2:s20", "gear:k2v2:kcvt:r2:s40"}) {
    for (uint32_t dim : {64u, 128u, 40u}) {
      for (float grid : {0.0f, 0.5f, 4.0f}) {  // 0: the values as they are
        SyntheticKv kv = MakeSyntheticKv(150, 2, dim, 21, 0);
        if (grid > 0) {
          for (float& x : kv.k) x = std::round(x * grid) / grid;
          for (float& x : kv.v) x = std::round(x * grid) / grid;
        }
        const KvChunkView view{kv.k.data(), kv.v.data(), SourceDType::kFloat32, 150, 2, dim};
        auto codec = Codec::Create(spec);
        ASSERT_TRUE(codec.ok()) << spec;
        EXPECT_TRUE(SameBytesWithAndWithoutAvx2(**codec, view))
            << spec << " d=" << dim << " grid=" << grid;
      }
    }
  }
}

// CQ's search: the AVX2 loop picks what the portable loop picks, for every codebook shape the
// codec takes, with repeated centroids (ties: the lowest index) and points far from all of them.
TEST(CodecSimdTest, NearestCentroidsAreThePortableLoopsCodes) {
  if (!HaveCodecSimd()) GTEST_SKIP() << "skipped: no AVX2 and F16C on this CPU";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  for (int coupled : {2, 4, 8}) {
    for (uint32_t entries : {16u, 64u, 256u}) {
      std::vector<float> cent(size_t{entries} * coupled);
      for (float& x : cent) x = normal(rng);
      // A few centroids repeated further on: equal scores, where the first must win.
      for (uint32_t j = 0; j < 4; ++j) {
        std::copy_n(&cent[size_t{j} * coupled], coupled, &cent[size_t{entries - 1 - j} * coupled]);
      }
      const CentroidSearch search(cent.data(), entries, coupled);
      const size_t n = 500, stride = coupled + 3;
      std::vector<float> points(n * stride);
      for (size_t i = 0; i < n; ++i) {
        for (int d = 0; d < coupled; ++d) {
          // Some points on a centroid exactly, some far out.
          points[i * stride + d] = i % 7 == 0    ? cent[(i % entries) * coupled + d]
                                   : i % 11 == 0 ? 40.0f * normal(rng)
                                                 : normal(rng);
        }
      }
      std::vector<uint8_t> simd(2 * n, 0xee), portable(2 * n, 0xee);
      search.NearestMany(points.data(), n, stride, simd.data(), 2);
      search.NearestManyPortable(points.data(), n, stride, portable.data(), 2);
      EXPECT_EQ(simd, portable) << "c" << coupled << " entries " << entries;
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(simd[2 * i + 1], 0xee);  // out_stride: nothing written between
        EXPECT_LT(simd[2 * i], entries - 4) << "a repeated centroid's later copy chosen";
      }
    }
  }
}

}  // namespace
}  // namespace strata::kernels
