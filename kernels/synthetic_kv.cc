#include "kernels/synthetic_kv.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kernels/codebook.h"

namespace strata::kernels {

SyntheticKv MakeSyntheticKv(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim, uint64_t seed,
                            uint32_t position0) {
  SyntheticKv kv;
  kv.tokens = tokens;
  kv.kv_heads = kv_heads;
  kv.head_dim = head_dim;
  const size_t n = size_t{tokens} * kv_heads * head_dim;
  kv.k.resize(n);
  kv.v.resize(n);
  constexpr int kLatent = 8;
  for (uint32_t h = 0; h < kv_heads; ++h) {
    // Per-head structure is fixed by (seed, head) so that chunks of one sequence agree.
    std::mt19937_64 head_rng(seed * 1000003u + h);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> mix(size_t{head_dim} * kLatent), bias(head_dim), magnitude(head_dim);
    for (float& m : mix) m = normal(head_rng) / std::sqrt(float{kLatent});
    for (uint32_t d = 0; d < head_dim; ++d) {
      bias[d] = 0.5f * normal(head_rng);
      magnitude[d] = std::exp(0.3f * normal(head_rng));
      if (head_rng() % 100 < 4) {  // ~4% outlier channels, 10-50x
        magnitude[d] *= 10.0f + static_cast<float>(head_rng() % 41);
      }
    }
    std::mt19937_64 tok_rng(seed * 7919u + h * 104729u + position0);
    std::lognormal_distribution<float> token_scale(0.0f, 0.6f);
    std::vector<float> latent(kLatent), raw(head_dim);
    for (uint32_t t = 0; t < tokens; ++t) {
      for (float& z : latent) z = normal(tok_rng);
      for (uint32_t d = 0; d < head_dim; ++d) {
        float x = bias[d] + 0.3f * normal(tok_rng);
        for (int j = 0; j < kLatent; ++j) x += mix[d * kLatent + j] * latent[j];
        raw[d] = x * magnitude[d];
      }
      // ~1.5% of positions carry massive activations (attention-sink-like tokens): 4-8x
      // larger K and V. The same positions in every head, as in real models.
      const uint64_t ph = (uint64_t{position0} + t) * 0x9e3779b97f4a7c15ull;
      const float massive =
          (ph >> 58) == 0 || position0 + t == 0 ? 4.0f + static_cast<float>((ph >> 40) % 5) : 1.0f;
      for (float& x : raw) x *= massive;
      float* k = &kv.k[(size_t{t} * kv_heads + h) * head_dim];
      const float pos = static_cast<float>(position0 + t);
      for (uint32_t d = 0; d + 1 < head_dim; d += 2) {  // RoPE over (2i, 2i+1)
        const float theta = pos * std::pow(10000.0f, -static_cast<float>(d) / head_dim);
        const float c = std::cos(theta), s = std::sin(theta);
        k[d] = raw[d] * c - raw[d + 1] * s;
        k[d + 1] = raw[d] * s + raw[d + 1] * c;
      }
      if (head_dim % 2) k[head_dim - 1] = raw[head_dim - 1];
      float* v = &kv.v[(size_t{t} * kv_heads + h) * head_dim];
      const float scale = token_scale(tok_rng) * massive;
      for (uint32_t d = 0; d < head_dim; ++d) v[d] = scale * normal(tok_rng);
    }
  }
  return kv;
}

std::shared_ptr<Calibration> MakeSyntheticCalibration(const CodecSpec& spec, uint32_t kv_heads,
                                                      uint32_t head_dim, uint64_t seed) {
  auto c = std::make_shared<Calibration>();
  CodecSpec main = spec;
  main.sink_tokens = 0;
  c->codec = main.ToString();
  c->kv_heads = kv_heads;
  c->head_dim = head_dim;
  LayerCalibration l;
  if (spec.is_codebook()) {  // codebooks learned on synthetic KV of the same shape
    SyntheticKv kv = MakeSyntheticKv(512, kv_heads, head_dim, seed ^ 0x5eed, 0);
    if (spec.token_norm) {
      NormalizeRows(kv.k.data(), kv.tokens, kv_heads, head_dim, nullptr);
      NormalizeRows(kv.v.data(), kv.tokens, kv_heads, head_dim, nullptr);
    }
    l.k_codebook = TrainCodebooks(kv.k.data(), kv.tokens, kv_heads, head_dim, spec.group,
                                  spec.k_bits, static_cast<uint32_t>(seed), 10);
    l.v_codebook = TrainCodebooks(kv.v.data(), kv.tokens, kv_heads, head_dim, spec.group,
                                  spec.v_bits, static_cast<uint32_t>(seed) + 1, 10);
    c->layers.push_back(std::move(l));
    return c;
  }
  std::mt19937 rng(seed);
  for (std::vector<uint16_t>* perm : {&l.k_perm, &l.v_perm}) {
    for (uint32_t h = 0; h < kv_heads; ++h) {
      std::vector<uint16_t> p(head_dim);
      std::iota(p.begin(), p.end(), uint16_t{0});
      std::shuffle(p.begin(), p.end(), rng);
      perm->insert(perm->end(), p.begin(), p.end());
    }
  }
  l.k_clip = 0.95f;
  l.v_clip = 0.9f;
  c->layers.push_back(l);
  return c;
}

}  // namespace strata::kernels
