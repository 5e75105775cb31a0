#include "model/matmul.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/cpu_features.h"
#include "gtest/gtest.h"

namespace strata::model {
namespace {

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Each element against its double-precision dot product, to a bound relative to sum |x||w|.
void ExpectNearReference(const std::vector<float>& x, int rows, int in, const std::vector<float>& w,
                         int out, const std::vector<float>& y) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < out; ++c) {
      double dot = 0, mag = 0;
      for (int k = 0; k < in; ++k) {
        dot += double{x[size_t(r) * in + k]} * w[size_t(c) * in + k];
        mag += std::abs(double{x[size_t(r) * in + k]} * w[size_t(c) * in + k]);
      }
      ASSERT_NEAR(y[size_t(r) * out + c], dot, 1e-6 * mag + 1e-30)
          << "row " << r << " column " << c << " of " << rows << "x" << in << "x" << out;
    }
  }
}

struct Shape {
  int rows, in, out;
};
// Inputs not a multiple of the vector width (1, 7, 9, 130), outputs not a multiple of the four
// columns a block takes (1, 3, 5, 67), rows not a multiple of the three a block takes.
const Shape kShapes[] = {{1, 1, 1},      {1, 7, 3},      {2, 9, 5},      {3, 16, 4},   {4, 130, 67},
                         {5, 64, 8},     {7, 128, 130},  {16, 512, 96},  {64, 33, 17}, {65, 40, 24},
                         {1, 4096, 128}, {3, 128, 4096}, {100, 256, 300}};

TEST(MatMulTest, MatchesDoubleReference) {
  // OpenBLAS is opened at first use, not linked: setup.sh installs it, and products of more than
  // kRowInvariantRows rows here go through it.
  EXPECT_TRUE(MatMulUsesOpenBlas());
  std::mt19937 rng(1);
  ThreadPool pool(3);
  for (const Shape& s : kShapes) {
    const std::vector<float> x = Random(size_t(s.rows) * s.in, rng),
                             w = Random(size_t(s.out) * s.in, rng);
    std::vector<float> y(size_t(s.rows) * s.out, NAN);
    MatMul(x.data(), s.rows, s.in, w.data(), s.out, y.data(), pool);
    ExpectNearReference(x, s.rows, s.in, w, s.out, y);
    std::vector<float> p(y.size(), NAN);
    MatMulRowInvariantPortable(x.data(), s.rows, s.in, w.data(), s.out, p.data());
    ExpectNearReference(x, s.rows, s.in, w, s.out, p);
  }
}

// The vector code follows the specification bit for bit, on one thread or split over several.
TEST(MatMulTest, RowInvariantVectorCodeEqualsPortable) {
  if (!GetCpuFeatures().avx2 || !GetCpuFeatures().fma) {
    GTEST_SKIP() << "no AVX2+FMA here (or a cap on the CPU's features hides it): only the portable "
                    "code runs";
  }
  std::mt19937 rng(2);
  ThreadPool one(1), three(3);
  for (const Shape& s : kShapes) {
    const std::vector<float> x = Random(size_t(s.rows) * s.in, rng),
                             w = Random(size_t(s.out) * s.in, rng);
    std::vector<float> want(size_t(s.rows) * s.out), a(want.size()), b(want.size());
    MatMulRowInvariantPortable(x.data(), s.rows, s.in, w.data(), s.out, want.data());
    MatMulRowInvariant(x.data(), s.rows, s.in, w.data(), s.out, a.data(), one);
    MatMulRowInvariant(x.data(), s.rows, s.in, w.data(), s.out, b.data(), three);
    EXPECT_EQ(0, std::memcmp(a.data(), want.data(), a.size() * sizeof(float)))
        << s.rows << "x" << s.in << "x" << s.out;
    EXPECT_EQ(0, std::memcmp(b.data(), want.data(), b.size() * sizeof(float)))
        << s.rows << "x" << s.in << "x" << s.out;
  }
}

// A row's result is the same bits alone as in a batch of any size up to kRowInvariantRows, at
// any position, whatever its neighbours hold: what a decode step's continuous batch needs.
TEST(MatMulTest, RowResultDoesNotDependOnTheBatch) {
  std::mt19937 rng(3);
  ThreadPool pool(2);
  for (const int in : {96, 130, 512}) {
    const int out = 200;
    const std::vector<float> w = Random(size_t(out) * in, rng);
    for (const int rows : {2, 3, 5, 16, 17, 32, kRowInvariantRows}) {
      const std::vector<float> x = Random(size_t(rows) * in, rng);
      std::vector<float> y(size_t(rows) * out), solo(out);
      MatMul(x.data(), rows, in, w.data(), out, y.data(), pool);
      for (int r = 0; r < rows; ++r) {
        MatMul(&x[size_t(r) * in], 1, in, w.data(), out, solo.data(), pool);
        ASSERT_EQ(0, std::memcmp(solo.data(), &y[size_t(r) * out], out * sizeof(float)))
            << "row " << r << " of " << rows << ", input " << in;
      }
    }
  }
}

}  // namespace
}  // namespace strata::model
