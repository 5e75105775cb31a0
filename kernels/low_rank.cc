#include "kernels/low_rank.h"

#include <cmath>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/internal/codec_simd.h"

namespace strata::kernels {
namespace {

// sum_i m[i][a] * m[i][b] over the rows of m [rows, rank], in double: four partial sums (rows
// i mod 4), so that four chains of additions run at once rather than one of `rows`.
double ColumnDot(const float* m, int rows, int rank, int a, int b) {
  double s[4] = {0, 0, 0, 0};
  int i = 0;
  for (; i + 4 <= rows; i += 4) {
    for (int u = 0; u < 4; ++u) s[u] += double{m[(i + u) * rank + a]} * m[(i + u) * rank + b];
  }
  for (; i < rows; ++i) s[0] += double{m[i * rank + a]} * m[i * rank + b];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Orthonormalizes the columns of m [rows, rank] in place; a column that vanishes becomes zero.
void Orthonormalize(float* m, int rows, int rank) {
  for (int j = 0; j < rank; ++j) {
    for (int p = 0; p < j; ++p) {
      const double dot = ColumnDot(m, rows, rank, j, p);
      for (int i = 0; i < rows; ++i) m[i * rank + j] -= static_cast<float>(dot) * m[i * rank + p];
    }
    const double norm = std::sqrt(ColumnDot(m, rows, rank, j, j));
    const float inv = norm > 1e-20 ? static_cast<float>(1.0 / norm) : 0.0f;
    for (int i = 0; i < rows; ++i) m[i * rank + j] *= inv;
  }
}

// The random start B^T [rank, cols] for a seed, orthonormalized: the same for every call with
// that seed (GEAR's seeds are per head), so made once per thread. At most a few hundred kept.
const std::vector<float>& RandomStart(int cols, int rank, uint64_t seed) {
  struct Key {
    int cols, rank;
    uint64_t seed;
    bool operator<(const Key& o) const {
      return std::tie(cols, rank, seed) < std::tie(o.cols, o.rank, o.seed);
    }
  };
  thread_local std::map<Key, std::vector<float>> starts;
  const Key key{cols, rank, seed};
  if (auto it = starts.find(key); it != starts.end()) return it->second;
  if (starts.size() >= 512) starts.clear();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> b(static_cast<size_t>(cols) * rank);
  for (float& x : b) x = normal(rng);
  Orthonormalize(b.data(), cols, rank);
  std::vector<float> bt(b.size());
  for (int c = 0; c < cols; ++c) {
    for (int j = 0; j < rank; ++j) bt[static_cast<size_t>(j) * cols + c] = b[c * rank + j];
  }
  return starts.emplace(key, std::move(bt)).first->second;
}

}  // namespace

void LowRankApproximate(const float* r, int rows, int cols, int rank, int iterations, uint64_t seed,
                        float* a, float* b) {
  // Work on transposed factors ([rank, rows], [rank, cols]) so the inner loops run along
  // contiguous rows of R and vectorize.
  std::vector<float> at(static_cast<size_t>(rank) * rows);
  std::vector<float> bt = RandomStart(cols, rank, seed);
  if (internal::HaveCodecSimd()) {  // the same sums in the same order, 8 lanes at a time
    // R^T, once for every iteration (a buffer per thread: every element is written here, so
    // it is not zeroed per call).
    thread_local std::vector<float> rt;
    if (rt.size() < static_cast<size_t>(rows) * cols) rt.resize(static_cast<size_t>(rows) * cols);
    internal::TransposeAvx2(r, cols, rows, cols, rt.data(), rows);
    for (int it = 0; it < iterations; ++it) {
      internal::LowRankRbAvx2(rt.data(), rows, cols, bt.data(), rank, at.data());  // A = R B
      for (int i = 0; i < rows; ++i) {
        for (int j = 0; j < rank; ++j) a[i * rank + j] = at[static_cast<size_t>(j) * rows + i];
      }
      Orthonormalize(a, rows, rank);
      internal::LowRankRtaAvx2(r, rows, cols, a, rank, bt.data());  // B = R^T A
    }
  } else {
    // R^T, so that A = R B is a sum of scaled rows (axpy) rather than dot products: plain loops
    // vectorize without reassociating float sums.
    std::vector<float> rt(static_cast<size_t>(rows) * cols);
    for (int i = 0; i < rows; ++i) {
      for (int c = 0; c < cols; ++c)
        rt[static_cast<size_t>(c) * rows + i] = r[static_cast<size_t>(i) * cols + c];
    }
    for (int it = 0; it < iterations; ++it) {
      std::fill(at.begin(), at.end(), 0.0f);
      for (int c = 0; c < cols; ++c) {  // A = R B
        const float* col = &rt[static_cast<size_t>(c) * rows];
        for (int j = 0; j < rank; ++j) {
          const float w = bt[static_cast<size_t>(j) * cols + c];
          float* aj = &at[static_cast<size_t>(j) * rows];
          for (int i = 0; i < rows; ++i) aj[i] += w * col[i];
        }
      }
      for (int i = 0; i < rows; ++i) {
        for (int j = 0; j < rank; ++j) a[i * rank + j] = at[static_cast<size_t>(j) * rows + i];
      }
      Orthonormalize(a, rows, rank);
      std::fill(bt.begin(), bt.end(), 0.0f);
      for (int i = 0; i < rows; ++i) {  // B = R^T A
        const float* row = r + static_cast<size_t>(i) * cols;
        for (int j = 0; j < rank; ++j) {
          const float w = a[i * rank + j];
          float* bj = &bt[static_cast<size_t>(j) * cols];
          for (int c = 0; c < cols; ++c) bj[c] += w * row[c];
        }
      }
    }
  }
  for (int c = 0; c < cols; ++c) {
    for (int j = 0; j < rank; ++j) b[c * rank + j] = bt[static_cast<size_t>(j) * cols + c];
  }
}

}  // namespace strata::kernels
