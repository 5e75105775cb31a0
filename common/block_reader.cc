#include "common/block_reader.h"

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/endian.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace strata {
namespace {

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("block: ", what));
}

}  // namespace

absl::StatusOr<BlockView> BlockView::Parse(absl::Span<const uint8_t> bytes, ParseOptions options) {
  const uint8_t* p = bytes.data();
  const size_t n = bytes.size();
  if (n < 4 || LoadLE<uint32_t>(p) != kBlockMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block: not a Strata block (", n < 4 ? "fewer than 4 bytes" : "wrong magic number", ")"));
  }
  // The version comes first so that a block of another version is named as such, whatever
  // its header size.
  if (n >= 10 && LoadLE<uint16_t>(p + 8) != kBlockFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("block: format version ", LoadLE<uint16_t>(p + 8),
                     " is not supported (this build reads ", kBlockFormatVersion, ")"));
  }
  if (n < kBlockHeaderBytes) {
    return Corrupt(
        absl::StrCat("truncated: ", n, " bytes, the header alone is ", kBlockHeaderBytes));
  }
  const uint16_t header_bytes = LoadLE<uint16_t>(p + 10);
  if (header_bytes != kBlockHeaderBytes) {
    return Corrupt(absl::StrCat("header size ", header_bytes, " but version ", kBlockFormatVersion,
                                " headers are ", kBlockHeaderBytes));
  }
  const uint32_t total = LoadLE<uint32_t>(p + 12);
  if (total > n) {
    return Corrupt(absl::StrCat("truncated: header says ", total, " bytes, buffer has ", n));
  }
  if (total < n) {
    return Corrupt(absl::StrCat(n - total, " trailing bytes after the block's ", total));
  }
  const uint16_t flags = LoadLE<uint16_t>(p + 22);
  if (flags != 0) return Corrupt(absl::StrCat("unknown flags 0x", absl::Hex(flags)));

  BlockView v;
  v.bytes_ = bytes;
  v.checksum_ = LoadLE<uint32_t>(p + 4);
  BlockHeader& h = v.header_;
  h.codec = static_cast<CodecId>(LoadLE<uint16_t>(p + 16));
  h.source_dtype = static_cast<SourceDType>(p[18]);
  const uint32_t section_count = p[19];
  const uint32_t spec_bytes = LoadLE<uint16_t>(p + 20);
  h.layer = LoadLE<uint32_t>(p + 24);
  h.chunk_index = LoadLE<uint32_t>(p + 28);
  h.token_count = LoadLE<uint32_t>(p + 32);
  h.kv_heads = LoadLE<uint16_t>(p + 36);
  h.head_dim = LoadLE<uint16_t>(p + 38);
  h.codec_fingerprint = LoadLE<uint64_t>(p + 40);
  h.model_fingerprint = LoadLE<uint64_t>(p + 48);
  h.calibration_fingerprint = LoadLE<uint64_t>(p + 56);
  if (section_count < 1 || section_count > static_cast<uint32_t>(kMaxSections)) {
    return Corrupt(
        absl::StrCat("section count ", section_count, " outside [1, ", kMaxSections, "]"));
  }
  if (spec_bytes > kMaxCodecSpecBytes) {
    return Corrupt(absl::StrCat("codec spec length ", spec_bytes, " exceeds ", kMaxCodecSpecBytes));
  }
  const uint64_t data_begin =
      uint64_t{kBlockHeaderBytes} + uint64_t{kSectionEntryBytes} * section_count + spec_bytes;
  if (data_begin > total) {
    return Corrupt(absl::StrCat("section table and codec spec end at ", data_begin,
                                ", past the block's ", total, " bytes"));
  }
  h.codec_spec = absl::string_view(
      reinterpret_cast<const char*>(p + kBlockHeaderBytes + kSectionEntryBytes * section_count),
      spec_bytes);

  absl::InlinedVector<SectionEntry, 12> entries(section_count);
  for (uint32_t i = 0; i < section_count; ++i) {
    const uint8_t* t = p + kBlockHeaderBytes + kSectionEntryBytes * i;
    SectionEntry& e = entries[i];
    e.kind = static_cast<SectionKind>(t[0]);
    e.tensor = static_cast<Tensor>(t[1]);
    e.elem = static_cast<ElemType>(t[2]);
    // A shift of 32 or more would be undefined; anything above 12 is rejected below anyway.
    e.alignment = t[3] < 31 ? (1u << t[3]) : 0u;
    e.offset = LoadLE<uint32_t>(t + 4);
    e.length = LoadLE<uint32_t>(t + 8);
    e.count = LoadLE<uint32_t>(t + 12);
  }
  STRATA_RETURN_IF_ERROR(ValidateBlockStructure(h, entries, data_begin, total));
  uint64_t pos = data_begin;
  for (const SectionEntry& e : entries) {
    for (uint64_t i = pos; i < e.offset; ++i) {
      if (p[i] != 0) return Corrupt(absl::StrCat("non-zero padding byte at offset ", i));
    }
    pos = uint64_t{e.offset} + e.length;
  }

  if (options.verify_checksum) {
    const uint32_t actual = Crc32c(p + 8, total - 8);
    if (actual != v.checksum_) {
      return Corrupt(absl::StrCat("checksum mismatch: stored 0x", absl::Hex(v.checksum_),
                                  ", computed 0x", absl::Hex(actual), " over ", total - 8,
                                  " bytes"));
    }
    const uint64_t fp = Fingerprint64(h.codec_spec);
    if (fp != h.codec_fingerprint) {
      return Corrupt(absl::StrCat("codec fingerprint 0x", absl::Hex(h.codec_fingerprint),
                                  " does not match spec '", h.codec_spec, "' (0x", absl::Hex(fp),
                                  ")"));
    }
  }

  v.sections_.reserve(section_count);
  for (const SectionEntry& e : entries) {
    v.sections_.push_back(SectionView{e, bytes.subspan(e.offset, e.length)});
  }
  return v;
}

const SectionView* BlockView::Find(SectionKind kind, Tensor tensor, int ordinal) const {
  for (const SectionView& s : sections_) {
    if (s.entry.kind == kind && s.entry.tensor == tensor && ordinal-- == 0) return &s;
  }
  return nullptr;
}

double BlockView::bits_per_element() const {
  return static_cast<double>(bytes_.size()) * 8.0 /
         (2.0 * static_cast<double>(header_.elements_per_tensor()));
}

}  // namespace strata
