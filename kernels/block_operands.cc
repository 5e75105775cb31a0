#include "kernels/block_operands.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fp8.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/bit_pack.h"
#include "kernels/calibration.h"
#include "kernels/codec_layout.h"

namespace strata::kernels {
namespace {

CodeKind KindOf(CodecId id) {
  switch (id) {
    case CodecId::kFp16:
      return CodeKind::kFloat16;
    case CodecId::kBf16:
      return CodeKind::kBFloat16;
    case CodecId::kInt8:
      return CodeKind::kInt8;
    case CodecId::kFp8E4M3:
      return CodeKind::kFp8E4M3;
    case CodecId::kCq:
      return CodeKind::kCodebook;
    default:
      return CodeKind::kAffine;
  }
}

}  // namespace

namespace {

// Fills one part's operands from its sections, which begin at `i`.
absl::Status FillPart(const BlockView& block, int i, const CodecLayout& layout, BlockOperands& ops,
                      std::vector<std::shared_ptr<std::vector<uint16_t>>>& widened) {
  const uint32_t D = ops.head_dim;
  for (Tensor tensor : {Tensor::kKey, Tensor::kValue}) {
    const bool is_k = tensor == Tensor::kKey;
    TensorOperands& t = is_k ? ops.k : ops.v;
    const TensorLayout& tl = is_k ? layout.k : layout.v;
    t.kind = KindOf(ops.spec.id);
    t.bits = ElemBits(block.section(i).entry.elem);
    t.codes = block.section(i).data.data();
    t.row_bytes = static_cast<uint32_t>(PackedBytes(D, t.bits));
    ++i;
    if (t.kind == CodeKind::kCodebook) {  // the codebook comes from the calibration (below)
      t.token_groups = true;
      t.groups = tl.groups;
      t.group_size = tl.group_size;
      t.row_bytes = static_cast<uint32_t>(PackedBytes(tl.groups, t.bits));
      if (ops.spec.token_norm)
        t.scales = reinterpret_cast<const uint16_t*>(block.section(i++).data.data());
      continue;
    }
    auto u16 = [&](int idx) {
      return reinterpret_cast<const uint16_t*>(block.section(idx).data.data());
    };
    if (t.kind == CodeKind::kInt8) {
      t.scales = u16(i++);
    } else if (t.kind == CodeKind::kFp8E4M3) {
      t.tensor_scale_at = block.section(i).data.data();
      std::memcpy(&t.tensor_scale, block.section(i++).data.data(), sizeof(float));
    } else if (t.kind == CodeKind::kAffine) {
      t.token_groups = tl.token_groups;
      t.groups = tl.groups;
      t.group_size = tl.group_size;
      const int first_meta = i;
      i += 2;
      float mult[2] = {1.0f, 1.0f};
      if (ops.spec.fp8_meta) {
        t.meta_mult_at = block.section(i).data.data();
        std::memcpy(mult, block.section(i++).data.data(), sizeof(mult));
        for (float m : mult) {
          if (!(m > 0.0f && m < 1e30f)) {
            return absl::DataLossError(absl::StrCat("block: ", TensorName(tensor),
                                                    " fp8 metadata multiplier ", m,
                                                    " is not a positive finite number"));
          }
        }
      }
      for (int which = 0; which < 2; ++which) {
        const uint16_t** dst = which == 0 ? &t.scales : &t.zeros;
        const SectionView& sv = block.section(first_meta + which);
        if (sv.entry.elem != ElemType::kFp8E4M3) {
          *dst = reinterpret_cast<const uint16_t*>(sv.data.data());
          continue;
        }
        (which == 0 ? t.scales_fp8 : t.zeros_fp8) = sv.data.data();
        auto w = std::make_shared<std::vector<uint16_t>>(sv.entry.count);
        for (uint32_t e = 0; e < sv.entry.count; ++e) {
          const float x = Fp8E4M3ToFloat(sv.data[e]) * mult[which];
          if (!(std::fabs(x) <= 65504.0f)) {
            return absl::DataLossError(absl::StrCat("block: ", TensorName(tensor),
                                                    " fp8 scale/zero ", e, " is ", x,
                                                    ", not a finite fp16 value"));
          }
          (*w)[e] = FloatToHalfBits(x);
        }
        *dst = w->data();
        widened.push_back(std::move(w));
      }
      if (ops.spec.id == CodecId::kTada) t.head_mean = u16(i++);
      if (ops.spec.id == CodecId::kZipCache && !is_k) t.channel_norm = u16(i++);
      if (tl.rank > 0) {
        t.rank = tl.rank;
        t.lowrank_a = u16(i++);
        t.lowrank_b = u16(i++);
      }
      if (ops.spec.outlier_percent > 0) {  // the sections exist, possibly empty
        t.outliers_per_vector = tl.outliers;
        t.outlier_values = u16(i++);
        const SectionView& idx = block.section(i++);
        const uint32_t limit = is_k ? ops.tokens : D;
        for (uint32_t j = 0; j < idx.entry.count; ++j) {
          const uint32_t v = tl.index_type == ElemType::kUInt8
                                 ? idx.data[j]
                                 : uint32_t{idx.data[2 * j]} | (uint32_t{idx.data[2 * j + 1]} << 8);
          if (v >= limit) {
            return absl::DataLossError(absl::StrCat("block: ", TensorName(tensor), " outlier ", j,
                                                    " has index ", v, ", beyond ", limit));
          }
        }
        if (tl.index_type == ElemType::kUInt8) {
          t.outlier_index8 = idx.data.data();
        } else {
          t.outlier_index16 = reinterpret_cast<const uint16_t*>(idx.data.data());
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PreparedBlock> PrepareBlock(const BlockView& block,
                                           const Calibration* calibration) {
  const BlockHeader& h = block.header();
  absl::StatusOr<CodecSpec> spec = CodecSpec::Parse(h.codec_spec);
  if (!spec.ok()) return spec.status();
  if (spec->id != h.codec) {
    return absl::DataLossError(absl::StrCat("block: codec id ", CodecIdName(h.codec),
                                            " does not match its spec '", h.codec_spec, "'"));
  }
  if (spec->id == CodecId::kStrata) {
    return absl::DataLossError("block: a strata block must carry its layer's own codec spec");
  }
  if (spec->needs_calibration() && h.calibration_fingerprint == 0) {
    return absl::DataLossError(
        absl::StrCat("block: codec ", h.codec_spec, " needs a calibration, the header names none"));
  }
  const LayerCalibration* layer_cal = nullptr;
  if (h.calibration_fingerprint != 0) {
    if (calibration == nullptr || calibration->fingerprint() != h.calibration_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block: made with calibration ", absl::Hex(h.calibration_fingerprint, absl::kZeroPad16),
          ", loaded: ",
          calibration == nullptr
              ? std::string("none")
              : absl::StrCat(absl::Hex(calibration->fingerprint(), absl::kZeroPad16))));
    }
    if (h.layer >= calibration->layers.size() || calibration->kv_heads != h.kv_heads ||
        calibration->head_dim != h.head_dim) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block: layer ", h.layer, " of ", h.kv_heads, "x", h.head_dim,
          " is not covered by its calibration (", calibration->layers.size(), " layers of ",
          calibration->kv_heads, "x", calibration->head_dim, ")"));
    }
    layer_cal = &calibration->layers[h.layer];
  }
  PreparedBlock out;
  out.spec = *spec;
  out.tokens = h.token_count;
  out.kv_heads = h.kv_heads;
  out.head_dim = h.head_dim;
  if (spec->id != CodecId::kFp16 && spec->id != CodecId::kBf16 && h.head_dim % 8 != 0) {
    return absl::DataLossError(absl::StrCat("block: codec ", h.codec_spec, " with head_dim ",
                                            h.head_dim, ", not a multiple of 8"));
  }
  const std::vector<CodecSpec> part_specs = spec->PartSpecs();
  std::vector<uint32_t> counts(part_specs.size(), 0);
  std::vector<std::vector<uint32_t>> positions(part_specs.size());
  if (spec->has_parts()) {
    if (block.section_count() < 1 || block.section(0).entry.kind != SectionKind::kTokenBits ||
        block.section(0).entry.tensor != Tensor::kShared ||
        block.section(0).entry.elem != ElemType::kUInt8 ||
        block.section(0).entry.count != h.token_count) {
      return absl::DataLossError(absl::StrCat("block: codec ", h.codec_spec,
                                              " needs a token map (token_bits/shared/u8 x",
                                              h.token_count, ") as its first section"));
    }
    const uint8_t* map = block.section(0).data.data();
    for (uint32_t t = 0; t < h.token_count; ++t) {
      if (map[t] >= part_specs.size()) {
        return absl::DataLossError(absl::StrCat("block: token ", t, " is in part ", int{map[t]},
                                                ", the codec has ", part_specs.size()));
      }
      ++counts[map[t]];
      positions[map[t]].push_back(t);
    }
  } else {
    counts[0] = h.token_count;
  }
  const BlockPartsLayout layout = MakeBlockLayout(*spec, counts, h.kv_heads, h.head_dim);
  if (block.section_count() != static_cast<int>(layout.sections.size())) {
    return absl::DataLossError(absl::StrCat("block: codec ", h.codec_spec, " writes ",
                                            layout.sections.size(), " sections, block has ",
                                            block.section_count()));
  }
  for (int i = 0; i < block.section_count(); ++i) {
    const SectionEntry& got = block.section(i).entry;
    const SectionDesc& want = layout.sections[i];
    if (got.kind != want.kind || got.tensor != want.tensor || got.elem != want.elem ||
        got.count != want.count) {
      return absl::DataLossError(
          absl::StrCat("block: section ", i, " is ", SectionKindName(got.kind), "/",
                       TensorName(got.tensor), "/", ElemTypeName(got.elem), " x", got.count,
                       " but codec ", h.codec_spec, " writes ", SectionKindName(want.kind), "/",
                       TensorName(want.tensor), "/", ElemTypeName(want.elem), " x", want.count));
    }
  }
  for (size_t p = 0; p < part_specs.size(); ++p) {
    if (counts[p] == 0) continue;
    BlockOperands ops;
    ops.spec = part_specs[p];
    ops.tokens = counts[p];
    ops.kv_heads = h.kv_heads;
    ops.head_dim = h.head_dim;
    STRATA_RETURN_IF_ERROR(
        FillPart(block, layout.first_section[p], layout.parts[p], ops, out.widened));
    if (ops.k.head_mean != nullptr) {
      auto mean = std::make_shared<BlockOperands>();
      mean->spec.id = CodecId::kFp16;
      mean->tokens = ops.tokens;
      mean->kv_heads = 1;
      mean->head_dim = ops.head_dim;
      for (auto [dst, src] : {std::pair{&mean->k, ops.k.head_mean}, std::pair{&mean->v, ops.v.head_mean}}) {
        dst->kind = CodeKind::kFloat16;
        dst->bits = 16;
        dst->codes = reinterpret_cast<const uint8_t*>(src);
        dst->row_bytes = 2 * ops.head_dim;
      }
      ops.mean_ops = std::move(mean);
    }
    if (part_specs[p].id == CodecId::kCq) {
      const size_t want = size_t{h.kv_heads} * h.head_dim * (size_t{1} << part_specs[p].k_bits);
      if (layer_cal == nullptr || layer_cal->k_codebook.size() != want ||
          layer_cal->v_codebook.size() != want) {
        return absl::FailedPreconditionError(
            absl::StrCat("block: codec ", h.codec_spec, ": its calibration holds no codebooks of ",
                         want, " entries for layer ", h.layer));
      }
      if ((h.head_dim / part_specs[p].group) * part_specs[p].k_bits % 8 != 0) {
        return absl::DataLossError(absl::StrCat("block: codec ", h.codec_spec, " with head_dim ",
                                                h.head_dim, ": its code rows are not whole bytes"));
      }
      ops.k.codebook = layer_cal->k_codebook.data();
      ops.v.codebook = layer_cal->v_codebook.data();
    }
    if (layer_cal != nullptr && part_specs[p].id == CodecId::kSkvq) {
      if (!layer_cal->k_perm.empty()) ops.k.channel_perm = layer_cal->k_perm.data();
      if (!layer_cal->v_perm.empty()) ops.v.channel_perm = layer_cal->v_perm.data();
    }
    out.parts.push_back(ops);
    if (!spec->has_parts()) {
      positions[p].resize(counts[p]);
      for (uint32_t t = 0; t < counts[p]; ++t) positions[p][t] = t;
    }
    out.part_tokens.push_back(std::move(positions[p]));
  }
  return out;
}

absl::Status DecodeOperandsRef(const BlockOperands& ops, float* k, float* v) {
  const uint32_t T = ops.tokens, H = ops.kv_heads, D = ops.head_dim;
  std::vector<float> hm(size_t{H} * T * D);  // head-major scratch
  for (int which = 0; which < 2; ++which) {
    const bool is_k = which == 0;
    const TensorOperands& t = is_k ? ops.k : ops.v;
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t tok = 0; tok < T; ++tok) {
        const size_t row = size_t{h} * T + tok;
        const uint8_t* codes = t.codes + row * t.row_bytes;
        for (uint32_t d = 0; d < D; ++d) {
          float x = 0;
          switch (t.kind) {
            case CodeKind::kFloat16: {
              uint16_t b;
              std::memcpy(&b, codes + 2 * d, 2);
              x = HalfBitsToFloat(b);
              break;
            }
            case CodeKind::kBFloat16: {
              uint16_t b;
              std::memcpy(&b, codes + 2 * d, 2);
              x = BFloat16BitsToFloat(b);
              break;
            }
            case CodeKind::kInt8:
              x = static_cast<int8_t>(codes[d]) * HalfBitsToFloat(t.scales[row]);
              break;
            case CodeKind::kFp8E4M3:
              x = Fp8E4M3ToFloat(codes[d]) * t.tensor_scale;
              break;
            case CodeKind::kCodebook: {
              const uint32_t g = d / t.group_size, entries = 1u << t.bits;
              const uint32_t code = UnpackBit(codes, g, t.bits);
              x = HalfBitsToFloat(
                  t.codebook[((size_t{h} * t.groups + g) * entries + code) * t.group_size +
                             d % t.group_size]);
              if (t.scales != nullptr) x *= HalfBitsToFloat(t.scales[row]);
              break;
            }
            case CodeKind::kAffine: {
              const size_t p = !t.token_groups
                                   ? (size_t{h} * t.groups + tok / t.group_size) * D + d
                                   : row * t.groups + d / t.group_size;
              x = HalfBitsToFloat(t.zeros[p]) +
                  static_cast<float>(UnpackBit(codes, d, t.bits)) * HalfBitsToFloat(t.scales[p]);
              break;
            }
          }
          if (t.head_mean != nullptr) x += HalfBitsToFloat(t.head_mean[size_t{tok} * D + d]);
          if (t.rank > 0) {
            const uint16_t* a = t.lowrank_a + row * t.rank;
            const uint16_t* b = t.lowrank_b + (size_t{h} * D + d) * t.rank;
            for (uint32_t r = 0; r < t.rank; ++r)
              x += HalfBitsToFloat(a[r]) * HalfBitsToFloat(b[r]);
          }
          hm[row * D + d] = x;
        }
      }
      // Outliers are added to the element they correct.
      const uint32_t n = t.outliers_per_vector;
      if (n > 0) {
        const uint32_t vectors = is_k ? D : T;
        for (uint32_t vec = 0; vec < vectors; ++vec) {
          for (uint32_t j = 0; j < n; ++j) {
            const size_t e = (size_t{h} * vectors + vec) * n + j;
            const uint32_t idx = t.OutlierIndex(e);
            const size_t pos =
                is_k ? (size_t{h} * T + idx) * D + vec : (size_t{h} * T + vec) * D + idx;
            hm[pos] += HalfBitsToFloat(t.outlier_values[e]);
          }
        }
      }
      if (t.channel_norm != nullptr) {  // multiplies everything above
        for (uint32_t tok = 0; tok < T; ++tok) {
          for (uint32_t d = 0; d < D; ++d) {
            hm[(size_t{h} * T + tok) * D + d] *= HalfBitsToFloat(t.channel_norm[size_t{h} * D + d]);
          }
        }
      }
    }
    float* out = is_k ? k : v;
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t tok = 0; tok < T; ++tok) {
        float* dst = out + (size_t{tok} * H + h) * D;
        const float* src = &hm[(size_t{h} * T + tok) * D];
        if (t.channel_perm == nullptr) {
          std::memcpy(dst, src, D * sizeof(float));
        } else {  // back to the original channel order
          for (uint32_t d = 0; d < D; ++d) dst[t.channel_perm[size_t{h} * D + d]] = src[d];
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DecodePreparedRef(const PreparedBlock& block, float* k, float* v) {
  const size_t row = size_t{block.kv_heads} * block.head_dim;
  std::vector<float> pk, pv;
  for (size_t p = 0; p < block.parts.size(); ++p) {
    const BlockOperands& ops = block.parts[p];
    pk.resize(ops.tokens * row);
    pv.resize(ops.tokens * row);
    STRATA_RETURN_IF_ERROR(DecodeOperandsRef(ops, pk.data(), pv.data()));
    for (uint32_t i = 0; i < ops.tokens; ++i) {
      const uint32_t t = block.part_tokens[p][i];
      std::memcpy(k + t * row, &pk[i * row], row * sizeof(float));
      std::memcpy(v + t * row, &pv[i * row], row * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeBlockRef(const BlockView& block, float* k, float* v,
                            const Calibration* calibration) {
  STRATA_ASSIGN_OR_RETURN(PreparedBlock prepared, PrepareBlock(block, calibration));
  return DecodePreparedRef(prepared, k, v);
}

}  // namespace strata::kernels
