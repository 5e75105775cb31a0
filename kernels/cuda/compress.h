// KIVI compression on the GPU, straight into the sections of the blocks (pages) paged_decode.h
// reads in place: K per channel
// over groups of k_group tokens, V per token over groups of v_group channels, asymmetric, with
// fp16 scale and zero point, codes rounded half up and packed low bits first. The arithmetic is
// the CPU codec's (QuantizeAffine in kernels/internal/affine_stage.cc: scale =
// fp16((max - min) / qmax), zero = fp16(min), code = min(floor((x - zero) / scale + 0.5), qmax),
// no fused multiply-adds), so the sections written here are byte for byte the CPU codec's block
// of the same chunk. Only the sections: a page's header (the block's first bytes up to its first
// section) is left as it is, so its CRC-32C no longer covers the new sections: the host computes
// it again (and fills the chunk index) when a GPU-compressed block leaves the device; until then a
// page read back as a block fails its checksum.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/paged_decode.h"

namespace strata::kernels::cuda {

struct CompressArgs {
  // The chunks' K and V, fp32 [chunks][page_tokens][kv_heads][head_dim] (the model's layout).
  const float* k = nullptr;
  const float* v = nullptr;
  int chunks = 0;
  // Chunk i goes to page pages + page_ids[i] * PageBytes().
  uint8_t* pages = nullptr;
  const int32_t* page_ids = nullptr;
};

// INVALID_ARGUMENT for a layout that is not affine or arguments that do not fit it; INTERNAL for
// a launch error. Asynchronous on `stream`.
absl::Status CompressToPages(const PagedKvLayout& layout, const CompressArgs& args,
                             cudaStream_t stream);

}  // namespace strata::kernels::cuda
