// Reading blocks in the Strata block format (block_format.h).
//
// BlockView::Parse validates a buffer completely before exposing anything from it: magic,
// version, header size, total size against the buffer, every header field, every section's
// kind, offset, length, alignment and element count against the shape (ValidateBlockStructure),
// and — unless told not to — the CRC-32C and the codec fingerprint. It never reads outside the
// buffer, whatever the bytes.
//
// Errors:
//   kInvalidArgument  the bytes are not a Strata block (too short to hold a magic number, or the
//                     wrong magic), or a block of a format version this build does not read.
//   kDataLoss         a Strata block that is truncated, has trailing bytes, fails its checksum,
//                     or whose header or section table is inconsistent.
// Messages say which field or section is wrong and why.
//
// A BlockView is a non-owning view: it points into the parsed buffer, which must outlive it.
// Copyable; thread-compatible.
#pragma once

#include <cstdint>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/block_format.h"

namespace strata {

struct ParseOptions {
  // Verify the CRC-32C of the whole block and the codec fingerprint against the spec. Turn off
  // only for bytes already verified in this process (e.g. read back from the local RAM tier);
  // the structural checks run either way.
  bool verify_checksum = true;
};

struct SectionView {
  SectionEntry entry;
  absl::Span<const uint8_t> data;  // entry.length bytes inside the block
};

class BlockView {
 public:
  static absl::StatusOr<BlockView> Parse(absl::Span<const uint8_t> bytes,
                                         ParseOptions options = {});

  const BlockHeader& header() const { return header_; }
  int section_count() const { return static_cast<int>(sections_.size()); }
  const SectionView& section(int i) const { return sections_[i]; }
  absl::Span<const SectionView> sections() const { return sections_; }

  // The `ordinal`-th section of this kind and tensor in table order, or nullptr.
  const SectionView* Find(SectionKind kind, Tensor tensor, int ordinal = 0) const;

  absl::Span<const uint8_t> bytes() const { return bytes_; }
  uint32_t checksum() const { return checksum_; }

  // The block's size in bits per element of K and V, everything counted: bytes * 8 / (2*T*H*D).
  double bits_per_element() const;

 private:
  BlockView() = default;  // only Parse makes views

  BlockHeader header_;
  absl::InlinedVector<SectionView, 12> sections_;
  absl::Span<const uint8_t> bytes_;
  uint32_t checksum_ = 0;
};

}  // namespace strata
