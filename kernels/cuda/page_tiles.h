// How the paged decode kernels stage a page (paged_decode.h): a KV head's slice of TileTokens()
// tokens at a time, its parts gathered from the page's sections (the block format's, read in
// place) and packed one after another in shared memory, where the kernels' arithmetic reads them.
// Host and device code: the CPU tests check the gathering against the CPU codec's blocks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/paged_decode.h"

namespace strata::kernels::cuda {

// One KV head's slice of a page as staged: `tokens` tokens, key groups of `k_group` tokens (a
// slice inside a longer key group is one group), parts each 16-byte aligned.
struct TileLayout {
  PageFormat format = PageFormat::kFp16;
  int head_dim = 128;
  int tokens = 64;
  int key_bits = 4, value_bits = 4;
  int k_group = 32, v_group = 32;
  int tiles_per_page = 1;

  STRATA_HOST_DEVICE explicit TileLayout(const PagedKvLayout& L)
      : format(L.format),
        head_dim(L.head_dim),
        tokens(L.TileTokens()),
        key_bits(L.key_bits),
        value_bits(L.value_bits),
        k_group(L.k_group < L.TileTokens() ? L.k_group : L.TileTokens()),
        v_group(L.v_group),
        tiles_per_page(L.page_tokens / L.TileTokens()) {}

  // Offsets inside the staged slice: affine key codes [tokens][head_dim * key_bits / 8], key
  // scales [tokens / k_group][head_dim] half, key zeros (same), value codes
  // [tokens][head_dim * value_bits / 8], value scales [tokens][head_dim / v_group] half, value
  // zeros (same); fp16: K [tokens][head_dim] half then V at FpValues().
  STRATA_HOST_DEVICE size_t KeyCodes() const { return 0; }
  STRATA_HOST_DEVICE size_t KeyScales() const {
    return Align16(static_cast<size_t>(tokens) * head_dim * key_bits / 8);
  }
  STRATA_HOST_DEVICE size_t KeyZeros() const { return KeyScales() + KeyMetaBytes(); }
  STRATA_HOST_DEVICE size_t ValueCodes() const { return KeyZeros() + KeyMetaBytes(); }
  STRATA_HOST_DEVICE size_t ValueScales() const {
    return ValueCodes() + Align16(static_cast<size_t>(tokens) * head_dim * value_bits / 8);
  }
  STRATA_HOST_DEVICE size_t ValueZeros() const { return ValueScales() + ValueMetaBytes(); }
  STRATA_HOST_DEVICE size_t FpValues() const {
    return Align16(static_cast<size_t>(tokens) * head_dim * 2);
  }
  // Bytes of one staged slice.
  STRATA_HOST_DEVICE size_t HeadBytes() const {
    if (format == PageFormat::kFp16) return 2 * FpValues();
    return ValueZeros() + ValueMetaBytes();
  }
  STRATA_HOST_DEVICE size_t KeyMetaBytes() const {
    return Align16(static_cast<size_t>(tokens / k_group) * head_dim * 2);
  }
  STRATA_HOST_DEVICE size_t ValueMetaBytes() const {
    return Align16(static_cast<size_t>(tokens) * (head_dim / v_group) * 2);
  }
};

// One part of KV head h's slice `sub` of a page: where it starts in the page, where it goes in
// the staged slice, and its bytes (multiples of 16 for a valid layout). Parts of an fp16 page: 0
// K, 1 V; of an affine page: 0 key codes, 1 key scales, 2 key zeros, 3 value codes, 4 value
// scales, 5 value zeros. Computed part by part from the layout alone (a kernel parameter), so
// that a kernel keeps none of it in registers between slices.
struct TilePart {
  size_t src = 0;
  int dst = 0;
  int bytes = 0;
};

STRATA_HOST_DEVICE inline int PartCount(const PagedKvLayout& L) {
  return L.format == PageFormat::kFp16 ? 2 : 6;
}

STRATA_HOST_DEVICE inline TilePart PartOf(const PagedKvLayout& L, int part, int h, int sub) {
  const TileLayout T(L);
  const size_t t0 = static_cast<size_t>(sub) * T.tokens;
  const size_t D = static_cast<size_t>(L.head_dim);
  TilePart p;
  if (L.format == PageFormat::kFp16) {
    p.src = (part == 0 ? L.KeyCodesOf(h) : L.ValueCodesOf(h)) + t0 * D * 2;
    p.dst = part == 0 ? 0 : static_cast<int>(T.FpValues());
    p.bytes = static_cast<int>(T.tokens * D * 2);
    return p;
  }
  switch (part) {
    case 0:
      p.src = L.KeyCodesOf(h) + t0 * (D * L.key_bits / 8);
      p.dst = static_cast<int>(T.KeyCodes());
      p.bytes = static_cast<int>(T.tokens * (D * L.key_bits / 8));
      break;
    case 1:
    case 2:  // the slice's key groups: from its first (a slice inside a longer group: that one)
      p.src = (part == 1 ? L.KeyScalesOf(h) : L.KeyZerosOf(h)) + t0 / L.k_group * D * 2;
      p.dst = static_cast<int>(part == 1 ? T.KeyScales() : T.KeyZeros());
      p.bytes = static_cast<int>(T.tokens / T.k_group * D * 2);
      break;
    case 3:
      p.src = L.ValueCodesOf(h) + t0 * (D * L.value_bits / 8);
      p.dst = static_cast<int>(T.ValueCodes());
      p.bytes = static_cast<int>(T.tokens * (D * L.value_bits / 8));
      break;
    default:
      p.src = (part == 4 ? L.ValueScalesOf(h) : L.ValueZerosOf(h)) + t0 * (D / L.v_group * 2);
      p.dst = static_cast<int>(part == 4 ? T.ValueScales() : T.ValueZeros());
      p.bytes = static_cast<int>(T.tokens * (D / L.v_group * 2));
      break;
  }
  return p;
}

}  // namespace strata::kernels::cuda
