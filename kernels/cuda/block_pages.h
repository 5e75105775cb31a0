// Pages for the GPU decode kernels (paged_decode.h) are the blocks the CPU codecs write, copied
// into device memory as they are: the kernels read the block's sections in place, so the GPU
// attends over exactly the bytes a prefill node shipped and the store keeps, and a block moves
// between host and device by one copy. This says where a block's sections are. Host code (it needs
// the CPU codec library; the kernels do not).
//
// Supported: fp16 blocks, and KIVI/KCVT blocks (K per channel, V per token, 2 or 4 bits) without
// low-rank terms, outliers, parts (sinks, mixed precision) or calibration. Others are
// kUnimplemented, naming what the GPU kernels lack.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/block_reader.h"
#include "kernels/cuda/paged_decode.h"

namespace strata::kernels::cuda {

// Pages are this many bytes apart at least (a page's stride is its block's bytes rounded up).
inline constexpr uint32_t kPageAlignment = 128;

// The layout of pages that are blocks like `block`. Every block of one codec spec and shape has
// the same layout, so one block's layout serves a pool of them.
absl::StatusOr<PagedKvLayout> PageLayoutFor(const BlockView& block);

// The layout of `spec`'s blocks of `tokens` tokens (from a block the codec writes).
absl::StatusOr<PagedKvLayout> PageLayoutForCodec(absl::string_view spec, uint32_t tokens,
                                                 uint32_t kv_heads, uint32_t head_dim);

// OK when `block` can be a page of a pool laid out as `layout` (the same sections at the same
// offsets, no more bytes than a page); kInvalidArgument naming the difference otherwise.
absl::Status CheckPage(const BlockView& block, const PagedKvLayout& layout);

}  // namespace strata::kernels::cuda
