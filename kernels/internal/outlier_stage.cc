#include "kernels/internal/outlier_stage.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/internal/codec_simd.h"

namespace strata::kernels::internal {

// One pass per vector keeps the current extremes in small sorted lists; most elements cost two
// compares.
std::vector<size_t> SelectOutliers(const HeadMajor& x, bool per_channel, uint32_t n,
                                   std::vector<uint8_t>& mask, std::vector<uint32_t>& index) {
  const uint32_t T = x.t, H = x.h, D = x.d;
  const uint32_t vectors = per_channel ? D : T;
  const uint32_t k = n / 2;
  struct Entry {
    float v;
    uint32_t i;
  };
  std::vector<size_t> positions(size_t{H} * vectors * n);
  index.resize(positions.size());
  mask.assign(x.x.size(), 0);
  if (k == 0) {
    index.clear();
    return {};
  }
  // bot[vec*k ...] ascending: the k smallest so far, bot[k-1] the largest of them.
  // top[vec*k ...] ascending: the k largest so far, top[0] the smallest of them.
  std::vector<Entry> bot(size_t{vectors} * k), top(size_t{vectors} * k);
  auto offer = [&](uint32_t vec, float v, uint32_t i) {
    Entry* b = &bot[size_t{vec} * k];
    if (v < b[k - 1].v) {  // indices rise, so an equal value never beats an earlier one here
      uint32_t p = k - 1;
      for (; p > 0 && b[p - 1].v > v; --p) b[p] = b[p - 1];
      b[p] = {v, i};
    }
    Entry* t = &top[size_t{vec} * k];
    if (v >= t[0].v) {  // equal value, later index: larger in (value, index) order
      uint32_t p = 0;
      for (; p + 1 < k && t[p + 1].v <= v; ++p) t[p] = t[p + 1];
      t[p] = {v, i};
    }
  };
  // With AVX2, a vector pass first finds the elements that pass a vector's current thresholds
  // (bot[k - 1], top[0]); only those are offered, in the same order, so the lists are the same.
  // For k <= 8 (D a multiple of 8), the thresholds are first set to their final values, the
  // k-th smallest and largest of each vector (ColumnExtremesAvx2, RowExtremesAvx2): then little
  // more than the outliers themselves is offered. An element equal to a final threshold is
  // offered too (lo is raised by one ulp, as candidates are < lo or >= hi): the lists break such
  // ties by index.
  const bool simd = HaveCodecSimd();
  const bool final_thresholds = simd && k <= 8 && D % 8 == 0;
  std::vector<float> lo_thr, hi_thr;
  std::vector<uint32_t> cand(D);
  for (uint32_t h = 0; h < H; ++h) {
    std::fill(bot.begin(), bot.end(), Entry{INFINITY, 0});
    std::fill(top.begin(), top.end(), Entry{-INFINITY, 0});
    if (per_channel && final_thresholds) {
      lo_thr.resize(D);
      hi_thr.resize(D);
      ColumnExtremesAvx2(&x.x[size_t{h} * T * D], T, D, k, lo_thr.data(), hi_thr.data());
      for (float& lo : lo_thr) lo = std::nextafter(lo, INFINITY);
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        const uint32_t nc =
            OutlierCandidatesAvx2(row, D, lo_thr.data(), hi_thr.data(), cand.data());
        for (uint32_t c = 0; c < nc; ++c) offer(cand[c], row[cand[c]], t);
      }
    } else if (!per_channel && final_thresholds) {
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        float lo, hi;
        RowExtremesAvx2(row, D, k, &lo, &hi);
        const uint32_t nc =
            OutlierCandidatesScalarAvx2(row, D, std::nextafter(lo, INFINITY), hi, cand.data());
        for (uint32_t c = 0; c < nc; ++c) offer(t, row[cand[c]], cand[c]);
      }
    } else if (per_channel) {
      if (simd) {
        lo_thr.assign(D, INFINITY);
        hi_thr.assign(D, -INFINITY);
      }
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        if (!simd) {
          for (uint32_t d = 0; d < D; ++d) offer(d, row[d], t);
          continue;
        }
        const uint32_t nc =
            OutlierCandidatesAvx2(row, D, lo_thr.data(), hi_thr.data(), cand.data());
        for (uint32_t c = 0; c < nc; ++c) {
          const uint32_t d = cand[c];
          offer(d, row[d], t);
          lo_thr[d] = bot[size_t{d} * k + k - 1].v;
          hi_thr[d] = top[size_t{d} * k].v;
        }
      }
    } else {
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        if (!simd) {
          for (uint32_t d = 0; d < D; ++d) offer(t, row[d], d);
          continue;
        }
        // The row is the vector: its thresholds tighten along it, so candidates are taken 16
        // elements at a time against the thresholds so far.
        for (uint32_t d0 = 0; d0 < D; d0 += 16) {
          const uint32_t nc = OutlierCandidatesScalarAvx2(row + d0, std::min<uint32_t>(16, D - d0),
                                                          bot[size_t{t} * k + k - 1].v,
                                                          top[size_t{t} * k].v, cand.data());
          for (uint32_t c = 0; c < nc; ++c) offer(t, row[d0 + cand[c]], d0 + cand[c]);
        }
      }
    }
    for (uint32_t vec = 0; vec < vectors; ++vec) {
      size_t* out = &positions[(size_t{h} * vectors + vec) * n];
      uint32_t* in = &index[(size_t{h} * vectors + vec) * n];
      auto pos = [&](uint32_t i) {
        return per_channel ? (size_t{h} * T + i) * D + vec : (size_t{h} * T + vec) * D + i;
      };
      for (uint32_t e = 0; e < k; ++e) {
        in[e] = bot[size_t{vec} * k + e].i;
        in[k + e] = top[size_t{vec} * k + e].i;
        out[e] = pos(in[e]);
        out[k + e] = pos(in[k + e]);
      }
    }
  }
  for (size_t p : positions) mask[p] = 1;
  return positions;
}

std::vector<Half> TakeOutliers(const std::vector<size_t>& positions, Scratch<float>& residual) {
  // (The fp16 conversions by the array functions: F16C where present, the same bits.)
  std::vector<Half> values(positions.size());
  std::vector<float> picked(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) picked[i] = residual[positions[i]];
  FloatToHalf(picked.data(), values.data(), picked.size());
  HalfToFloat(values.data(), picked.data(), picked.size());
  for (size_t i = 0; i < positions.size(); ++i) residual[positions[i]] -= picked[i];
  return values;
}

}  // namespace strata::kernels::internal
