#include "common/block_writer.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/crc32c.h"
#include "common/endian.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace strata {

absl::StatusOr<BlockLayout> BlockLayout::Plan(const BlockHeader& header,
                                              absl::Span<const SectionDesc> sections) {
  if (sections.empty() || sections.size() > static_cast<size_t>(kMaxSections)) {
    return absl::InvalidArgumentError(
        absl::StrCat("block layout: ", sections.size(), " sections, need 1 to ", kMaxSections));
  }
  if (header.codec_spec.size() > kMaxCodecSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("block layout: codec spec of ",
                                                   header.codec_spec.size(), " bytes exceeds ",
                                                   kMaxCodecSpecBytes));
  }
  BlockLayout layout;
  layout.spec_ = std::string(header.codec_spec);
  layout.header_ = header;
  layout.header_.codec_spec = {};
  layout.header_.codec_fingerprint = Fingerprint64(layout.spec_);

  uint64_t pos =
      uint64_t{kBlockHeaderBytes} + kSectionEntryBytes * sections.size() + layout.spec_.size();
  layout.data_begin_ = static_cast<uint32_t>(pos);
  for (const SectionDesc& d : sections) {
    SectionEntry e;
    e.kind = d.kind;
    e.tensor = d.tensor;
    e.elem = d.elem;
    e.alignment = d.alignment;
    e.count = d.count;
    const uint64_t bytes = SectionBytes(d.elem, d.count);
    const uint64_t align = d.alignment == 0 ? 1 : d.alignment;
    pos = (pos + align - 1) / align * align;
    if (pos + bytes > kMaxBlockBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("block layout: block would exceed ", kMaxBlockBytes, " bytes"));
    }
    e.offset = static_cast<uint32_t>(pos);
    e.length = static_cast<uint32_t>(bytes);
    pos += bytes;
    layout.entries_.push_back(e);
  }
  layout.total_bytes_ = static_cast<uint32_t>(pos);
  absl::Status s = ValidateBlockStructure(layout.header(), layout.entries_, layout.data_begin_,
                                          layout.total_bytes_);
  if (!s.ok()) {
    // The writer's caller described an impossible block: its mistake, not corruption.
    return absl::InvalidArgumentError(absl::StrCat("block layout: ", s.message()));
  }
  return layout;
}

void BlockLayout::WriteHeader(absl::Span<uint8_t> block) const {
  uint8_t* p = block.data();
  std::memset(p, 0, kBlockHeaderBytes);
  StoreLE<uint32_t>(p + 0, kBlockMagic);
  StoreLE<uint32_t>(p + 4, 0);  // checksum, set by SealBlock
  StoreLE<uint16_t>(p + 8, kBlockFormatVersion);
  StoreLE<uint16_t>(p + 10, kBlockHeaderBytes);
  StoreLE<uint32_t>(p + 12, total_bytes_);
  StoreLE<uint16_t>(p + 16, static_cast<uint16_t>(header_.codec));
  p[18] = static_cast<uint8_t>(header_.source_dtype);
  p[19] = static_cast<uint8_t>(entries_.size());
  StoreLE<uint16_t>(p + 20, static_cast<uint16_t>(spec_.size()));
  StoreLE<uint16_t>(p + 22, 0);  // flags
  StoreLE<uint32_t>(p + 24, header_.layer);
  StoreLE<uint32_t>(p + 28, header_.chunk_index);
  StoreLE<uint32_t>(p + 32, header_.token_count);
  StoreLE<uint16_t>(p + 36, static_cast<uint16_t>(header_.kv_heads));
  StoreLE<uint16_t>(p + 38, static_cast<uint16_t>(header_.head_dim));
  StoreLE<uint64_t>(p + 40, header_.codec_fingerprint);
  StoreLE<uint64_t>(p + 48, header_.model_fingerprint);
  StoreLE<uint64_t>(p + 56, header_.calibration_fingerprint);
  uint8_t* t = p + kBlockHeaderBytes;
  for (const SectionEntry& e : entries_) {
    t[0] = static_cast<uint8_t>(e.kind);
    t[1] = static_cast<uint8_t>(e.tensor);
    t[2] = static_cast<uint8_t>(e.elem);
    t[3] = static_cast<uint8_t>(std::countr_zero(e.alignment));
    StoreLE<uint32_t>(t + 4, e.offset);
    StoreLE<uint32_t>(t + 8, e.length);
    StoreLE<uint32_t>(t + 12, e.count);
    t += kSectionEntryBytes;
  }
  std::memcpy(t, spec_.data(), spec_.size());
  // Zero the padding before each section so that equal contents give equal bytes.
  uint32_t pos = data_begin_;
  for (const SectionEntry& e : entries_) {
    std::memset(p + pos, 0, e.offset - pos);
    pos = e.offset + e.length;
  }
}

void SealBlock(absl::Span<uint8_t> block) {
  const uint32_t total = LoadLE<uint32_t>(block.data() + 12);
  STRATA_CHECK(total >= kBlockHeaderBytes && total <= block.size(),
               "SealBlock: write the header first, into a buffer that holds the block");
  StoreLE<uint32_t>(block.data() + 4, Crc32c(block.data() + 8, total - 8));
}

absl::StatusOr<BlockBuilder> BlockBuilder::Create(const BlockHeader& header,
                                                  absl::Span<const SectionDesc> sections) {
  STRATA_ASSIGN_OR_RETURN(BlockLayout layout, BlockLayout::Plan(header, sections));
  AlignedBuffer buffer(layout.total_bytes());
  return BlockBuilder(std::move(layout), std::move(buffer));
}

absl::StatusOr<BlockBuilder> BlockBuilder::CreateIn(const BlockHeader& header,
                                                    absl::Span<const SectionDesc> sections,
                                                    const BlockAllocator& allocate) {
  STRATA_ASSIGN_OR_RETURN(BlockLayout layout, BlockLayout::Plan(header, sections));
  const size_t size = layout.total_bytes();
  STRATA_ASSIGN_OR_RETURN(absl::Span<uint8_t> bytes, allocate(size));
  if (bytes.size() < size) {
    return absl::InvalidArgumentError(absl::StrCat("block builder: the caller's memory holds ",
                                                   bytes.size(), " bytes; the block needs ",
                                                   size));
  }
  if (reinterpret_cast<uintptr_t>(bytes.data()) % AlignedBuffer::kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("block builder: the caller's memory is not ",
                                                   AlignedBuffer::kAlignment,
                                                   "-byte aligned"));
  }
  bytes = bytes.first(size);
  std::memset(bytes.data(), 0, size);  // padding and unused bytes are zero, as in Create
  return BlockBuilder(std::move(layout), bytes);
}

AlignedBuffer BlockBuilder::Finish() && {
  layout_.WriteHeader(bytes_);
  SealBlock(bytes_);
  return std::move(buffer_);
}

size_t BlockBuilder::Seal() && {
  layout_.WriteHeader(bytes_);
  SealBlock(bytes_);
  return bytes_.size();
}

}  // namespace strata
