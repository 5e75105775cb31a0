// Writing blocks in the Strata block format (block_format.h).
//
// Two steps, so that a block can be filled in place by any producer (a CPU codec, a GPU kernel
// writing device memory, a receiver assembling bytes):
//
//   1. BlockLayout::Plan(header, sections) validates the description and places every section:
//      offsets aligned to each section's alignment (>= 16 bytes), in the order given.
//   2. The producer fills each section's bytes at layout.section(i).offset, the layout writes
//      the header, table and spec (WriteHeader), and SealBlock stores the checksum last.
//
// BlockBuilder does both for the common CPU case, in a 64-byte-aligned buffer it owns:
//
//   STRATA_ASSIGN_OR_RETURN(BlockBuilder b, BlockBuilder::Create(header, sections));
//   std::memcpy(b.section(0).data(), codes, b.section(0).size());
//   ...
//   AlignedBuffer block = std::move(b).Finish();
//
// A planned layout always parses: the writer enforces the same ValidateBlockStructure rules the
// reader checks. Thread-compatible.
#pragma once

#include <functional>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"
#include "common/block_format.h"

namespace strata {

// What a producer declares about one section; the layout decides offset and length.
struct SectionDesc {
  SectionKind kind = SectionKind::kCodes;
  Tensor tensor = Tensor::kKey;
  ElemType elem = ElemType::kFloat16;
  uint32_t count = 0;                         // elements
  uint32_t alignment = kMinSectionAlignment;  // bytes; power of two in [16, 4096]
};

class BlockLayout {
 public:
  // Validates the header and sections (kInvalidArgument with the reason) and places them.
  // header.codec_fingerprint is ignored and computed from header.codec_spec.
  static absl::StatusOr<BlockLayout> Plan(const BlockHeader& header,
                                          absl::Span<const SectionDesc> sections);

  uint32_t total_bytes() const { return total_bytes_; }
  // First byte after header, section table and codec spec.
  uint32_t data_begin() const { return data_begin_; }
  int section_count() const { return static_cast<int>(entries_.size()); }
  const SectionEntry& section(int i) const { return entries_[i]; }
  // The header as planned; its codec_spec views this layout's own copy of the text, valid while
  // this layout object lives and is not moved.
  BlockHeader header() const {
    BlockHeader h = header_;
    h.codec_spec = spec_;
    return h;
  }

  // Writes header, section table, spec and zero padding into block[0, total_bytes) without
  // touching section payloads. block.size() must be >= total_bytes().
  void WriteHeader(absl::Span<uint8_t> block) const;

 private:
  BlockLayout() = default;

  BlockHeader header_;  // codec_spec left empty; spec_ holds the text
  std::string spec_;
  std::vector<SectionEntry> entries_;
  uint32_t data_begin_ = 0;
  uint32_t total_bytes_ = 0;
};

// Computes the CRC-32C of block[8, total_bytes) and stores it at bytes [4, 8), total_bytes read
// from the header already written. Call after every byte of the block is final; `block` may be
// larger than the block (a receive buffer).
void SealBlock(absl::Span<uint8_t> block);

// Where a block is built in memory the caller owns (a transport's registered buffer, a slot of a
// ring): given the block's exact size, returns at least that many bytes, 64-byte aligned (the
// readers' alignment of sections holds only from an aligned start), or an error.
using BlockAllocator = std::function<absl::StatusOr<absl::Span<uint8_t>>(size_t bytes)>;

// Plans a layout and fills a zeroed, 64-byte-aligned buffer for it: its own, or the caller's
// (CreateIn). Payload sections are the caller's to write (section()); Finish or Seal writes the
// header and checksum last.
class BlockBuilder {
 public:
  static absl::StatusOr<BlockBuilder> Create(const BlockHeader& header,
                                             absl::Span<const SectionDesc> sections);
  // Builds in memory from `allocate` (asked once, for the block's exact size; zeroed here).
  // kInvalidArgument when it returns fewer bytes or an unaligned start; its own error as is.
  static absl::StatusOr<BlockBuilder> CreateIn(const BlockHeader& header,
                                               absl::Span<const SectionDesc> sections,
                                               const BlockAllocator& allocate);

  const BlockLayout& layout() const { return layout_; }
  // The bytes of section i, to be filled by the caller.
  absl::Span<uint8_t> section(int i) {
    const SectionEntry& e = layout_.section(i);
    return bytes_.subspan(e.offset, e.length);
  }
  template <typename T>
  T* section_as(int i) {
    return reinterpret_cast<T*>(bytes_.data() + layout_.section(i).offset);
  }

  // Writes the header and seals the block; the builder is consumed. For a builder from Create.
  AlignedBuffer Finish() &&;
  // Writes the header and seals the block in place; returns its size (the builder is consumed).
  // For a builder from CreateIn (from Create, the bytes go with the builder: use Finish).
  size_t Seal() &&;

 private:
  BlockBuilder(BlockLayout layout, AlignedBuffer buffer)
      : layout_(std::move(layout)), buffer_(std::move(buffer)), bytes_(buffer_.span()) {}
  BlockBuilder(BlockLayout layout, absl::Span<uint8_t> bytes)
      : layout_(std::move(layout)), bytes_(bytes) {}
  BlockLayout layout_;
  AlignedBuffer buffer_;       // empty when the caller owns the bytes
  absl::Span<uint8_t> bytes_;  // the block: buffer_'s, or the caller's
};

}  // namespace strata
