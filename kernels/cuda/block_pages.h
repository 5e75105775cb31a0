// Pages for the GPU decode kernels (paged_decode.h) from the blocks the CPU codecs write: a
// block's parsed operands (block_operands.h) copied into a page as PagedKvLayout lays it out, so
// that the GPU attends over exactly the bytes a prefill node shipped and the store keeps. Host
// code (it needs the CPU codec library; the kernels do not).
//
// Supported: fp16 blocks, and KIVI blocks (kivi:kXvY:gN with X, Y in {2, 4}) without low-rank,
// outliers, parts (sinks) or calibration, whose token count is the page's. Others are
// kUnimplemented, naming what the page format lacks.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/block_operands.h"
#include "kernels/cuda/paged_decode.h"

namespace strata::kernels::cuda {

// The page layout that holds blocks like `ops` (one block per page).
absl::StatusOr<PagedKvLayout> PageLayoutFor(const BlockOperands& ops);

// Writes `ops` into `page` (PageBytes() of `layout`, which PageLayoutFor(ops) returned or one
// equal to it).
absl::Status PackPage(const BlockOperands& ops, const PagedKvLayout& layout, uint8_t* page);

}  // namespace strata::kernels::cuda
