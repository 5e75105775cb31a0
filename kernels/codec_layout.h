// The sections a codec writes for a chunk shape: the single source of truth shared by the
// encoders (what to write), BitsPerElement (how big it is) and PrepareBlock (what to expect).
#pragma once

#include <cstdint>
#include <vector>

#include "common/block_writer.h"
#include "kernels/codec_spec.h"

namespace strata::kernels {

struct TensorLayout {
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

CodecLayout MakeCodecLayout(const CodecSpec& spec, uint32_t tokens, uint32_t kv_heads,
                            uint32_t head_dim);

}  // namespace strata::kernels
