// Pages for the GPU decode kernels (paged_decode.h) are the blocks the CPU codecs write, copied
// into device memory as they are: the kernels read the block's sections in place, so the GPU
// attends over exactly the bytes a prefill node shipped and the store keeps, and a block moves
// between host and device by one copy. This says where a block's sections are. Host code (it needs
// the CPU codec library; the kernels do not).
//
// Two kinds of layout (paged_decode.h): fp16 blocks and KIVI/KCVT blocks (K per channel, V per
// token, 2 or 4 bits, no other term) have a fixed layout the specialized kernels read; every other
// codec (int8, fp8, bf16, 3- and 8-bit codes, GEAR, ZipCache, SKVQ, TaDA, CQ, fp8 metadata, sinks,
// the Strata mix) is PageFormat::kGeneral, read by the general kernel through a descriptor per
// distinct page layout (page_desc.h: DescribePage, PageDescTable) and, for calibrated codecs, the
// calibration's channel orders and codebooks copied beside the pool (PageConstants). Rotated
// blocks (`:rot`) are pages like any other: the caller rotates queries and outputs, as on the CPU.
// kUnimplemented names what the GPU lacks (head_dim other than 64 or 128, more than
// kMaxPageParts parts).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/block_reader.h"
#include "kernels/cuda/page_desc.h"
#include "kernels/cuda/paged_decode.h"

namespace strata::kernels {
struct Calibration;
}

namespace strata::kernels::cuda {

// Pages are this many bytes apart at least (a page's stride is its block's bytes rounded up).
inline constexpr uint32_t kPageAlignment = 128;

// The layout of pages that are blocks like `block`: a fast one where the block has it, else
// kGeneral (a codebook pool, PagedKvLayout::codebook_group, where the block is CQ: its parts CQ
// or fp16 sinks). Blocks
// made with a calibration need it (kFailedPrecondition otherwise).
absl::StatusOr<PagedKvLayout> PageLayoutFor(const BlockView& block,
                                            const Calibration* calibration = nullptr);

// The layout of a pool for `spec`'s blocks of `tokens` tokens (from blocks the codec writes: the
// first chunk's and a later one's, and with the Strata mix every one of `layers` layers'): their
// fast layout when all share one, else kGeneral with pages that hold the largest (a codebook pool
// when every one is CQ, with or without fp16 sinks, of the same runs and bits: not a mix).
// `layer_layouts`, when not null, gets each layer's: the pool's, except that in a general pool
// (the Strata mix) a layer whose blocks are all CQ of the same runs and bits is a codebook
// pool of its own (its pages held to that, and read by the codebook kernel).
absl::StatusOr<PagedKvLayout> PageLayoutForCodec(
    absl::string_view spec, uint32_t tokens, uint32_t kv_heads, uint32_t head_dim,
    std::shared_ptr<const Calibration> calibration = nullptr, uint32_t layers = 1,
    std::vector<PagedKvLayout>* layer_layouts = nullptr);

// OK when `block` can be a page of a pool laid out as `layout` (fast layouts: the same sections at
// the same offsets; general: the same shape and a block the general kernel reads, CQ (fp16 sinks
// allowed) of the pool's runs and bits in a codebook pool; no more bytes than a page);
// kInvalidArgument naming the difference otherwise.
absl::Status CheckPage(const BlockView& block, const PagedKvLayout& layout,
                       const Calibration* calibration = nullptr);

// The calibration data general pages read beside the pool (every layer's SKVQ channel orders and
// CQ codebooks), copied into one buffer that the caller puts in device memory
// (PagedDecodeArgs::constants). The calibration must outlive it.
class PageConstants {
 public:
  static PageConstants For(const Calibration* calibration);
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  // The address (kInConstants | offset) of calibration data at `p`, if this holds it.
  std::optional<uint32_t> AddressOf(const void* p) const;

 private:
  std::vector<uint8_t> bytes_;
  std::vector<std::pair<const void*, uint32_t>> where_;
};

// Where a block's sections are, for the general kernel (page_desc.h). kUnimplemented when a
// section it needs is neither in the block nor in `constants` (a calibrated codec's, without
// them), or the block's shape is not the kernels'.
absl::StatusOr<PageDesc> DescribePage(const BlockView& block, const Calibration* calibration,
                                      const PageConstants* constants);

// CheckPage and, for a general pool, DescribePage, parsing the block once: the descriptor of a
// general page (nullopt for a fast layout's), or CheckPage's and DescribePage's errors.
absl::StatusOr<std::optional<PageDesc>> CheckAndDescribePage(const BlockView& block,
                                                             const PagedKvLayout& layout,
                                                             const Calibration* calibration,
                                                             const PageConstants* constants);

// A pool's distinct page descriptors (a handful: a codec's first chunk, its later ones, each
// layer's codec in a mix), each page naming its own by index (PagedDecodeArgs::page_desc_ids).
class PageDescTable {
 public:
  explicit PageDescTable(size_t capacity);
  // `desc`'s index, added if new (*added says so); kResourceExhausted past the capacity.
  absl::StatusOr<uint16_t> Intern(const PageDesc& desc, bool* added = nullptr);
  const std::vector<PageDesc>& descs() const { return descs_; }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::vector<PageDesc> descs_;
  std::map<std::string, uint16_t> index_;
};

}  // namespace strata::kernels::cuda
