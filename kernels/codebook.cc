#include "kernels/codebook.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "common/half.h"
#include "kernels/internal/codec_simd.h"

namespace strata::kernels {
namespace {

float Distance(const float* a, const float* b, int c) {
  float d = 0;
  for (int i = 0; i < c; ++i) d += (a[i] - b[i]) * (a[i] - b[i]);
  return d;
}

// One group's codebook from its n points (n x c), fp32 [k, c]; `w` the points' weights (null:
// 1 each).
std::vector<float> KMeans(const std::vector<float>& pts, size_t n, int c, uint32_t k,
                          std::mt19937& rng, int iterations, const float* w) {
  auto weight = [&](size_t i) { return w != nullptr ? double{w[i]} : 1.0; };
  std::vector<float> cent(size_t{k} * c, 0.0f);
  if (n == 0) return cent;
  // k-means++: each next centroid drawn with probability proportional to the squared distance
  // to the nearest one chosen so far.
  std::vector<float> nearest(n, std::numeric_limits<float>::infinity());
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  size_t pick = rng() % n;
  for (uint32_t j = 0; j < k; ++j) {
    std::copy_n(&pts[pick * c], c, &cent[size_t{j} * c]);
    double total = 0;
    for (size_t i = 0; i < n; ++i) {
      nearest[i] = std::min(nearest[i], Distance(&pts[i * c], &cent[size_t{j} * c], c));
      total += weight(i) * nearest[i];
    }
    if (total <= 0) {  // every point is a centroid already: repeat points
      pick = (pick + 1) % n;
      continue;
    }
    double r = uniform(rng) * total;
    pick = n - 1;
    for (size_t i = 0; i < n; ++i) {
      r -= weight(i) * nearest[i];
      if (r <= 0) {
        pick = i;
        break;
      }
    }
  }
  // Lloyd iterations.
  std::vector<uint32_t> assign(n, k);
  std::vector<double> sum(size_t{k} * c);
  std::vector<double> count(k);
  for (int it = 0; it < iterations; ++it) {
    bool moved = false;
    const CentroidSearch search(cent.data(), k, c);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t a = search.Nearest(&pts[i * c]);
      moved |= a != assign[i];
      assign[i] = a;
    }
    if (!moved) break;
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(count.begin(), count.end(), 0.0);
    for (size_t i = 0; i < n; ++i) {
      const double wi = weight(i);
      count[assign[i]] += wi;
      for (int d = 0; d < c; ++d) sum[size_t{assign[i]} * c + d] += wi * pts[i * c + d];
    }
    for (uint32_t j = 0; j < k; ++j) {
      if (count[j] <= 0) {  // empty (or weightless): the point worst served by its centroid
        size_t worst = 0;
        double worst_d = -1;
        for (size_t i = 0; i < n; ++i) {
          const double d = weight(i) * Distance(&pts[i * c], &cent[size_t{assign[i]} * c], c);
          if (d > worst_d) {
            worst_d = d;
            worst = i;
          }
        }
        std::copy_n(&pts[worst * c], c, &cent[size_t{j} * c]);
        continue;
      }
      for (int d = 0; d < c; ++d) {
        cent[size_t{j} * c + d] = static_cast<float>(sum[size_t{j} * c + d] / count[j]);
      }
    }
  }
  return cent;
}

}  // namespace

void NormalizeRows(float* x, uint32_t tokens, uint32_t heads, uint32_t head_dim, uint16_t* rms) {
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t h = 0; h < heads; ++h) {
      float* row = x + (size_t{t} * heads + h) * head_dim;
      double sq = 0;
      for (uint32_t d = 0; d < head_dim; ++d) sq += double{row[d]} * row[d];
      const uint16_t bits = FloatToHalfBits(static_cast<float>(std::sqrt(sq / head_dim)));
      const float r = HalfBitsToFloat(bits);
      if (rms != nullptr) rms[size_t{h} * tokens + t] = bits;
      if (r > 0) {
        for (uint32_t d = 0; d < head_dim; ++d) row[d] /= r;
      }
    }
  }
}

uint32_t NearestCentroid(const float* point, const float* centroids, uint32_t entries,
                         int coupled) {
  uint32_t best = 0;
  float best_d = std::numeric_limits<float>::infinity();
  for (uint32_t j = 0; j < entries; ++j) {
    const float d = Distance(point, centroids + size_t{j} * coupled, coupled);
    if (d < best_d) {
      best_d = d;
      best = j;
    }
  }
  return best;
}

CentroidSearch::CentroidSearch(const float* centroids, uint32_t entries, int coupled)
    : entries_(entries),
      coupled_(coupled),
      by_coordinate_(size_t{entries} * coupled),
      norm_(entries) {
  for (uint32_t j = 0; j < entries; ++j) {
    float n = 0;
    for (int d = 0; d < coupled; ++d) {
      const float x = centroids[size_t{j} * coupled + d];
      by_coordinate_[static_cast<size_t>(d) * entries + j] = x;
      n += x * x;
    }
    norm_[j] = n;
  }
}

void CentroidSearch::NearestManyPortable(const float* points, size_t n, size_t stride,
                                         uint8_t* codes, size_t out_stride) const {
  const uint32_t K = entries_;
  float m[8];
  for (size_t i = 0; i < n; ++i) {
    const float* p = points + i * stride;
    for (int d = 0; d < coupled_; ++d) m[d] = -2.0f * p[d];
    uint32_t best = 0;
    float least = std::numeric_limits<float>::infinity();
    for (uint32_t j = 0; j < K; ++j) {
      float s = norm_[j];
      for (int d = 0; d < coupled_; ++d)
        s = s + m[d] * by_coordinate_[static_cast<size_t>(d) * K + j];
      if (s < least) {
        least = s;
        best = j;
      }
    }
    codes[i * out_stride] = static_cast<uint8_t>(best);
  }
}

void CentroidSearch::NearestMany(const float* points, size_t n, size_t stride, uint8_t* codes,
                                 size_t out_stride) const {
  if (internal::HaveCodecSimd() && entries_ % 8 == 0 && entries_ <= 256 && coupled_ <= 8) {
    internal::NearestCentroidsAvx2(points, n, stride, by_coordinate_.data(), norm_.data(), entries_,
                                   static_cast<uint32_t>(coupled_), codes, out_stride);
    return;
  }
  NearestManyPortable(points, n, stride, codes, out_stride);
}

uint32_t CentroidSearch::Nearest(const float* point) const {
  uint8_t code = 0;
  NearestMany(point, 1, 0, &code, 1);
  return code;
}

std::vector<uint16_t> TrainCodebooks(const float* x, uint32_t tokens, uint32_t heads,
                                     uint32_t head_dim, int coupled, int bits, uint32_t seed,
                                     int iterations, const float* weights, const float* metric) {
  const uint32_t groups = head_dim / coupled;
  const uint32_t k = 1u << bits;
  std::vector<uint16_t> out(size_t{heads} * groups * k * coupled);
  std::vector<float> pts(size_t{tokens} * coupled);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t g = 0; g < groups; ++g) {
      const float* w =
          metric != nullptr ? metric + size_t{h} * head_dim + size_t{g} * coupled : nullptr;
      for (uint32_t t = 0; t < tokens; ++t) {
        const float* src = x + (size_t{t} * heads + h) * head_dim + size_t{g} * coupled;
        for (int i = 0; i < coupled; ++i) {
          pts[size_t{t} * coupled + i] = w != nullptr ? src[i] * w[i] : src[i];
        }
      }
      std::mt19937 rng(seed * 1000003u + h * 7919u + g);
      const std::vector<float> cent =
          KMeans(pts, tokens, coupled, k, rng, iterations,
                 weights != nullptr ? weights + size_t{h} * tokens : nullptr);
      uint16_t* dst = &out[(size_t{h} * groups + g) * k * coupled];
      for (size_t i = 0; i < cent.size(); ++i) {
        dst[i] = FloatToHalfBits(w != nullptr ? cent[i] / w[i % coupled] : cent[i]);
      }
    }
  }
  return out;
}

}  // namespace strata::kernels
