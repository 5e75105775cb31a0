// The sections a codec writes for a chunk shape: the single source of truth shared by the
// encoders (what to write), BitsPerElement (how big it is) and PrepareBlock (what to expect).
#pragma once

#include <cstdint>
#include <vector>

#include "common/block_writer.h"
#include "kernels/codec_spec.h"

namespace strata::kernels {

struct TensorLayout {
  bool token_groups = false;  // groups run along channels within a token (V; SKVQ's K)
  uint32_t groups = 1;      // scale groups per vector (affine); see block_operands.h
  uint32_t group_size = 0;  // elements per group
  uint32_t rank = 0;        // effective low-rank r = min(spec rank, tokens, head_dim)
  uint32_t outliers = 0;    // outliers per vector (top + bottom)
  ElemType index_type = ElemType::kUInt8;
};

struct CodecLayout {
  TensorLayout k, v;
  // K sections then V sections, each in the order: codes, scales, zero points, lowrank A,
  // lowrank B, outlier values, outlier indices (those the codec has).
  std::vector<SectionDesc> sections;
  int k_section_count = 0;
};

// The sections of one plain part (a spec without parts of its own).
CodecLayout MakeCodecLayout(const CodecSpec& spec, uint32_t tokens, uint32_t kv_heads,
                            uint32_t head_dim);

// A whole block: for a spec with parts (spec.has_parts()), a token map (kTokenBits, shared, u8
// [tokens]: the part of each token) then every non-empty part's sections in part order; for a
// plain spec, just its sections.
struct BlockPartsLayout {
  std::vector<CodecSpec> part_specs;  // spec.PartSpecs()
  std::vector<uint32_t> part_tokens;  // tokens in each part
  std::vector<CodecLayout> parts;     // each part's layout (no sections when it is empty)
  std::vector<int> first_section;     // index of each part's first section in `sections`
  bool has_map = false;
  std::vector<SectionDesc> sections;
};

// part_tokens: one count per spec.PartSpecs() entry, summing to `tokens`.
BlockPartsLayout MakeBlockLayout(const CodecSpec& spec, const std::vector<uint32_t>& part_tokens,
                                 uint32_t kv_heads, uint32_t head_dim);

// How a chunk's tokens split into parts when nothing but its position is known: sinks in chunk 0
// only, ZipCache's salient share, the rest in the main part.
std::vector<uint32_t> DefaultPartTokens(const CodecSpec& spec, uint32_t tokens,
                                        uint32_t chunk_index);

}  // namespace strata::kernels
