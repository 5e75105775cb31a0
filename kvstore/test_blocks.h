// Real blocks for the store's tests (kvstore_test): fp16-coded K and V whose values depend on a
// seed, their prefix keys and their store names. Test-only; no product code includes it.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "common/block_reader.h"
#include "kernels/codec.h"
#include "kvstore/block_store.h"

namespace strata::kvstore::test_blocks {

// A real block (fp16 codec) of `tokens` tokens, 2 KV heads of 64, whose values depend on `seed`.
inline AlignedBuffer MakeBlock(uint64_t model, uint32_t layer, uint32_t chunk, uint32_t seed,
                               uint32_t tokens = 64) {
  std::vector<float> k(size_t{tokens} * 2 * 64), v(k.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  for (float& x : k) x = n(rng);
  for (float& x : v) x = n(rng);
  auto codec = *kernels::Codec::Create("fp16");
  return *codec->Encode({k.data(), v.data(), SourceDType::kFloat32, tokens, 2, 64},
                        {.layer = layer, .chunk_index = chunk, .model_fingerprint = model});
}

// A distinct prefix key per `i` (and per `tag`, so that suites never share one by chance).
inline BlockHash Key(uint32_t i, uint8_t tag) {
  BlockHash h{};
  h[0] = static_cast<uint8_t>(i);
  h[1] = static_cast<uint8_t>(i >> 8);
  h[2] = static_cast<uint8_t>(i >> 16);
  h[31] = tag;
  return h;
}

// The store name of `block` under `key`.
inline BlockName Name(const AlignedBuffer& block, const BlockHash& key) {
  const BlockHeader h = BlockView::Parse(block.span())->header();
  return BlockName{h.model_fingerprint, h.codec_fingerprint, h.calibration_fingerprint, key,
                   h.layer};
}

}  // namespace strata::kvstore::test_blocks
