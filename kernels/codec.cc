// The codecs' writers and the Codec class. The stages they compose live in their own files:
// reordering (SKVQ) and the head-major working form in internal/head_major.h, the affine backbone
// in internal/affine_stage.h, GEAR's outliers in internal/outlier_stage.h, its low-rank terms in
// low_rank.h, the codebook stage (CQ) in codebook.h, the precision policy (sinks, ZipCache's
// saliency) in internal/saliency_stage.h; centering (TaDA's head mean) and ZipCache's channel
// norms are WriteAffine's few lines before the backbone.
#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_writer.h"
#include "common/fp8.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/bit_pack.h"
#include "kernels/codebook.h"
#include "kernels/codec_layout.h"
#include "kernels/internal/affine_stage.h"
#include "kernels/internal/codec_simd.h"
#include "kernels/internal/head_major.h"
#include "kernels/internal/outlier_stage.h"
#include "kernels/internal/saliency_stage.h"
#include "kernels/low_rank.h"

namespace strata::kernels {
namespace {

using internal::AffineResult;
using internal::F16;
using internal::F32;
using internal::HeadMajor;
using internal::MaxAbs;
using internal::Scratch;
using internal::SourceRow;
using internal::ToHeadMajor;

// Largest magnitude the fp16 metadata can carry with headroom for rounding.
constexpr float kMetadataLimit = 60000.0f;

template <typename T>
void Put(BlockBuilder& b, int section, const std::vector<T>& v) {
  std::memcpy(b.section(section).data(), v.data(), b.section(section).size());
}

absl::Status CheckShape(const CodecSpec& s, const KvChunkView& c) {
  if (c.k == nullptr || c.v == nullptr) return absl::InvalidArgumentError("codec: null K or V");
  if (c.tokens < 1 || c.kv_heads < 1 || c.head_dim < 1 || c.tokens > kMaxBlockTokens ||
      c.kv_heads > kMaxKvHeads || c.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("codec: shape ", c.tokens, " tokens x ",
                                                   c.kv_heads, " heads x ", c.head_dim,
                                                   " dims is empty or too large"));
  }
  if (s.id != CodecId::kFp16 && s.id != CodecId::kBf16 && c.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", s.ToString(), ": head_dim ", c.head_dim, " is not a multiple of 8"));
  }
  if (s.is_codebook() && (c.head_dim / s.group) * s.k_bits % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", s.ToString(), ": ", c.head_dim / s.group, " codes of ", s.k_bits,
                     " bits per token do not fill whole bytes (head_dim ", c.head_dim, ")"));
  }
  return absl::OkStatus();
}

// Part writers: one part's K and V sections, from section `first` on; `c` is the part's tokens.
absl::Status WriteIdentity(const CodecSpec& s, const CodecLayout& layout, const KvChunkView& c,
                           BlockBuilder& b, int first) {
  const bool f16 = s.id == CodecId::kFp16;
  const float limit = f16 ? 65504.0f : INFINITY;
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, limit));
    if (f16) {
      FloatToHalf(m.x.data(), b.section_as<Half>(section), m.x.size());
    } else {
      FloatToBFloat16(m.x.data(), b.section_as<BFloat16>(section), m.x.size());
    }
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

// CQ: each token's runs of `group` channels as the index of the nearest centroid of the layer's
// codebook for that head and run (codebook.h).
absl::Status WriteCodebook(const CodecSpec& s, const CodecLayout& layout, const KvChunkView& c,
                           BlockBuilder& b, int first, const LayerCalibration* cal) {
  const int coupled = s.group, bits = s.k_bits;
  const uint32_t G = c.head_dim / coupled, K = 1u << bits;
  int section = first;
  for (const auto& [src, name, book, metric_of] :
       {std::tuple{c.k, "K", cal != nullptr ? &cal->k_codebook : nullptr,
                   cal != nullptr ? &cal->k_metric : nullptr},
        std::tuple{c.v, "V", cal != nullptr ? &cal->v_codebook : nullptr,
                   cal != nullptr ? &cal->v_metric : nullptr}}) {
    if (book == nullptr || book->size() != size_t{c.kv_heads} * c.head_dim * K) {
      return absl::FailedPreconditionError(absl::StrCat(
          "codec ", s.ToString(), ": the calibration holds no ", name, " codebooks for ",
          c.kv_heads, " heads of ", c.head_dim, " (strata calibrate makes them)"));
    }
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, kMetadataLimit));
    if (s.token_norm) {  // head-major rows [H, T, D]: one "token" per (head, token)
      NormalizeRows(m.x.data(), c.kv_heads * c.tokens, 1, c.head_dim,
                    b.section_as<uint16_t>(section + 1));
    }
    // Under the calibration's metric (LayerCalibration::k_metric, v_metric): the nearest centroid
    // by the weighted distance, found as the plain one between points and centroids both scaled.
    const std::vector<float>* metric =
        metric_of;  // by tensor, not by address (K and V may share one)
    if (metric != nullptr && metric->empty()) metric = nullptr;
    if (metric != nullptr && metric->size() != size_t{c.kv_heads} * c.head_dim) {
      return absl::FailedPreconditionError(
          absl::StrCat("codec ", s.ToString(), ": the calibration's ", name, " metric holds ",
                       metric->size(), " weights, not ", c.kv_heads, " x ", c.head_dim));
    }
    if (metric != nullptr) {
      for (uint32_t h = 0; h < c.kv_heads; ++h) {
        const float* w = metric->data() + size_t{h} * c.head_dim;
        for (uint32_t t = 0; t < c.tokens; ++t) {
          float* row = &m.at(h, t, 0);
          for (uint32_t d = 0; d < c.head_dim; ++d) row[d] *= w[d];
        }
      }
    }
    std::vector<uint8_t> codes(size_t{c.kv_heads} * c.tokens * G);
    std::vector<float> cent(size_t{K} * coupled);
    for (uint32_t h = 0; h < c.kv_heads; ++h) {
      for (uint32_t g = 0; g < G; ++g) {
        const uint16_t* src_book = &(*book)[(size_t{h} * G + g) * K * coupled];
        for (size_t e = 0; e < cent.size(); ++e) {
          cent[e] = F32(src_book[e]);
          if (metric != nullptr)
            cent[e] *= (*metric)[size_t{h} * c.head_dim + g * coupled + e % coupled];
        }
        // Head-major rows: token t's run at m.at(h, t, g * coupled), head_dim floats apart.
        CentroidSearch(cent.data(), K, coupled)
            .NearestMany(&m.at(h, 0, g * coupled), c.tokens, c.head_dim,
                         &codes[size_t{h} * c.tokens * G + g], G);
      }
    }
    PackBits(codes.data(), codes.size(), bits, b.section(section).data());
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

absl::Status WriteInt8(const CodecSpec&, const CodecLayout& layout, const KvChunkView& c,
                       BlockBuilder& b, int first) {
  const uint32_t D = c.head_dim;
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, kMetadataLimit));
    int8_t* codes = b.section_as<int8_t>(section);
    uint16_t* scales = b.section_as<uint16_t>(section + 1);
    for (size_t row = 0; row < m.x.size() / D; ++row) {
      const float* x = &m.x[row * D];
      const float amax = MaxAbs(x, D);
      scales[row] = F16(amax / 127.0f);
      const float scale = F32(scales[row]);
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;
      if (internal::HaveCodecSimd()) {
        internal::QuantizeInt8Avx2(x, D, inv, &codes[row * D]);
        continue;
      }
      for (uint32_t d = 0; d < D; ++d) {  // round half away from zero
        const float y = x[d] * inv;
        const float q = static_cast<float>(static_cast<int32_t>(y + (y >= 0 ? 0.5f : -0.5f)));
        codes[row * D + d] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

absl::Status WriteFp8(const CodecSpec&, const CodecLayout& layout, const KvChunkView& c,
                      BlockBuilder& b, int first) {
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, INFINITY));
    const bool simd = internal::HaveCodecSimd();
    const float amax = MaxAbs(m.x.data(), m.x.size());
    const float scale = amax > 0 ? amax / kFp8E4M3Max : 1.0f;
    const float inv = 1.0f / scale;
    uint8_t* codes = b.section_as<uint8_t>(section);
    if (simd) {
      internal::ScaleToFp8E4M3Avx2(m.x.data(), m.x.size(), inv, codes);
    } else {
      for (size_t i = 0; i < m.x.size(); ++i) codes[i] = FloatToFp8E4M3(m.x[i] * inv);
    }
    std::memcpy(b.section(section + 1).data(), &scale, sizeof(scale));
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

absl::Status WriteAffine(const CodecSpec& s, const CodecLayout& layout, const KvChunkView& c,
                         BlockBuilder& b, int first, const LayerCalibration* cal) {
  const uint32_t T = c.tokens, H = c.kv_heads, D = c.head_dim;
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    const bool is_k = section == first;
    const TensorLayout& tl = is_k ? layout.k : layout.v;
    // SKVQ stores channels in calibrated order.
    const std::vector<uint16_t>* perm = cal == nullptr ? nullptr
                                        : is_k         ? &cal->k_perm
                                                       : &cal->v_perm;
    STRATA_ASSIGN_OR_RETURN(
        HeadMajor m, ToHeadMajor(c, src, name, kMetadataLimit,
                                 perm != nullptr && !perm->empty() ? perm->data() : nullptr));
    const float clip = cal == nullptr ? 1.0f : is_k ? cal->k_clip : cal->v_clip;
    std::vector<uint16_t> head_mean;
    if (s.id == CodecId::kTada) {  // mean over heads (as fp16 will store it); deviations remain
      head_mean.resize(size_t{T} * D);
      if (internal::HaveCodecSimd() && D % 8 == 0) {
        internal::HeadMeanAvx2(m.x.data(), H, T, D, head_mean.data());
      } else {
        for (uint32_t t = 0; t < T; ++t) {
          for (uint32_t d = 0; d < D; ++d) {
            float sum = 0;
            for (uint32_t h = 0; h < H; ++h) sum += m.at(h, t, d);
            head_mean[size_t{t} * D + d] = F16(sum / H);
            const float mean = F32(head_mean[size_t{t} * D + d]);
            for (uint32_t h = 0; h < H; ++h) m.at(h, t, d) -= mean;
          }
        }
      }
    }
    std::vector<uint16_t> norms;
    if (s.id == CodecId::kZipCache && !is_k) {
      // Channel-separable tokenwise quantization: each channel divided by sqrt(max |x|) of the
      // part, per-token groups, the divisor multiplied back at attention.
      norms.resize(size_t{H} * D);
      if (internal::HaveCodecSimd() && D % 8 == 0) {
        internal::ChannelNormsAvx2(m.x.data(), H, T, D, norms.data());
      } else {
        for (uint32_t h = 0; h < H; ++h) {
          for (uint32_t d = 0; d < D; ++d) {
            float mx = 0;
            for (uint32_t t = 0; t < T; ++t) mx = std::max(mx, std::fabs(m.at(h, t, d)));
            norms[size_t{h} * D + d] = F16(mx > 0 ? std::sqrt(mx) : 1.0f);
            const float inv = 1.0f / F32(norms[size_t{h} * D + d]);
            for (uint32_t t = 0; t < T; ++t) m.at(h, t, d) *= inv;
          }
        }
      }
    }
    std::vector<uint8_t> mask;
    std::vector<size_t> outliers;
    std::vector<uint32_t> outlier_index;  // each outlier's token (K) or channel (V)
    if (tl.outliers > 0) {
      outliers = internal::SelectOutliers(m, is_k, tl.outliers, mask, outlier_index);
    }
    // The residual after the backbone only where GEAR takes low-rank terms or outliers from it.
    AffineResult q = internal::QuantizeAffine(m, mask,
                                              {.per_channel = !tl.token_groups,
                                               .group_size = tl.group_size,
                                               .groups = tl.groups,
                                               .bits = is_k ? s.k_bits : s.v_bits,
                                               .clip = clip,
                                               .fp8_meta = s.fp8_meta,
                                               .want_residual = tl.rank > 0 || tl.outliers > 0});

    int next = section;
    Put(b, next++, q.packed);
    if (s.fp8_meta) {
      Put(b, next++, q.scales8);
      Put(b, next++, q.zeros8);
      std::memcpy(b.section(next++).data(), q.multipliers, sizeof(q.multipliers));
    } else {
      Put(b, next++, q.scales);
      Put(b, next++, q.zeros);
    }
    if (!head_mean.empty()) Put(b, next++, head_mean);
    if (!norms.empty()) Put(b, next++, norms);
    if (tl.rank == 0 && tl.outliers == 0) {
      section += layout.k_section_count;
      continue;
    }
    // The residual after the backbone; outliers then take exactly what the backbone missed.
    Scratch<float>& residual = q.residual;
    const std::vector<Half> outlier_values = internal::TakeOutliers(outliers, residual);
    if (tl.rank > 0) {
      std::vector<float> a(size_t{T} * tl.rank), bm(size_t{D} * tl.rank);
      std::vector<Half> a16(size_t{H} * T * tl.rank), b16(size_t{H} * D * tl.rank);
      for (uint32_t h = 0; h < H; ++h) {
        LowRankApproximate(&residual[size_t{h} * T * D], static_cast<int>(T), static_cast<int>(D),
                           static_cast<int>(tl.rank), s.power_iterations,
                           /*seed=*/0x5eed0000u + h, a.data(), bm.data());
        FloatToHalf(a.data(), &a16[h * a.size()], a.size());
        FloatToHalf(bm.data(), &b16[h * bm.size()], bm.size());
      }
      Put(b, next++, a16);
      Put(b, next++, b16);
    }
    if (tl.outliers > 0) {
      Put(b, next++, outlier_values);
      // The index of each outlier within its vector: the token (K) or the channel (V).
      if (tl.index_type == ElemType::kUInt8) {
        uint8_t* idx = b.section_as<uint8_t>(next++);
        for (size_t i = 0; i < outliers.size(); ++i) {
          idx[i] = static_cast<uint8_t>(outlier_index[i]);
        }
      } else {
        uint16_t* idx = b.section_as<uint16_t>(next++);
        for (size_t i = 0; i < outliers.size(); ++i) {
          idx[i] = static_cast<uint16_t>(outlier_index[i]);
        }
      }
    }
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<Codec>> Codec::Create(
    absl::string_view text, std::shared_ptr<const Calibration> calibration) {
  STRATA_ASSIGN_OR_RETURN(CodecSpec s, CodecSpec::Parse(text));
  CodecSpec main = s;
  main.sink_tokens = 0;
  const bool for_this = calibration != nullptr && calibration->codec == main.ToString();
  if (s.needs_calibration()) {
    if (calibration == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "codec ", s.ToString(), " needs a calibration file (make one with strata calibrate)"));
    }
    if (!for_this) {
      return absl::FailedPreconditionError(absl::StrCat(
          "codec ", s.ToString(), ": the calibration was made for '", calibration->codec, "'"));
    }
  } else if (!(s.searches_layers() && for_this)) {
    calibration = nullptr;  // nothing to record
  }
  if (calibration != nullptr && s.searches_layers()) {
    // The calibration chose each layer's codec: blocks are made by (and carry) that codec.
    std::vector<std::unique_ptr<Codec>> layers;
    for (size_t l = 0; l < calibration->layers.size(); ++l) {
      const std::string& ls = calibration->layers[l].spec;
      if (ls.empty()) {
        if (s.id == CodecId::kStrata) {
          return absl::FailedPreconditionError(absl::StrCat(
              "codec ", s.ToString(), ": the calibration chose no codec for layer ", l));
        }
        layers.push_back(std::make_unique<Codec>(s, calibration));
        continue;
      }
      STRATA_ASSIGN_OR_RETURN(CodecSpec lspec, CodecSpec::Parse(ls));
      layers.push_back(std::make_unique<Codec>(lspec, calibration));
    }
    auto codec = std::make_unique<Codec>(s, calibration);
    codec->layer_codecs_ = std::move(layers);
    return codec;
  }
  switch (s.id) {
    case CodecId::kFp16:
    case CodecId::kBf16:
    case CodecId::kInt8:
    case CodecId::kFp8E4M3:
    case CodecId::kKivi:
    case CodecId::kKcvt:
    case CodecId::kGear:
    case CodecId::kGearL:
    case CodecId::kZipCache:
    case CodecId::kSkvq:
    case CodecId::kTada:
    case CodecId::kCq:
      return std::make_unique<Codec>(s, std::move(calibration));
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat("codec ", s.ToString(), " is not implemented yet"));
}

std::string Codec::LayerSpec(uint32_t layer) const {
  if (layer < layer_codecs_.size()) return layer_codecs_[layer]->spec().ToString();
  return spec_.ToString();
}

absl::StatusOr<AlignedBuffer> Codec::Encode(const KvChunkView& c, const BlockContext& ctx) const {
  STRATA_ASSIGN_OR_RETURN(BlockBuilder b, Build(c, ctx, nullptr));
  return std::move(b).Finish();
}

absl::StatusOr<size_t> Codec::EncodeInto(const KvChunkView& c, const BlockContext& ctx,
                                         const BlockAllocator& allocate) const {
  if (!allocate) return absl::InvalidArgumentError("codec: EncodeInto without an allocator");
  STRATA_ASSIGN_OR_RETURN(BlockBuilder b, Build(c, ctx, &allocate));
  return std::move(b).Seal();
}

absl::StatusOr<BlockBuilder> Codec::Build(const KvChunkView& c, const BlockContext& ctx,
                                          const BlockAllocator* allocate) const {
  if (!layer_codecs_.empty()) {
    if (ctx.layer >= layer_codecs_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("codec ", spec_.ToString(), ": layer ",
                                                     ctx.layer, " beyond the calibration's ",
                                                     layer_codecs_.size()));
    }
    return layer_codecs_[ctx.layer]->Build(c, ctx, allocate);
  }
  const CodecSpec& s = spec_;
  if (s.id == CodecId::kStrata) {
    return absl::FailedPreconditionError("codec strata: no per-layer choice (calibration)");
  }
  STRATA_RETURN_IF_ERROR(CheckShape(s, c));
  if (c.q != nullptr && (c.q_heads == 0 || c.q_heads % c.kv_heads != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codec: ", c.q_heads, " query heads are not a multiple of ", c.kv_heads, " KV heads"));
  }
  const LayerCalibration* layer_cal = nullptr;
  if (calibration_ != nullptr) {
    if (ctx.layer >= calibration_->layers.size() || calibration_->kv_heads != c.kv_heads ||
        calibration_->head_dim != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "codec ", s.ToString(), ": layer ", ctx.layer, " of ", c.kv_heads, "x", c.head_dim,
          " is not covered by the calibration (", calibration_->layers.size(), " layers of ",
          calibration_->kv_heads, "x", calibration_->head_dim, ")"));
    }
    layer_cal = &calibration_->layers[ctx.layer];
  }
  const std::vector<CodecSpec> part_specs = s.PartSpecs();
  std::vector<uint8_t> map;  // the part of each token, when the spec has parts
  std::vector<uint32_t> counts(part_specs.size(), 0);
  if (s.has_parts()) {
    map = internal::AssignParts(s, c, ctx);
    for (uint8_t p : map) ++counts[p];
  } else {
    counts[0] = c.tokens;
  }
  const BlockPartsLayout layout = MakeBlockLayout(s, counts, c.kv_heads, c.head_dim);
  const std::string text = s.ToString();  // the header views it
  BlockHeader h;
  h.codec = s.id;
  h.codec_spec = text;
  h.source_dtype = c.dtype;
  h.layer = ctx.layer;
  h.chunk_index = ctx.chunk_index;
  h.token_count = c.tokens;
  h.kv_heads = c.kv_heads;
  h.head_dim = c.head_dim;
  h.model_fingerprint = ctx.model_fingerprint;
  h.calibration_fingerprint = calibration_ != nullptr ? calibration_->fingerprint() : 0;
  STRATA_ASSIGN_OR_RETURN(
      BlockBuilder b, allocate != nullptr ? BlockBuilder::CreateIn(h, layout.sections, *allocate)
                                          : BlockBuilder::Create(h, layout.sections));
  if (layout.has_map) std::memcpy(b.section(0).data(), map.data(), map.size());
  std::vector<float> pk, pv;  // one part's tokens, gathered
  for (size_t p = 0; p < part_specs.size(); ++p) {
    if (counts[p] == 0) continue;
    KvChunkView part = c;
    part.tokens = counts[p];
    part.q = nullptr;
    if (layout.has_map) {
      const size_t row = size_t{c.kv_heads} * c.head_dim;
      pk.resize(counts[p] * row);
      pv.resize(counts[p] * row);
      size_t i = 0;
      for (uint32_t t = 0; t < c.tokens; ++t) {
        if (map[t] != p) continue;
        SourceRow(c.k, c.dtype, t * row, row, &pk[i * row]);
        SourceRow(c.v, c.dtype, t * row, row, &pv[i * row]);
        ++i;
      }
      part.k = pk.data();
      part.v = pv.data();
      part.dtype = SourceDType::kFloat32;
    }
    const CodecSpec& ps = part_specs[p];
    const CodecLayout& pl = layout.parts[p];
    const int first = layout.first_section[p];
    switch (ps.id) {
      case CodecId::kFp16:
      case CodecId::kBf16:
        STRATA_RETURN_IF_ERROR(WriteIdentity(ps, pl, part, b, first));
        break;
      case CodecId::kInt8:
        STRATA_RETURN_IF_ERROR(WriteInt8(ps, pl, part, b, first));
        break;
      case CodecId::kFp8E4M3:
        STRATA_RETURN_IF_ERROR(WriteFp8(ps, pl, part, b, first));
        break;
      case CodecId::kCq:
        STRATA_RETURN_IF_ERROR(WriteCodebook(ps, pl, part, b, first, layer_cal));
        break;
      default:
        STRATA_RETURN_IF_ERROR(
            WriteAffine(ps, pl, part, b, first, ps.id == CodecId::kSkvq ? layer_cal : nullptr));
        break;
    }
  }
  return b;
}

absl::StatusOr<double> Codec::BitsPerElement(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim,
                                             uint32_t chunk_index) const {
  const BlockPartsLayout layout =
      MakeBlockLayout(spec_, DefaultPartTokens(spec_, tokens, chunk_index), kv_heads, head_dim);
  const std::string text = spec_.ToString();
  BlockHeader h;
  h.codec = spec_.id;
  h.codec_spec = text;
  h.token_count = tokens;
  h.kv_heads = kv_heads;
  h.head_dim = head_dim;
  STRATA_ASSIGN_OR_RETURN(BlockLayout l, BlockLayout::Plan(h, layout.sections));
  return l.total_bytes() * 8.0 / (2.0 * tokens * kv_heads * head_dim);
}

}  // namespace strata::kernels
