#include "kernels/codec_layout.h"

#include <algorithm>
#include <cmath>

namespace strata::kernels {
namespace {

ElemType CodeType(const CodecSpec& s, int bits) {
  switch (s.id) {
    case CodecId::kFp16:
      return ElemType::kFloat16;
    case CodecId::kBf16:
      return ElemType::kBFloat16;
    case CodecId::kInt8:
      return ElemType::kInt8;
    case CodecId::kFp8E4M3:
      return ElemType::kFp8E4M3;
    default:
      return static_cast<ElemType>(bits);  // kUInt2 == 2, ... kUInt8 == 8
  }
}

// Outliers per vector of `len`: s/2 % on each side, rounded, and at least one per side (a spec
// that asks for outliers gets some: s1 on a 64-wide head is 0.32 per side, which used to round
// to none and silently made GEAR's outliers disappear).
uint32_t OutlierCount(double percent, uint32_t len) {
  const uint32_t per_side =
      std::max<uint32_t>(1, static_cast<uint32_t>(std::floor(len * percent / 200.0 + 0.5)));
  return 2 * std::min(per_side, len / 2);
}

}  // namespace

CodecLayout MakeCodecLayout(const CodecSpec& s, uint32_t t, uint32_t h, uint32_t d) {
  CodecLayout out;
  const uint32_t n = t * h * d;
  for (Tensor tensor : {Tensor::kKey, Tensor::kValue}) {
    const bool is_k = tensor == Tensor::kKey;
    TensorLayout& tl = is_k ? out.k : out.v;
    const int bits = is_k ? s.k_bits : s.v_bits;
    if (s.is_codebook()) {  // one code of `bits` per group of `group` channels, per token
      tl.token_groups = true;
      tl.group_size = static_cast<uint32_t>(s.group);
      tl.groups = d / tl.group_size;
      const SectionKind kind = s.group == 2   ? SectionKind::kCodesPer2
                               : s.group == 4 ? SectionKind::kCodesPer4
                                              : SectionKind::kCodesPer8;
      out.sections.push_back({kind, tensor, CodeType(s, bits), h * t * tl.groups, 64});
      if (s.token_norm)
        out.sections.push_back({SectionKind::kScales, tensor, ElemType::kFloat16, h * t});
      if (is_k) out.k_section_count = static_cast<int>(out.sections.size());
      continue;
    }
    out.sections.push_back({SectionKind::kCodes, tensor, CodeType(s, bits), n, 64});
    if (s.id == CodecId::kInt8) {
      out.sections.push_back({SectionKind::kScales, tensor, ElemType::kFloat16, h * t});
    } else if (s.id == CodecId::kFp8E4M3) {
      out.sections.push_back({SectionKind::kScales, tensor, ElemType::kFloat32, 1});
    } else if (s.is_affine()) {
      // K groups run along tokens (per channel), V groups along channels (per token); SKVQ's
      // K is grouped like V.
      tl.token_groups = !is_k || s.k_token_groups();
      const uint32_t len = tl.token_groups ? d : t;
      tl.group_size = s.group == 0 ? len : std::min<uint32_t>(s.group, len);
      tl.groups = (len + tl.group_size - 1) / tl.group_size;
      const uint32_t count = tl.token_groups ? h * t * tl.groups : h * tl.groups * d;
      const ElemType meta = s.fp8_meta ? ElemType::kFp8E4M3 : ElemType::kFloat16;
      out.sections.push_back({SectionKind::kScales, tensor, meta, count});
      out.sections.push_back({SectionKind::kZeroPoints, tensor, meta, count});
      if (s.fp8_meta) {  // the fp32 multipliers of the fp8 scales and zero points
        out.sections.push_back({SectionKind::kScales, tensor, ElemType::kFloat32, 2});
      }
      if (s.id == CodecId::kTada) {  // the mean over heads, per token
        out.sections.push_back({SectionKind::kHeadMean, tensor, ElemType::kFloat16, t * d});
      }
      if (s.id == CodecId::kZipCache && !is_k) {  // channel-separable tokenwise V
        out.sections.push_back({SectionKind::kChannelNormalizers, tensor, ElemType::kFloat16, h * d});
      }
      if (s.rank > 0) {
        tl.rank = std::min<uint32_t>({static_cast<uint32_t>(s.rank), t, d});
        out.sections.push_back(
            {SectionKind::kLowRankA, tensor, ElemType::kFloat16, h * t * tl.rank});
        out.sections.push_back(
            {SectionKind::kLowRankB, tensor, ElemType::kFloat16, h * d * tl.rank});
      }
      if (s.outlier_percent > 0) {
        tl.outliers = OutlierCount(s.outlier_percent, is_k ? t : d);
        tl.index_type = (is_k ? t : d) <= 256 ? ElemType::kUInt8 : ElemType::kUInt16;
        const uint32_t count = (is_k ? h * d : h * t) * tl.outliers;
        out.sections.push_back({SectionKind::kOutlierValues, tensor, ElemType::kFloat16, count});
        out.sections.push_back({SectionKind::kOutlierIndices, tensor, tl.index_type, count});
      }
    }
    if (is_k) out.k_section_count = static_cast<int>(out.sections.size());
  }
  return out;
}

BlockPartsLayout MakeBlockLayout(const CodecSpec& spec, const std::vector<uint32_t>& part_tokens,
                                 uint32_t kv_heads, uint32_t head_dim) {
  BlockPartsLayout out;
  out.part_specs = spec.PartSpecs();
  out.part_tokens = part_tokens;
  out.has_map = spec.has_parts();
  uint32_t tokens = 0;
  for (uint32_t n : part_tokens) tokens += n;
  if (out.has_map) {
    out.sections.push_back({SectionKind::kTokenBits, Tensor::kShared, ElemType::kUInt8, tokens});
  }
  for (size_t p = 0; p < out.part_specs.size(); ++p) {
    out.first_section.push_back(static_cast<int>(out.sections.size()));
    const uint32_t n = p < part_tokens.size() ? part_tokens[p] : 0;
    out.parts.push_back(n == 0 ? CodecLayout{}
                               : MakeCodecLayout(out.part_specs[p], n, kv_heads, head_dim));
    out.sections.insert(out.sections.end(), out.parts.back().sections.begin(),
                        out.parts.back().sections.end());
  }
  return out;
}

std::vector<uint32_t> DefaultPartTokens(const CodecSpec& spec, uint32_t tokens,
                                        uint32_t chunk_index) {
  std::vector<uint32_t> out;
  uint32_t rest = tokens;
  if (spec.sink_tokens > 0) {
    const uint32_t sinks =
        chunk_index == 0 ? std::min<uint32_t>(static_cast<uint32_t>(spec.sink_tokens), tokens) : 0;
    out.push_back(sinks);
    rest -= sinks;
  }
  if (spec.id == CodecId::kZipCache && spec.salient_percent > 0) {
    const uint32_t salient = std::min(rest, spec.SalientTokens(rest));
    out.push_back(salient);
    rest -= salient;
  }
  out.push_back(rest);
  return out;
}

}  // namespace strata::kernels
