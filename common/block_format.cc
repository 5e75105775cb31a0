#include "common/block_format.h"

#include <algorithm>
#include <array>
#include <bit>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata {

int ElemBits(ElemType t) {
  switch (t) {
    case ElemType::kUInt1:
      return 1;
    case ElemType::kUInt2:
      return 2;
    case ElemType::kUInt3:
      return 3;
    case ElemType::kUInt4:
      return 4;
    case ElemType::kUInt5:
      return 5;
    case ElemType::kUInt6:
      return 6;
    case ElemType::kUInt7:
      return 7;
    case ElemType::kUInt8:
      return 8;
    case ElemType::kInt8:
      return 8;
    case ElemType::kUInt16:
      return 16;
    case ElemType::kUInt32:
      return 32;
    case ElemType::kFloat16:
      return 16;
    case ElemType::kBFloat16:
      return 16;
    case ElemType::kFloat32:
      return 32;
    case ElemType::kFp8E4M3:
      return 8;
    case ElemType::kFp8E5M2:
      return 8;
  }
  return 0;
}

const char* CodecIdName(CodecId id) {
  switch (id) {
    case CodecId::kFp16:
      return "fp16";
    case CodecId::kBf16:
      return "bf16";
    case CodecId::kInt8:
      return "int8";
    case CodecId::kFp8E4M3:
      return "fp8e4m3";
    case CodecId::kKivi:
      return "kivi";
    case CodecId::kKcvt:
      return "kcvt";
    case CodecId::kGear:
      return "gear";
    case CodecId::kGearL:
      return "gearl";
    case CodecId::kZipCache:
      return "zipcache";
    case CodecId::kSkvq:
      return "skvq";
    case CodecId::kTada:
      return "tada";
    case CodecId::kStrata:
      return "strata";
    case CodecId::kCq:
      return "cq";
  }
  return "?";
}

const char* SourceDTypeName(SourceDType t) {
  switch (t) {
    case SourceDType::kFloat32:
      return "float32";
    case SourceDType::kFloat16:
      return "float16";
    case SourceDType::kBFloat16:
      return "bfloat16";
  }
  return "?";
}

const char* SectionKindName(SectionKind k) {
  switch (k) {
    case SectionKind::kCodes:
      return "codes";
    case SectionKind::kScales:
      return "scales";
    case SectionKind::kZeroPoints:
      return "zero_points";
    case SectionKind::kLowRankA:
      return "lowrank_a";
    case SectionKind::kLowRankB:
      return "lowrank_b";
    case SectionKind::kOutlierValues:
      return "outlier_values";
    case SectionKind::kOutlierIndices:
      return "outlier_indices";
    case SectionKind::kFullPrecisionValues:
      return "fullprec_values";
    case SectionKind::kFullPrecisionTokens:
      return "fullprec_tokens";
    case SectionKind::kHeadMean:
      return "head_mean";
    case SectionKind::kChannelNormalizers:
      return "channel_normalizers";
    case SectionKind::kTokenBits:
      return "token_bits";
    case SectionKind::kCodesPer2:
      return "codes_per_2";
    case SectionKind::kCodesPer4:
      return "codes_per_4";
    case SectionKind::kCodesPer8:
      return "codes_per_8";
  }
  return "?";
}

uint32_t ElementsPerCode(SectionKind k) {
  switch (k) {
    case SectionKind::kCodes:
      return 1;
    case SectionKind::kCodesPer2:
      return 2;
    case SectionKind::kCodesPer4:
      return 4;
    case SectionKind::kCodesPer8:
      return 8;
    default:
      return 0;
  }
}

const char* TensorName(Tensor t) {
  switch (t) {
    case Tensor::kKey:
      return "K";
    case Tensor::kValue:
      return "V";
    case Tensor::kShared:
      return "shared";
  }
  return "?";
}

const char* ElemTypeName(ElemType t) {
  switch (t) {
    case ElemType::kUInt1:
      return "u1";
    case ElemType::kUInt2:
      return "u2";
    case ElemType::kUInt3:
      return "u3";
    case ElemType::kUInt4:
      return "u4";
    case ElemType::kUInt5:
      return "u5";
    case ElemType::kUInt6:
      return "u6";
    case ElemType::kUInt7:
      return "u7";
    case ElemType::kUInt8:
      return "u8";
    case ElemType::kInt8:
      return "i8";
    case ElemType::kUInt16:
      return "u16";
    case ElemType::kUInt32:
      return "u32";
    case ElemType::kFloat16:
      return "f16";
    case ElemType::kBFloat16:
      return "bf16";
    case ElemType::kFloat32:
      return "f32";
    case ElemType::kFp8E4M3:
      return "f8e4m3";
    case ElemType::kFp8E5M2:
      return "f8e5m2";
  }
  return "?";
}

bool IsKnownCodecId(uint16_t v) { return v >= 1 && v <= static_cast<uint16_t>(CodecId::kCq); }
bool IsKnownSourceDType(uint8_t v) { return v >= 1 && v <= 3; }
bool IsKnownSectionKind(uint8_t v) {
  return v >= 1 && v <= static_cast<uint8_t>(SectionKind::kCodesPer8);
}
bool IsKnownTensor(uint8_t v) { return v <= 2; }
bool IsKnownElemType(uint8_t v) { return ElemBits(static_cast<ElemType>(v)) != 0; }

uint64_t SectionBytes(ElemType t, uint64_t count) {
  return (count * static_cast<uint64_t>(ElemBits(t)) + 7) / 8;
}

namespace {

bool IsIntegerType(ElemType t) {
  return t == ElemType::kUInt8 || t == ElemType::kUInt16 || t == ElemType::kUInt32;
}

bool IsFloatType(ElemType t) {
  return t == ElemType::kFloat16 || t == ElemType::kBFloat16 || t == ElemType::kFloat32 ||
         t == ElemType::kFp8E4M3 || t == ElemType::kFp8E5M2;
}

std::string Describe(int i, const SectionEntry& s) {
  return absl::StrFormat("section %d (%s, %s)", i, SectionKindName(s.kind), TensorName(s.tensor));
}

// Per-tensor (K, V, shared) element totals of each kind.
struct KindTotals {
  std::array<std::array<uint64_t, 16>, 3> count{};
  std::array<std::array<int, 16>, 3> sections{};
  uint64_t& at(Tensor t, SectionKind k) { return count[static_cast<int>(t)][static_cast<int>(k)]; }
  int& n(Tensor t, SectionKind k) { return sections[static_cast<int>(t)][static_cast<int>(k)]; }
};

}  // namespace

absl::Status ValidateBlockStructure(const BlockHeader& h, absl::Span<const SectionEntry> sections,
                                    uint64_t data_begin, uint64_t total_bytes) {
  auto fail = [](auto&&... parts) {
    return absl::DataLossError(absl::StrCat("block: ", parts...));
  };
  if (!IsKnownCodecId(static_cast<uint16_t>(h.codec))) {
    return fail("unknown codec id ", static_cast<int>(h.codec));
  }
  if (!IsKnownSourceDType(static_cast<uint8_t>(h.source_dtype))) {
    return fail("unknown source dtype ", static_cast<int>(h.source_dtype));
  }
  if (h.token_count < 1 || h.token_count > kMaxBlockTokens) {
    return fail("token count ", h.token_count, " outside [1, ", kMaxBlockTokens, "]");
  }
  if (h.kv_heads < 1 || h.kv_heads > kMaxKvHeads) {
    return fail("kv heads ", h.kv_heads, " outside [1, ", kMaxKvHeads, "]");
  }
  if (h.head_dim < 1 || h.head_dim > kMaxHeadDim) {
    return fail("head dim ", h.head_dim, " outside [1, ", kMaxHeadDim, "]");
  }
  const uint64_t elements = h.elements_per_tensor();
  if (elements > UINT32_MAX) {
    return fail("tokens x heads x head dim = ", elements, " exceeds 2^32 - 1");
  }
  if (h.codec_spec.empty() || h.codec_spec.size() > kMaxCodecSpecBytes) {
    return fail("codec spec length ", h.codec_spec.size(), " outside [1, ", kMaxCodecSpecBytes,
                "]");
  }
  for (size_t i = 0; i < h.codec_spec.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(h.codec_spec[i]);
    if (c < 0x21 || c > 0x7e) {
      return fail("codec spec byte ", i, " is 0x", absl::Hex(c), ", not printable ASCII");
    }
  }
  if (sections.empty() || sections.size() > static_cast<size_t>(kMaxSections)) {
    return fail("section count ", sections.size(), " outside [1, ", kMaxSections, "]");
  }
  if (total_bytes > kMaxBlockBytes) {
    return fail("total size ", total_bytes, " exceeds the limit of ", kMaxBlockBytes);
  }

  KindTotals totals;
  for (size_t i = 0; i < sections.size(); ++i) {
    const SectionEntry& s = sections[i];
    if (!IsKnownSectionKind(static_cast<uint8_t>(s.kind))) {
      return fail("section ", i, " has unknown kind ", static_cast<int>(s.kind));
    }
    if (!IsKnownTensor(static_cast<uint8_t>(s.tensor))) {
      return fail("section ", i, " has unknown tensor ", static_cast<int>(s.tensor));
    }
    if (!IsKnownElemType(static_cast<uint8_t>(s.elem))) {
      return fail("section ", i, " has unknown element type ", static_cast<int>(s.elem));
    }
    const std::string what = Describe(static_cast<int>(i), s);
    if (!std::has_single_bit(s.alignment) || s.alignment < kMinSectionAlignment ||
        s.alignment > kMaxSectionAlignment) {
      return fail(what, ": alignment ", s.alignment, " is not a power of two in [",
                  kMinSectionAlignment, ", ", kMaxSectionAlignment, "]");
    }
    if (s.offset % s.alignment != 0) {
      return fail(what, ": offset ", s.offset, " is not a multiple of its alignment ", s.alignment);
    }
    if (s.offset < data_begin) {
      return fail(what, ": offset ", s.offset, " lies inside the header (data begins at ",
                  data_begin, ")");
    }
    if (uint64_t{s.offset} + s.length > total_bytes) {
      return fail(what, ": offset ", s.offset, " + length ", s.length, " exceeds block size ",
                  total_bytes);
    }
    if (s.length != SectionBytes(s.elem, s.count)) {
      return fail(what, ": length ", s.length, " but ", s.count, " elements of ",
                  ElemTypeName(s.elem), " take ", SectionBytes(s.elem, s.count), " bytes");
    }
    const bool index_kind =
        s.kind == SectionKind::kOutlierIndices || s.kind == SectionKind::kFullPrecisionTokens;
    if (index_kind && !IsIntegerType(s.elem)) {
      return fail(what, ": index sections need u8/u16/u32 elements, not ", ElemTypeName(s.elem));
    }
    const bool value_kind = s.kind == SectionKind::kOutlierValues ||
                            s.kind == SectionKind::kFullPrecisionValues ||
                            s.kind == SectionKind::kLowRankA || s.kind == SectionKind::kLowRankB ||
                            s.kind == SectionKind::kHeadMean;
    if (value_kind && !IsFloatType(s.elem)) {
      return fail(what, ": needs a floating-point element type, not ", ElemTypeName(s.elem));
    }
    if (s.tensor == Tensor::kShared &&
        (ElementsPerCode(s.kind) > 0 || s.kind == SectionKind::kFullPrecisionValues)) {
      return fail(what, ": codes and full-precision values belong to K or V, not shared");
    }
    totals.at(s.tensor, s.kind) += s.count;
    totals.n(s.tensor, s.kind) += 1;
  }

  // Canonical placement: sections in table order, each at the first offset its alignment
  // allows after the previous one, the block ending with the last. One content, one byte form.
  uint64_t pos = data_begin;
  for (size_t i = 0; i < sections.size(); ++i) {
    const SectionEntry& s = sections[i];
    const uint64_t expected = (pos + s.alignment - 1) / s.alignment * s.alignment;
    if (s.offset != expected) {
      return fail(Describe(static_cast<int>(i), s), " at offset ", s.offset, ", expected ",
                  expected, " (sections are packed in table order)");
    }
    pos = uint64_t{s.offset} + s.length;
  }
  if (pos != total_bytes) {
    return fail("sections end at ", pos, " but the block is ", total_bytes, " bytes");
  }

  const uint64_t hd = uint64_t{h.kv_heads} * h.head_dim;
  for (Tensor t : {Tensor::kKey, Tensor::kValue}) {
    const char* tn = TensorName(t);
    const uint64_t fp_values = totals.at(t, SectionKind::kFullPrecisionValues);
    uint64_t codes = 0;
    for (SectionKind k : {SectionKind::kCodes, SectionKind::kCodesPer2, SectionKind::kCodesPer4,
                          SectionKind::kCodesPer8}) {
      codes += totals.at(t, k) * ElementsPerCode(k);
    }
    const uint64_t covered = codes + fp_values;
    if (covered != elements) {
      return fail(tn, ": codes (", codes, ") plus full-precision values (", fp_values, ") cover ",
                  covered, " elements, but tokens x heads x head dim = ", elements);
    }
    if (fp_values % hd != 0) {
      return fail(tn, ": ", fp_values, " full-precision values are not whole tokens of ", hd);
    }
    if (totals.at(t, SectionKind::kFullPrecisionTokens) != fp_values / hd) {
      return fail(tn, ": ", fp_values / hd, " full-precision tokens but ",
                  totals.at(t, SectionKind::kFullPrecisionTokens), " token indices");
    }
    if (totals.at(t, SectionKind::kOutlierValues) != totals.at(t, SectionKind::kOutlierIndices)) {
      return fail(tn, ": ", totals.at(t, SectionKind::kOutlierValues), " outlier values but ",
                  totals.at(t, SectionKind::kOutlierIndices), " outlier indices");
    }
    const int na = totals.n(t, SectionKind::kLowRankA);
    const int nb = totals.n(t, SectionKind::kLowRankB);
    if (na != nb || na > 1) {
      return fail(tn, ": low-rank factors must come as one A and one B section, found ", na,
                  " A and ", nb, " B");
    }
    if (na == 1) {
      const uint64_t a = totals.at(t, SectionKind::kLowRankA);
      const uint64_t b = totals.at(t, SectionKind::kLowRankB);
      // A covers the tokens of the part that has the factors (all of them, or fewer in a
      // block with parts).
      const uint64_t r = b / hd;
      const uint64_t hr = uint64_t{h.kv_heads} * r;
      if (a == 0 || b % hd != 0 || r == 0 || a % hr != 0 || a / hr > h.token_count) {
        return fail(tn, ": low-rank factors of ", a, " and ", b,
                    " elements are not heads x n x r and heads x head dim x r for one r >= 1 and "
                    "n <= tokens");
      }
    }
  }
  for (SectionKind k : {SectionKind::kLowRankA, SectionKind::kLowRankB, SectionKind::kOutlierValues,
                        SectionKind::kOutlierIndices, SectionKind::kFullPrecisionTokens}) {
    if (totals.n(Tensor::kShared, k) != 0) {
      return fail(SectionKindName(k), " sections belong to K or V, not shared");
    }
  }
  return absl::OkStatus();
}

}  // namespace strata
