#include "kernels/cuda/block_pages.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/block_operands.h"
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

}  // namespace

absl::StatusOr<PagedKvLayout> PageLayoutFor(const BlockView& block) {
  absl::StatusOr<PreparedBlock> prepared = PrepareBlock(block);
  if (!prepared.ok()) {
    if (prepared.status().code() == absl::StatusCode::kFailedPrecondition) {
      return absl::UnimplementedError(absl::StrCat("GPU pages: ", block.header().codec_spec,
                                                   " blocks: no calibrated codecs yet (",
                                                   prepared.status().message(), ")"));
    }
    return prepared.status();
  }
  const CodecSpec& spec = prepared->spec;
  if (spec.rotate) {
    return Unsupported(spec,
                       "no rotation stage in GPU pages yet (queries and outputs would need "
                       "the transform on the device)");
  }
  if (prepared->parts.size() != 1 || prepared->parts[0].tokens != prepared->tokens) {
    return Unsupported(spec, "no parts (sinks, mixed precision) in GPU pages yet");
  }
  const BlockOperands& ops = prepared->parts[0];
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
      ops.mean_ops != nullptr) {
    return Unsupported(spec, "no channel normalizers, permutations or head means in GPU pages yet");
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

absl::StatusOr<PagedKvLayout> PageLayoutForCodec(absl::string_view spec, uint32_t tokens,
                                                 uint32_t kv_heads, uint32_t head_dim) {
  absl::StatusOr<std::unique_ptr<Codec>> codec = Codec::Create(spec);
  if (!codec.ok()) return codec.status();
  const std::vector<float> zeros(static_cast<size_t>(tokens) * kv_heads * head_dim, 0.f);
  // Chunk 1's layout, then chunk 0's block checked against it: a codec whose first chunk is laid
  // out otherwise (attention sinks make it two parts) cannot fill one pool.
  absl::StatusOr<PagedKvLayout> layout;
  for (const uint32_t chunk : {1u, 0u}) {
    absl::StatusOr<AlignedBuffer> block = (*codec)->Encode(
        {zeros.data(), zeros.data(), SourceDType::kFloat32, tokens, kv_heads, head_dim},
        {.layer = 0, .chunk_index = chunk});
    if (!block.ok()) return block.status();
    absl::StatusOr<BlockView> view = BlockView::Parse(block->span());
    if (!view.ok()) return view.status();
    if (chunk == 1) {
      layout = PageLayoutFor(*view);
      if (!layout.ok()) return layout.status();
    } else if (absl::StatusOr<PagedKvLayout> first = PageLayoutFor(*view); !first.ok()) {
      return absl::UnimplementedError(absl::StrCat(
          "GPU pages: ", spec, ": its first chunk's block: ", first.status().message()));
    } else if (absl::Status s = CheckPage(*view, *layout); !s.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("GPU pages: ", spec, ": its first chunk's block: ", s.message()));
    }
  }
  return layout;
}

absl::Status CheckPage(const BlockView& block, const PagedKvLayout& layout) {
  absl::StatusOr<PagedKvLayout> want = PageLayoutFor(block);
  if (!want.ok()) return want.status();
  const PagedKvLayout& w = *want;
  const bool same =
      w.format == layout.format && w.kv_heads == layout.kv_heads && w.head_dim == layout.head_dim &&
      w.page_tokens == layout.page_tokens &&
      (w.format == PageFormat::kFp16 ||
       (w.key_bits == layout.key_bits && w.value_bits == layout.value_bits &&
        w.k_group == layout.k_group && w.v_group == layout.v_group &&
        w.key_scales == layout.key_scales && w.key_zeros == layout.key_zeros &&
        w.value_scales == layout.value_scales && w.value_zeros == layout.value_zeros)) &&
      w.key_codes == layout.key_codes && w.value_codes == layout.value_codes &&
      block.bytes().size() <= layout.page_bytes;
  if (!same) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU pages: a ", block.header().codec_spec, " block of ", block.header().token_count,
        " tokens (", block.bytes().size(), " bytes) is not a page of this pool's layout"));
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels::cuda
