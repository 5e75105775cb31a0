#include "kernels/cuda/block_pages.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/block_operands.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"

namespace strata::kernels::cuda {
namespace {

absl::Status Unsupported(const CodecSpec& spec, absl::string_view why) {
  return absl::UnimplementedError(absl::StrCat("GPU pages: ", spec.ToString(), " blocks: ", why));
}

// The offset of `p` (a section's data) in the block, or an error when it is not inside the block
// (metadata the operands widened elsewhere: not readable in place).
absl::StatusOr<uint32_t> OffsetOf(const BlockView& block, const CodecSpec& spec, const void* p,
                                  absl::string_view what) {
  const uint8_t* b = block.bytes().data();
  const uint8_t* x = static_cast<const uint8_t*>(p);
  if (x == nullptr || x < b || x >= b + block.bytes().size()) {
    return Unsupported(spec,
                       absl::StrCat(what, " are not stored in the block as the GPU reads them"));
  }
  return static_cast<uint32_t>(x - b);
}

// The layout of a page the specialized kernels read (fp16, or KIVI codes of 2 or 4 bits without
// extra terms), from the block and its operands; kUnimplemented naming what they lack otherwise.
absl::StatusOr<PagedKvLayout> FastPageLayoutFor(const BlockView& block,
                                                const PreparedBlock& prepared) {
  const CodecSpec& spec = prepared.spec;
  if (prepared.parts.size() != 1 || prepared.parts[0].tokens != prepared.tokens) {
    return Unsupported(spec, "no parts (sinks, mixed precision) in GPU pages yet");
  }
  const BlockOperands& ops = prepared.parts[0];
  PagedKvLayout L;
  L.kv_heads = static_cast<int>(ops.kv_heads);
  L.head_dim = static_cast<int>(ops.head_dim);
  L.page_tokens = static_cast<int>(ops.tokens);
  const TensorOperands& k = ops.k;
  const TensorOperands& v = ops.v;
  if (k.rank != 0 || v.rank != 0) return Unsupported(spec, "no low-rank term in GPU pages yet");
  if (k.outliers_per_vector != 0 || v.outliers_per_vector != 0) {
    return Unsupported(spec, "no sparse outliers in GPU pages yet");
  }
  if (k.channel_norm != nullptr || k.channel_perm != nullptr || k.head_mean != nullptr ||
      v.channel_norm != nullptr || v.channel_perm != nullptr || v.head_mean != nullptr ||
      ops.mean_ops != nullptr || k.scales_fp8 != nullptr || v.scales_fp8 != nullptr) {
    return Unsupported(spec, "channel normalizers, permutations, head means or fp8 metadata");
  }
  auto offset = [&](const void* p, absl::string_view what, uint32_t* out) {
    absl::StatusOr<uint32_t> o = OffsetOf(block, spec, p, what);
    if (o.ok()) *out = *o;
    return o.status();
  };
  if (k.kind == CodeKind::kFloat16 && v.kind == CodeKind::kFloat16) {
    L.format = PageFormat::kFp16;
    for (absl::Status s :
         {offset(k.codes, "keys", &L.key_codes), offset(v.codes, "values", &L.value_codes)}) {
      if (!s.ok()) return s;
    }
  } else if (k.kind == CodeKind::kAffine && v.kind == CodeKind::kAffine && !k.token_groups &&
             v.token_groups) {
    L.format = PageFormat::kAffine;
    L.key_bits = k.bits;
    L.value_bits = v.bits;
    L.k_group = static_cast<int>(k.group_size);
    L.v_group = static_cast<int>(v.group_size);
    if (k.groups * k.group_size != ops.tokens || v.groups * v.group_size != ops.head_dim) {
      return Unsupported(spec, "groups must divide the block's tokens and head_dim");
    }
    for (absl::Status s :
         {offset(k.codes, "key codes", &L.key_codes), offset(k.scales, "key scales", &L.key_scales),
          offset(k.zeros, "key zero points", &L.key_zeros),
          offset(v.codes, "value codes", &L.value_codes),
          offset(v.scales, "value scales", &L.value_scales),
          offset(v.zeros, "value zero points", &L.value_zeros)}) {
      if (!s.ok()) return s;
    }
  } else {
    return Unsupported(spec, "only fp16 and KIVI (K per channel, V per token) codes");
  }
  const size_t bytes = block.bytes().size();
  L.page_bytes =
      static_cast<uint32_t>((bytes + kPageAlignment - 1) / kPageAlignment * kPageAlignment);
  if (absl::Status s = L.Validate(); !s.ok()) return Unsupported(spec, s.message());
  return L;
}

bool SameFastLayout(const PagedKvLayout& w, const PagedKvLayout& layout) {
  return w.format == layout.format && w.kv_heads == layout.kv_heads &&
         w.head_dim == layout.head_dim && w.page_tokens == layout.page_tokens &&
         (w.format == PageFormat::kFp16 ||
          (w.key_bits == layout.key_bits && w.value_bits == layout.value_bits &&
           w.k_group == layout.k_group && w.v_group == layout.v_group &&
           w.key_scales == layout.key_scales && w.key_zeros == layout.key_zeros &&
           w.value_scales == layout.value_scales && w.value_zeros == layout.value_zeros)) &&
         w.key_codes == layout.key_codes && w.value_codes == layout.value_codes;
}

// A block of CQ (its parts CQ over the same runs of 2, 4 or 8 channels at the same 4..8 bits,
// with or without a per-token norm, or plain fp16: attention sinks; no other term): its
// (channels per run, bits) for the codebook kernel (PagedKvLayout::codebook_group), else nullopt.
std::optional<std::pair<int, int>> CodebookOnly(const PreparedBlock& p) {
  std::optional<std::pair<int, int>> shape;
  auto bare = [](const TensorOperands& t) {
    return t.rank == 0 && t.outliers_per_vector == 0 && t.channel_norm == nullptr &&
           t.channel_perm == nullptr && t.head_mean == nullptr && t.scales_fp8 == nullptr;
  };
  for (const BlockOperands& ops : p.parts) {
    if (ops.mean_ops != nullptr || !bare(ops.k) || !bare(ops.v)) return std::nullopt;
    if (ops.k.kind == CodeKind::kFloat16 && ops.v.kind == CodeKind::kFloat16) {
      if (ops.k.row_bytes != ops.head_dim * 2 || ops.v.row_bytes != ops.head_dim * 2) {
        return std::nullopt;
      }
      continue;
    }
    auto cq = [&](const TensorOperands& t) {
      return t.kind == CodeKind::kCodebook && t.codebook != nullptr &&
             (t.group_size == 2 || t.group_size == 4 || t.group_size == 8) && t.bits >= 4 &&
             t.bits <= 8 && t.groups * t.group_size == ops.head_dim &&
             t.row_bytes == (t.groups * static_cast<uint32_t>(t.bits) + 7) / 8;
    };
    if (!cq(ops.k) || !cq(ops.v) || ops.k.group_size != ops.v.group_size ||
        ops.k.bits != ops.v.bits) {
      return std::nullopt;
    }
    const std::pair<int, int> here = {static_cast<int>(ops.k.group_size), ops.k.bits};
    if (shape.has_value() && *shape != here) return std::nullopt;
    shape = here;
  }
  return shape;
}

// A general pool's pages as the codebook kernel requires them (when the pool is a codebook pool).
absl::Status CheckCodebook(const BlockView& block, const PreparedBlock& p,
                           const PagedKvLayout& layout) {
  if (layout.codebook_group == 0) return absl::OkStatus();
  const std::optional<std::pair<int, int>> cq = CodebookOnly(p);
  if (cq.has_value() && cq->first == layout.codebook_group && cq->second == layout.codebook_bits) {
    return absl::OkStatus();
  }
  const BlockHeader& h = block.header();
  return absl::InvalidArgumentError(
      absl::StrCat("GPU pages: a ", h.codec_spec, " block of ", h.token_count,
                   " tokens is not a page of this pool's layout: its pages are CQ (and fp16 sinks) "
                   "alone, runs of ",
                   layout.codebook_group, " channels at ", layout.codebook_bits, " bits"));
}

uint32_t RoundToPage(size_t bytes) {
  return static_cast<uint32_t>((bytes + kPageAlignment - 1) / kPageAlignment * kPageAlignment);
}

// What the general kernel reads of a block (PrepareBlock has checked its sections): its shape.
absl::Status CheckGeneral(const BlockView& block, const PreparedBlock& p) {
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat("GPU pages: ", block.header().codec_spec,
                                                 " blocks of head_dim ", p.head_dim,
                                                 ": the kernels take 64 or 128"));
  }
  if (p.parts.size() > static_cast<size_t>(kMaxPageParts)) {
    return absl::UnimplementedError(absl::StrCat("GPU pages: ", block.header().codec_spec,
                                                 " blocks of ", p.parts.size(),
                                                 " parts: the kernels take up to ", kMaxPageParts));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PagedKvLayout> PageLayoutFor(const BlockView& block,
                                            const Calibration* calibration) {
  absl::StatusOr<PreparedBlock> prepared = PrepareBlock(block, calibration);
  if (!prepared.ok()) return prepared.status();
  absl::StatusOr<PagedKvLayout> fast = FastPageLayoutFor(block, *prepared);
  if (fast.ok() || fast.status().code() != absl::StatusCode::kUnimplemented) return fast;
  if (absl::Status s = CheckGeneral(block, *prepared); !s.ok()) return s;
  PagedKvLayout L;
  L.format = PageFormat::kGeneral;
  L.kv_heads = static_cast<int>(prepared->kv_heads);
  L.head_dim = static_cast<int>(prepared->head_dim);
  L.page_tokens = static_cast<int>(prepared->tokens);
  L.page_bytes = RoundToPage(block.bytes().size());
  if (const std::optional<std::pair<int, int>> cq = CodebookOnly(*prepared)) {
    L.codebook_group = cq->first;
    L.codebook_bits = cq->second;
  }
  if (absl::Status s = L.Validate(); !s.ok()) {
    return absl::UnimplementedError(
        absl::StrCat("GPU pages: ", block.header().codec_spec, " blocks: ", s.message()));
  }
  return L;
}

absl::StatusOr<PagedKvLayout> PageLayoutForCodec(absl::string_view spec, uint32_t tokens,
                                                 uint32_t kv_heads, uint32_t head_dim,
                                                 std::shared_ptr<const Calibration> calibration,
                                                 uint32_t layers,
                                                 std::vector<PagedKvLayout>* layer_layouts) {
  absl::StatusOr<std::unique_ptr<Codec>> codec = Codec::Create(spec, calibration);
  if (!codec.ok()) return codec.status();
  absl::StatusOr<CodecSpec> parsed = CodecSpec::Parse(spec);
  if (!parsed.ok()) return parsed.status();
  const std::vector<float> zeros(static_cast<size_t>(tokens) * kv_heads * head_dim, 0.f);
  const PageConstants constants = PageConstants::For(calibration.get());
  // Every layer's blocks when the codec is chosen per layer (the Strata mix), layer 0's
  // otherwise; chunk 1's and chunk 0's (attention sinks make the first chunk's another layout).
  // One fast layout for all of them, or a general pool whose pages hold the largest.
  const uint32_t per_layer = parsed->id == CodecId::kStrata ? std::max(layers, 1u) : 1u;
  std::optional<PagedKvLayout> fast;
  bool general = false;
  uint32_t page_bytes = 0;
  // Each layer's (channels per run, bits) where all its blocks are CQ of the same: a codebook
  // pool of its own; the pool's where every layer's is the same.
  std::vector<std::optional<std::pair<int, int>>> layer_codebook(per_layer);
  for (uint32_t layer = 0; layer < per_layer; ++layer) {
    bool layer_all = true;
    for (const uint32_t chunk : {1u, 0u}) {
      absl::StatusOr<AlignedBuffer> block = (*codec)->Encode(
          {zeros.data(), zeros.data(), SourceDType::kFloat32, tokens, kv_heads, head_dim},
          {.layer = layer, .chunk_index = chunk});
      if (!block.ok()) return block.status();
      absl::StatusOr<BlockView> view = BlockView::Parse(block->span());
      if (!view.ok()) return view.status();
      absl::StatusOr<PagedKvLayout> L = PageLayoutFor(*view, calibration.get());
      if (!L.ok()) {
        return absl::Status(L.status().code(),
                            absl::StrCat("GPU pages: ", spec, ": layer ", layer, " chunk ", chunk,
                                         ": ", L.status().message()));
      }
      if (absl::StatusOr<PageDesc> d = DescribePage(*view, calibration.get(), &constants);
          !d.ok()) {
        return d.status();
      }
      page_bytes = std::max(page_bytes, L->page_bytes);
      const std::pair<int, int> cq = {L->codebook_group, L->codebook_bits};
      if (L->codebook_group == 0 ||
          (layer_codebook[layer].has_value() && *layer_codebook[layer] != cq)) {
        layer_all = false;
      }
      layer_codebook[layer] = cq;
      if (L->format == PageFormat::kGeneral) {
        general = true;
      } else if (!fast.has_value()) {
        fast = *L;
      } else if (!SameFastLayout(*L, *fast) || L->page_bytes != fast->page_bytes) {
        general = true;  // two fast layouts (sinks, a mix of codecs): one general pool
      }
    }
    if (!layer_all) layer_codebook[layer].reset();
  }
  // Each layer's layout: the pool's, a codebook pool of its own where its blocks allow.
  auto fill_layers = [&](const PagedKvLayout& pool) {
    if (layer_layouts == nullptr) return;
    layer_layouts->assign(std::max(layers, 1u), pool);
    if (pool.format != PageFormat::kGeneral) return;
    for (uint32_t l = 0; l < layer_layouts->size(); ++l) {
      const std::optional<std::pair<int, int>>& cq = layer_codebook[per_layer > 1 ? l : 0];
      (*layer_layouts)[l].codebook_group = cq.has_value() ? cq->first : 0;
      (*layer_layouts)[l].codebook_bits = cq.has_value() ? cq->second : 0;
    }
  };
  if (!general) {
    fill_layers(*fast);
    return *fast;
  }
  PagedKvLayout L;
  L.format = PageFormat::kGeneral;
  L.kv_heads = static_cast<int>(kv_heads);
  L.head_dim = static_cast<int>(head_dim);
  L.page_tokens = static_cast<int>(tokens);
  L.page_bytes = page_bytes;
  if (std::all_of(layer_codebook.begin(), layer_codebook.end(),
                  [&](const auto& cq) { return cq.has_value() && cq == layer_codebook[0]; })) {
    L.codebook_group = layer_codebook[0]->first;
    L.codebook_bits = layer_codebook[0]->second;
  }
  if (absl::Status s = L.Validate(); !s.ok()) {
    return absl::UnimplementedError(absl::StrCat("GPU pages: ", spec, ": ", s.message()));
  }
  fill_layers(L);
  return L;
}

namespace {

// kInvalidArgument: `block` is not a page of the pool's layout, because `why`.
absl::Status NotAPage(const BlockView& block, absl::string_view why) {
  const BlockHeader& h = block.header();
  return absl::InvalidArgumentError(
      absl::StrCat("GPU pages: a ", h.codec_spec, " block of ", h.token_count, " tokens (",
                   block.bytes().size(), " bytes) is not a page of this pool's layout: ", why));
}

// The checks of CheckPage that read no section: the block fits a page and, for a general pool,
// has the pool's shape.
absl::Status CheckPageShape(const BlockView& block, const PagedKvLayout& layout) {
  const BlockHeader& h = block.header();
  if (block.bytes().size() > layout.page_bytes) {
    return NotAPage(block, absl::StrCat("pages hold ", layout.page_bytes, " bytes"));
  }
  if (layout.format == PageFormat::kGeneral &&
      (static_cast<int>(h.kv_heads) != layout.kv_heads ||
       static_cast<int>(h.head_dim) != layout.head_dim ||
       static_cast<int>(h.token_count) != layout.page_tokens)) {
    return NotAPage(block, absl::StrCat("the pool's pages are ", layout.page_tokens, " tokens of ",
                                        layout.kv_heads, "x", layout.head_dim));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPage(const BlockView& block, const PagedKvLayout& layout,
                       const Calibration* calibration) {
  STRATA_RETURN_IF_ERROR(CheckPageShape(block, layout));
  absl::StatusOr<PreparedBlock> prepared = PrepareBlock(block, calibration);
  if (!prepared.ok()) return prepared.status();
  if (layout.format == PageFormat::kGeneral) {
    STRATA_RETURN_IF_ERROR(CheckGeneral(block, *prepared));
    return CheckCodebook(block, *prepared, layout);
  }
  absl::StatusOr<PagedKvLayout> want = FastPageLayoutFor(block, *prepared);
  if (!want.ok()) return want.status();
  if (!SameFastLayout(*want, layout)) return NotAPage(block, "its sections are elsewhere");
  return absl::OkStatus();
}

namespace {
// DescribePage of a block already prepared (PrepareBlock).
absl::StatusOr<PageDesc> DescribePrepared(const BlockView& block, const PreparedBlock& prepared,
                                          const PageConstants* constants);
}  // namespace

absl::StatusOr<std::optional<PageDesc>> CheckAndDescribePage(const BlockView& block,
                                                             const PagedKvLayout& layout,
                                                             const Calibration* calibration,
                                                             const PageConstants* constants) {
  if (layout.format != PageFormat::kGeneral) {
    STRATA_RETURN_IF_ERROR(CheckPage(block, layout, calibration));
    return std::nullopt;
  }
  STRATA_RETURN_IF_ERROR(CheckPageShape(block, layout));
  // The block parsed once, checked, and described.
  absl::StatusOr<PreparedBlock> prepared = PrepareBlock(block, calibration);
  if (!prepared.ok()) return prepared.status();
  STRATA_RETURN_IF_ERROR(CheckCodebook(block, *prepared, layout));
  return DescribePrepared(block, *prepared, constants);
}

PageConstants PageConstants::For(const Calibration* calibration) {
  PageConstants c;
  if (calibration == nullptr) return c;
  for (const LayerCalibration& l : calibration->layers) {
    for (const std::vector<uint16_t>* v : {&l.k_perm, &l.v_perm, &l.k_codebook, &l.v_codebook}) {
      if (v->empty()) continue;
      const size_t at = (c.bytes_.size() + 15) / 16 * 16;
      c.bytes_.resize(at + v->size() * sizeof(uint16_t));
      std::memcpy(c.bytes_.data() + at, v->data(), v->size() * sizeof(uint16_t));
      c.where_.push_back({v->data(), static_cast<uint32_t>(at)});
    }
  }
  return c;
}

std::optional<uint32_t> PageConstants::AddressOf(const void* p) const {
  for (const auto& [ptr, at] : where_) {
    if (ptr == p) return kInConstants | at;
  }
  return std::nullopt;
}

absl::StatusOr<PageDesc> DescribePage(const BlockView& block, const Calibration* calibration,
                                      const PageConstants* constants) {
  absl::StatusOr<PreparedBlock> prepared = PrepareBlock(block, calibration);
  if (!prepared.ok()) return prepared.status();
  return DescribePrepared(block, *prepared, constants);
}

namespace {

absl::StatusOr<PageDesc> DescribePrepared(const BlockView& block, const PreparedBlock& prepared,
                                          const PageConstants* constants) {
  if (absl::Status s = CheckGeneral(block, prepared); !s.ok()) return s;
  const uint8_t* b = block.bytes().data();
  const size_t size = block.bytes().size();
  absl::Status error;
  auto addr = [&](const void* p, absl::string_view what) -> uint32_t {
    if (p == nullptr) return 0;
    const uint8_t* x = static_cast<const uint8_t*>(p);
    if (x > b && x < b + size) return static_cast<uint32_t>(x - b);
    if (constants != nullptr) {
      if (std::optional<uint32_t> at = constants->AddressOf(p)) return *at;
    }
    if (error.ok()) {
      error = absl::UnimplementedError(
          absl::StrCat("GPU pages: ", block.header().codec_spec, " blocks: ", what,
                       " are neither in the block nor in the pool's calibration constants"));
    }
    return 0;
  };
  PageDesc d;
  d.parts = static_cast<uint32_t>(prepared.parts.size());
  for (size_t i = 0; i < prepared.parts.size(); ++i) {
    const BlockOperands& ops = prepared.parts[i];
    d.part[i].tokens = ops.tokens;
    for (const bool is_k : {true, false}) {
      const TensorOperands& t = is_k ? ops.k : ops.v;
      PageTensorDesc& o = is_k ? d.part[i].k : d.part[i].v;
      switch (t.kind) {
        case CodeKind::kFloat16:
          o.kind = PageCode::kFp16;
          break;
        case CodeKind::kBFloat16:
          o.kind = PageCode::kBf16;
          break;
        case CodeKind::kInt8:
          o.kind = PageCode::kInt8;
          break;
        case CodeKind::kFp8E4M3:
          o.kind = PageCode::kFp8E4M3;
          break;
        case CodeKind::kAffine:
          o.kind = PageCode::kAffine;
          break;
        case CodeKind::kCodebook:
          o.kind = PageCode::kCodebook;
          break;
      }
      o.bits = static_cast<uint8_t>(t.bits);
      o.token_groups = t.token_groups ? 1 : 0;
      o.codes = addr(t.codes, "codes");
      o.row_bytes = t.row_bytes;
      if (t.scales_fp8 != nullptr) {
        o.meta_fp8 = 1;
        o.scales = addr(t.scales_fp8, "fp8 scales");
        o.zeros = addr(t.zeros_fp8, "fp8 zero points");
        o.meta_mult = addr(t.meta_mult_at, "fp8 metadata multipliers");
      } else {
        o.scales = addr(t.scales, "scales");
        o.zeros = addr(t.zeros, "zero points");
      }
      o.groups = t.groups;
      o.group_size = t.group_size;
      if (t.kind == CodeKind::kFp8E4M3) o.tensor_scale = addr(t.tensor_scale_at, "tensor scales");
      o.rank = t.rank;
      o.lowrank_a = addr(t.lowrank_a, "low-rank factors");
      o.lowrank_b = addr(t.lowrank_b, "low-rank factors");
      if (t.outliers_per_vector > 0) {  // (the sections of a spec without outliers are empty)
        o.outliers = t.outliers_per_vector;
        o.outlier_values = addr(t.outlier_values, "outlier values");
        o.index_bytes = t.outlier_index16 != nullptr ? 2 : 1;
        o.outlier_index =
            addr(t.outlier_index16 != nullptr ? static_cast<const void*>(t.outlier_index16)
                                              : static_cast<const void*>(t.outlier_index8),
                 "outlier indices");
      }
      o.channel_norm = addr(t.channel_norm, "channel normalizers");
      o.channel_perm = addr(t.channel_perm, "channel orders");
      o.head_mean = addr(t.head_mean, "head means");
      o.codebook = addr(t.codebook, "codebooks");
    }
  }
  if (!error.ok()) return error;
  return d;
}

}  // namespace

PageDescTable::PageDescTable(size_t capacity) : capacity_(capacity) {}

absl::StatusOr<uint16_t> PageDescTable::Intern(const PageDesc& desc, bool* added) {
  std::string key(reinterpret_cast<const char*>(&desc), sizeof(desc));
  if (added != nullptr) *added = false;
  if (auto it = index_.find(key); it != index_.end()) return it->second;
  if (descs_.size() >= capacity_ || descs_.size() > 0xffff) {
    return absl::ResourceExhaustedError(
        absl::StrCat("GPU pages: more than ", capacity_, " distinct page layouts in one pool"));
  }
  const uint16_t id = static_cast<uint16_t>(descs_.size());
  descs_.push_back(desc);
  index_.emplace(std::move(key), id);
  if (added != nullptr) *added = true;
  return id;
}

}  // namespace strata::kernels::cuda
