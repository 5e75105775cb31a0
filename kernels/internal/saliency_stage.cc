#include "kernels/internal/saliency_stage.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels/internal/codec_simd.h"
#include "kernels/internal/head_major.h"
#include "kernels/internal/vector_exp.h"

namespace strata::kernels::internal {
namespace {

// ZipCache's token saliency: the normalized attention score of each token under probe queries
// (the p % most recent tokens' queries plus p % drawn at random from the rest, deterministic per
// layer and chunk): for every probe query and query head, softmax over the tokens it can see
// (itself and earlier tokens of the chunk), summed per token, divided by the number of probes
// that can see it. Without queries, falls back to how far each token lies from the chunk's
// per-channel means (K and V, in channel standard deviations): outlier tokens are what low bits
// hurt most.
std::vector<double> Saliency(const CodecSpec& s, const KvChunkView& c, const BlockContext& ctx) {
  const uint32_t T = c.tokens, H = c.kv_heads, D = c.head_dim;
  const size_t row = size_t{H} * D;
  std::vector<float> k(T * row);
  for (uint32_t t = 0; t < T; ++t) SourceRow(c.k, c.dtype, t * row, row, &k[t * row]);
  std::vector<double> sal(T, 0.0);
  if (c.q == nullptr) {
    std::vector<float> v(T * row);
    for (uint32_t t = 0; t < T; ++t) SourceRow(c.v, c.dtype, t * row, row, &v[t * row]);
    for (const std::vector<float>* x : {&k, &v}) {
      for (size_t e = 0; e < row; ++e) {
        double mean = 0, var = 0;
        for (uint32_t t = 0; t < T; ++t) mean += (*x)[t * row + e];
        mean /= T;
        for (uint32_t t = 0; t < T; ++t) var += std::pow((*x)[t * row + e] - mean, 2);
        const double inv = var > 0 ? 1.0 / (var / T) : 0.0;
        for (uint32_t t = 0; t < T; ++t) sal[t] += std::pow((*x)[t * row + e] - mean, 2) * inv;
      }
    }
    return sal;
  }
  const uint32_t QH = c.q_heads, G = QH / H;
  const uint32_t per =
      std::max<uint32_t>(1, static_cast<uint32_t>(std::floor(T * s.probe_percent / 100.0 + 0.5)));
  std::vector<uint32_t> probes;
  for (uint32_t i = T - std::min(per, T); i < T; ++i) probes.push_back(i);
  if (T > per) {  // random probes among the earlier tokens, without repetition
    std::vector<uint32_t> rest(T - per);
    std::iota(rest.begin(), rest.end(), 0u);
    uint64_t state = 0x9e3779b97f4a7c15ull ^ (uint64_t{ctx.layer} << 32) ^ ctx.chunk_index;
    const uint32_t n = std::min<uint32_t>(per, static_cast<uint32_t>(rest.size()));
    for (uint32_t i = 0; i < n; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const uint32_t j = i + static_cast<uint32_t>((state >> 33) % (rest.size() - i));
      std::swap(rest[i], rest[j]);
      probes.push_back(rest[i]);
    }
  }
  std::vector<uint32_t> seen_by(T, 0);
  // dots[g][t]: q . k_t in float, one fused multiply-add per channel in ascending order, for the
  // G query heads of one KV head. With AVX2 eight tokens to a vector from the head's keys
  // transposed (kt [D][T]): the same chains, so the same saliency. The softmax is in double.
  const bool simd = HaveCodecSimd();
  std::vector<float> kt;
  std::vector<float> dots(size_t{G} * T), p(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (simd) {
    kt.resize(size_t{H} * D * T);
    for (uint32_t h = 0; h < H; ++h) {
      TransposeAvx2(&k[size_t{h} * D], row, T, D, &kt[size_t{h} * D * T], T);
    }
  }
  for (uint32_t i : probes) {
    for (uint32_t t = 0; t <= i; ++t) ++seen_by[t];
    for (uint32_t h = 0; h < H; ++h) {
      const float* q0 = c.q + (size_t{i} * QH + size_t{h} * G) * D;
      if (simd) {
        ProbeDotsAvx2(&kt[size_t{h} * D * T], T, D, q0, G, i + 1, dots.data());
      } else {
        for (uint32_t g = 0; g < G; ++g) {
          const float* q = q0 + size_t{g} * D;
          for (uint32_t t = 0; t <= i; ++t) {
            const float* kv = &k[t * row + size_t{h} * D];
            float dot = 0.0f;
            for (uint32_t d = 0; d < D; ++d) dot = std::fma(q[d], kv[d], dot);
            dots[size_t{g} * T + t] = dot;
          }
        }
      }
      for (uint32_t g = 0; g < G; ++g) {  // query head h * G + g, in order
        const float* dot = &dots[size_t{g} * T];
        if (simd) {
          ProbeWeightsAvx2(dot, i + 1, scale, p.data());
        } else {
          float mx = -INFINITY;
          for (uint32_t t = 0; t <= i; ++t) mx = std::max(mx, dot[t] * scale);
          for (uint32_t t = 0; t <= i; ++t) p[t] = ExpScalar(dot[t] * scale - mx);
        }
        double sum = 0;
        for (uint32_t t = 0; t <= i; ++t) sum += p[t];
        const double inv = 1.0 / sum;
        for (uint32_t t = 0; t <= i; ++t) sal[t] += p[t] * inv;
      }
    }
  }
  for (uint32_t t = 0; t < T; ++t) sal[t] = seen_by[t] > 0 ? sal[t] / seen_by[t] : 0.0;
  return sal;
}

}  // namespace

std::vector<uint8_t> AssignParts(const CodecSpec& s, const KvChunkView& c,
                                 const BlockContext& ctx) {
  const uint32_t T = c.tokens;
  uint8_t next = 0;
  const uint8_t sink_part = s.sink_tokens > 0 ? next++ : 0;
  const bool zip = s.id == CodecId::kZipCache && s.salient_percent > 0;
  const uint8_t hi_part = zip ? next++ : 0;
  const uint8_t main_part = next;
  std::vector<uint8_t> map(T, main_part);
  uint32_t sinks = 0;
  if (s.sink_tokens > 0 && ctx.chunk_index == 0) {
    sinks = std::min<uint32_t>(static_cast<uint32_t>(s.sink_tokens), T);
    std::fill(map.begin(), map.begin() + sinks, sink_part);
  }
  if (zip && sinks < T) {
    const std::vector<double> sal = Saliency(s, c, ctx);
    std::vector<uint32_t> order(T - sinks);
    std::iota(order.begin(), order.end(), sinks);
    const uint32_t n = std::min<uint32_t>(static_cast<uint32_t>(order.size()),
                                          s.SalientTokens(static_cast<uint32_t>(order.size())));
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](uint32_t a, uint32_t b) {
      return sal[a] != sal[b] ? sal[a] > sal[b] : a < b;
    });
    for (uint32_t i = 0; i < n; ++i) map[order[i]] = hi_part;
  }
  return map;
}

}  // namespace strata::kernels::internal
