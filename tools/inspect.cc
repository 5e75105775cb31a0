#include "tools/inspect.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_reader.h"
#include "common/endian.h"
#include "common/status_macros.h"
#include "tools/file_util.h"

namespace strata::tools {
namespace {

void PrintBlock(const BlockView& v, const std::string& path, bool verified, std::ostream& out) {
  const BlockHeader& h = v.header();
  out << absl::StrFormat("block     %s (%d bytes, checksum 0x%08x %s)\n", path, v.bytes().size(),
                         v.checksum(), verified ? "verified" : "NOT VERIFIED");
  out << absl::StrFormat("format    v%d\n", kBlockFormatVersion);
  out << absl::StrFormat("codec     %s  spec \"%s\"  fingerprint %016x\n", CodecIdName(h.codec),
                         h.codec_spec, h.codec_fingerprint);
  out << absl::StrFormat("model     fingerprint %016x\n", h.model_fingerprint);
  if (h.calibration_fingerprint == 0) {
    out << "calib     none\n";
  } else {
    out << absl::StrFormat("calib     fingerprint %016x\n", h.calibration_fingerprint);
  }
  out << absl::StrFormat(
      "shape     layer %d  chunk %d  tokens %d  kv_heads %d  head_dim %d  "
      "source %s\n",
      h.layer, h.chunk_index, h.token_count, h.kv_heads, h.head_dim,
      SourceDTypeName(h.source_dtype));
  out << absl::StrFormat("size      %.4f bits per element of K and V, everything counted\n",
                         v.bits_per_element());
  out << absl::StrFormat("sections  %d\n", v.section_count());
  out << absl::StrFormat("  %3s  %-20s %-6s %-7s %10s %10s %10s %6s\n", "#", "kind", "tensor",
                         "type", "count", "offset", "length", "align");
  for (int i = 0; i < v.section_count(); ++i) {
    const SectionEntry& e = v.section(i).entry;
    out << absl::StrFormat("  %3d  %-20s %-6s %-7s %10d %10d %10d %6d\n", i,
                           SectionKindName(e.kind), TensorName(e.tensor), ElemTypeName(e.elem),
                           e.count, e.offset, e.length, e.alignment);
  }
}

}  // namespace

absl::Status InspectBlockFile(const std::string& path, std::ostream& out) {
  // The header first: a file that is not a block, or not the size its header declares, is
  // refused from its first 64 bytes, however large (a 1 GiB file would take seconds to read).
  uint64_t file_bytes = 0;
  STRATA_ASSIGN_OR_RETURN(const std::string head,
                          ReadFileHead(path, kBlockHeaderBytes, &file_bytes));
  if (head.size() == kBlockHeaderBytes) {
    const auto* p = reinterpret_cast<const uint8_t*>(head.data());
    const auto head_span = absl::MakeConstSpan(p, head.size());
    if (LoadLE<uint32_t>(p) != kBlockMagic || LoadLE<uint16_t>(p + 8) != kBlockFormatVersion ||
        LoadLE<uint16_t>(p + 10) != kBlockHeaderBytes) {
      return BlockView::Parse(head_span).status();  // the reader's own words for these
    }
    const uint32_t declared = LoadLE<uint32_t>(p + 12);
    if (declared != file_bytes) {
      return absl::DataLossError(absl::StrCat(
          "block: ", path, " is ", file_bytes, " bytes but its header declares ", declared,
          declared > file_bytes ? " (truncated)" : " (bytes after the block)"));
    }
  }
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, ReadFileAligned(path, kMaxBlockBytes));
  absl::StatusOr<BlockView> v = BlockView::Parse(buf.span());
  if (v.ok()) {
    PrintBlock(*v, path, /*verified=*/true, out);
    return absl::OkStatus();
  }
  // A block that is structurally sound but fails its checksum is still worth showing.
  absl::StatusOr<BlockView> unverified =
      BlockView::Parse(buf.span(), ParseOptions{.verify_checksum = false});
  if (unverified.ok()) PrintBlock(*unverified, path, /*verified=*/false, out);
  return v.status();
}

}  // namespace strata::tools
