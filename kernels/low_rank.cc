#include "kernels/low_rank.h"

#include <cmath>
#include <random>
#include <vector>

namespace strata::kernels {
namespace {

// Orthonormalizes the columns of m [rows, rank] in place; a column that vanishes becomes zero.
void Orthonormalize(float* m, int rows, int rank) {
  for (int j = 0; j < rank; ++j) {
    for (int p = 0; p < j; ++p) {
      double dot = 0;
      for (int i = 0; i < rows; ++i) dot += double{m[i * rank + j]} * m[i * rank + p];
      for (int i = 0; i < rows; ++i) m[i * rank + j] -= static_cast<float>(dot) * m[i * rank + p];
    }
    double norm = 0;
    for (int i = 0; i < rows; ++i) norm += double{m[i * rank + j]} * m[i * rank + j];
    norm = std::sqrt(norm);
    const float inv = norm > 1e-20 ? static_cast<float>(1.0 / norm) : 0.0f;
    for (int i = 0; i < rows; ++i) m[i * rank + j] *= inv;
  }
}

}  // namespace

void LowRankApproximate(const float* r, int rows, int cols, int rank, int iterations,
                        uint64_t seed, float* a, float* b) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int i = 0; i < cols * rank; ++i) b[i] = normal(rng);
  Orthonormalize(b, cols, rank);
  std::vector<double> acc(rank);
  for (int it = 0; it < iterations; ++it) {
    // A = R B
    for (int i = 0; i < rows; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      const float* row = r + static_cast<size_t>(i) * cols;
      for (int c = 0; c < cols; ++c) {
        for (int j = 0; j < rank; ++j) acc[j] += double{row[c]} * b[c * rank + j];
      }
      for (int j = 0; j < rank; ++j) a[i * rank + j] = static_cast<float>(acc[j]);
    }
    Orthonormalize(a, rows, rank);
    // B = R^T A
    for (int c = 0; c < cols * rank; ++c) b[c] = 0;
    for (int i = 0; i < rows; ++i) {
      const float* row = r + static_cast<size_t>(i) * cols;
      for (int c = 0; c < cols; ++c) {
        for (int j = 0; j < rank; ++j) b[c * rank + j] += row[c] * a[i * rank + j];
      }
    }
  }
}

}  // namespace strata::kernels
