// Synthetic KV with the structure real models' caches show, for tests and benchmarks when no
// model is at hand (bench and tests also run codecs on a real model's KV once model/ exists):
//  - keys: a low-dimensional latent per token mixed into channels, a per-channel bias, a few
//    outlier channels 10-50x larger than the rest, and RoPE applied over channel pairs;
//  - values: Gaussian per token with a per-token scale spread over ~an order of magnitude;
//  - ~1.5% of positions (and position 0) with massive activations, 4-8x larger K and V.
// Deterministic given the seed. Layout [tokens, kv_heads, head_dim], fp32.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/calibration.h"
#include "kernels/codec_spec.h"

namespace strata::kernels {

struct SyntheticKv {
  uint32_t tokens = 0, kv_heads = 0, head_dim = 0;
  std::vector<float> k, v;
};

// `position0` is the absolute position of the first token (RoPE angle).
SyntheticKv MakeSyntheticKv(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim, uint64_t seed,
                            uint32_t position0 = 0);

// A stand-in calibration of layer 0 for codecs that need one (SKVQ, CQ; for tests and
// benchmarks), for `spec` without its sinks. SKVQ: random channel orders per head (std::shuffle
// with std::mt19937(seed)), clipping at 0.95 (K) and 0.9 (V) — not what calibration would learn:
// the orders carry no information. CQ: codebooks learned on 512 tokens of synthetic KV (another
// seed than the tests' own KV).
std::shared_ptr<Calibration> MakeSyntheticCalibration(const CodecSpec& spec, uint32_t kv_heads,
                                                      uint32_t head_dim, uint64_t seed);

}  // namespace strata::kernels
