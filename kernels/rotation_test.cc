// The rotation stage's transform (rotation.h): orthonormal (norms and dot products kept), undone
// by Invert, the same for a layer wherever it is made and different between layers, refused for
// sizes that are not powers of two; and what it is for: an outlier channel's energy spread over
// the head, so that a per-token int8 grid resolves the ordinary channels better.
#include "kernels/rotation.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace strata::kernels {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double Dot(const float* a, const float* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += double{a[i]} * b[i];
  return s;
}

TEST(HadamardRotationTest, KeepsDotProductsAndInvertUndoesIt) {
  for (const uint32_t dim : {2u, 32u, 64u, 128u, 256u}) {
    SCOPED_TRACE(dim);
    const HadamardRotation r = *HadamardRotation::Make(dim, 5);
    const std::vector<float> q = Random(3 * dim, 1), k = Random(3 * dim, 2);
    std::vector<float> qr = q, kr = k;
    r.Apply(qr.data(), 3);
    r.Apply(kr.data(), 3);
    for (size_t row = 0; row < 3; ++row) {
      const double want = Dot(&q[row * dim], &k[row * dim], dim);
      EXPECT_NEAR(Dot(&qr[row * dim], &kr[row * dim], dim), want, 1e-4 * dim);
      EXPECT_NEAR(Dot(&qr[row * dim], &qr[row * dim], dim), Dot(&q[row * dim], &q[row * dim], dim),
                  1e-4 * dim);
    }
    EXPECT_NE(qr, q);
    r.Invert(qr.data(), 3);
    for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(qr[i], q[i], 1e-5) << i;
  }
}

TEST(HadamardRotationTest, ALayersSignsAreFixedAndLayersDiffer) {
  const std::vector<float> x = Random(64, 3);
  std::vector<float> a = x, b = x, c = x;
  HadamardRotation::Make(64, 7)->Apply(a.data(), 1);
  HadamardRotation::Make(64, 7)->Apply(b.data(), 1);
  HadamardRotation::Make(64, 8)->Apply(c.data(), 1);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Pinned: blocks carry no seed, so the stream may never change (a stored rotated block would
  // be misread). The first output of layer 0 on a unit vector e0 is s0 / sqrt(64).
  std::vector<float> e0(64, 0.0f);
  e0[0] = 1.0f;
  HadamardRotation::Make(64, 0)->Apply(e0.data(), 1);
  for (float v : e0) EXPECT_FLOAT_EQ(std::fabs(v), 0.125f);
  EXPECT_FLOAT_EQ(e0[0], -0.125f);
}

TEST(HadamardRotationTest, SizesThatAreNotPowersOfTwoAreRefused) {
  for (const uint32_t dim : {0u, 1u, 3u, 96u, 8192u}) {
    absl::StatusOr<HadamardRotation> r = HadamardRotation::Make(dim, 0);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << dim;
  }
}

// Per-token symmetric int8 of a head with one massive channel (as real LLMs' keys have): the
// outlier sets the step, and the ordinary channels drown in it; rotated, the step shrinks.
double Int8RelError(const std::vector<float>& x, uint32_t dim) {
  double num = 0, den = 0;
  for (size_t row = 0; row < x.size() / dim; ++row) {
    const float* v = &x[row * dim];
    float mx = 0;
    for (uint32_t i = 0; i < dim; ++i) mx = std::max(mx, std::fabs(v[i]));
    const float step = mx / 127;
    for (uint32_t i = 0; i < dim; ++i) {
      const float q = std::round(v[i] / step) * step;
      num += double(q - v[i]) * (q - v[i]);
      den += double{v[i]} * v[i];
    }
  }
  return std::sqrt(num / den);
}

TEST(HadamardRotationTest, SpreadsAnOutlierChannelSoThatInt8ResolvesTheRest) {
  const uint32_t dim = 128;
  std::vector<float> k = Random(64 * dim, 4);
  for (size_t row = 0; row < 64; ++row) k[row * dim + 17] = 60.0f;  // an outlier channel
  std::vector<float> rotated = k;
  HadamardRotation::Make(dim, 1)->Apply(rotated.data(), 64);
  const double plain = Int8RelError(k, dim), turned = Int8RelError(rotated, dim);
  EXPECT_LT(turned, plain / 2) << plain << " -> " << turned;
}

}  // namespace
}  // namespace strata::kernels
