#include "kernels/cuda/block_pages.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace strata::kernels::cuda {
namespace {

absl::Status Unsupported(const BlockOperands& ops, absl::string_view why) {
  return absl::UnimplementedError(
      absl::StrCat("GPU pages: ", ops.spec.ToString(), " blocks: ", why));
}

}  // namespace

absl::StatusOr<PagedKvLayout> PageLayoutFor(const BlockOperands& ops) {
  PagedKvLayout L;
  L.kv_heads = static_cast<int>(ops.kv_heads);
  L.head_dim = static_cast<int>(ops.head_dim);
  L.page_tokens = static_cast<int>(ops.tokens);
  const TensorOperands& k = ops.k;
  const TensorOperands& v = ops.v;
  if (k.rank != 0 || v.rank != 0) return Unsupported(ops, "no low-rank term in GPU pages yet");
  if (k.outliers_per_vector != 0 || v.outliers_per_vector != 0) {
    return Unsupported(ops, "no sparse outliers in GPU pages yet");
  }
  if (k.channel_norm != nullptr || k.channel_perm != nullptr || k.head_mean != nullptr ||
      v.channel_norm != nullptr || v.channel_perm != nullptr || v.head_mean != nullptr ||
      ops.mean_ops != nullptr) {
    return Unsupported(ops, "no channel normalizers, permutations or head means in GPU pages yet");
  }
  if (k.kind == CodeKind::kFloat16 && v.kind == CodeKind::kFloat16) {
    L.format = PageFormat::kFp16;
  } else if (k.kind == CodeKind::kAffine && v.kind == CodeKind::kAffine && !k.token_groups &&
             v.token_groups) {
    L.format = PageFormat::kAffine;
    L.key_bits = k.bits;
    L.value_bits = v.bits;
    L.k_group = static_cast<int>(k.group_size);
    L.v_group = static_cast<int>(v.group_size);
    if (k.groups * k.group_size != ops.tokens || v.groups * v.group_size != ops.head_dim) {
      return Unsupported(ops, "groups must divide the block's tokens and head_dim");
    }
  } else {
    return Unsupported(ops, "only fp16 and KIVI (K per channel, V per token) codes");
  }
  if (absl::Status s = L.Validate(); !s.ok()) {
    return Unsupported(ops, s.message());
  }
  return L;
}

absl::Status PackPage(const BlockOperands& ops, const PagedKvLayout& L, uint8_t* page) {
  absl::StatusOr<PagedKvLayout> want = PageLayoutFor(ops);
  if (!want.ok()) return want.status();
  if (want->format != L.format || want->kv_heads != L.kv_heads || want->head_dim != L.head_dim ||
      want->page_tokens != L.page_tokens || want->key_bits != L.key_bits ||
      want->value_bits != L.value_bits || want->k_group != L.k_group ||
      want->v_group != L.v_group) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU pages: a ", ops.spec.ToString(), " block does not fit this layout"));
  }
  std::memset(page, 0, L.PageBytes());
  const size_t T = L.page_tokens, D = L.head_dim;
  for (size_t h = 0; h < static_cast<size_t>(L.kv_heads); ++h) {
    uint8_t* head = page + h * L.HeadBytes();
    if (L.format == PageFormat::kFp16) {
      std::memcpy(head, ops.k.codes + h * T * ops.k.row_bytes, T * D * 2);
      std::memcpy(head + L.HeadBytes() / 2, ops.v.codes + h * T * ops.v.row_bytes, T * D * 2);
      continue;
    }
    const size_t kg = ops.k.groups, vg = ops.v.groups;
    std::memcpy(head + L.KeyCodes(), ops.k.codes + h * T * ops.k.row_bytes, T * ops.k.row_bytes);
    std::memcpy(head + L.KeyScales(), ops.k.scales + h * kg * D, kg * D * 2);
    std::memcpy(head + L.KeyZeros(), ops.k.zeros + h * kg * D, kg * D * 2);
    std::memcpy(head + L.ValueCodes(), ops.v.codes + h * T * ops.v.row_bytes, T * ops.v.row_bytes);
    std::memcpy(head + L.ValueScales(), ops.v.scales + h * T * vg, T * vg * 2);
    std::memcpy(head + L.ValueZeros(), ops.v.zeros + h * T * vg, T * vg * 2);
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels::cuda
