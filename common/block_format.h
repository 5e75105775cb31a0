// The Strata block format: the single on-the-wire, on-disk and in-memory representation of one
// chunk's compressed K and V for one layer, all KV heads (DESIGN.md, "one block format").
//
// Layout (all integers little-endian; offsets are from the first byte of the block):
//
//   offset size  field
//   0      4     magic "SKVB"
//   4      4     checksum: CRC-32C of bytes [8, total_bytes)
//   8      2     format version (kBlockFormatVersion)
//   10     2     fixed header size (64 in version 1)
//   12     4     total_bytes of the block
//   16     2     codec id (CodecId)
//   18     1     source dtype (SourceDType)
//   19     1     section count n (1..kMaxSections)
//   20     2     codec spec length s (bytes of text, 1..kMaxCodecSpecBytes)
//   22     2     flags (0 in version 1)
//   24     4     layer
//   28     4     chunk index (position of the chunk in its sequence)
//   32     4     token count T
//   36     2     kv heads H
//   38     2     head dim D
//   40     8     codec fingerprint = Fingerprint64(codec spec)
//   48     8     model fingerprint
//   56     8     calibration fingerprint (0: the codec needs none)
//   64     16*n  section table, one entry per section:
//                  u8 kind, u8 tensor, u8 element type, u8 log2(alignment),
//                  u32 offset, u32 length, u32 element count
//   64+16n s     codec spec text (bytes 0x21..0x7e: printable ASCII without spaces,
//                e.g. "gear:k2v2:g32:r4:s2")
//   ...          sections in table order, each at the first offset after the previous one
//                that is a multiple of its alignment (>= 16), zero padding between them; the
//                block ends where the last section ends. So equal contents give equal bytes.
//
// Alignment is relative to the first byte of the block; blocks live in buffers aligned to at
// least 64 bytes (AlignedBuffer), so sections aligned to <= 64 are aligned in memory too.
//
// What a section's bytes mean inside (bit order of packed codes, the shape of scales) belongs to
// the codec named by the codec id and spec. What the format itself guarantees, and the reader
// checks, is listed at ValidateBlockStructure.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace strata {

inline constexpr uint32_t kBlockMagic = 0x42564b53u;  // bytes "SKVB"
inline constexpr uint16_t kBlockFormatVersion = 1;
inline constexpr uint32_t kBlockHeaderBytes = 64;
inline constexpr uint32_t kSectionEntryBytes = 16;
inline constexpr int kMaxSections = 64;
inline constexpr uint32_t kMaxCodecSpecBytes = 256;
inline constexpr uint32_t kMaxBlockBytes = 1u << 30;
inline constexpr uint32_t kMaxBlockTokens = 1u << 20;
inline constexpr uint32_t kMaxKvHeads = 1024;
inline constexpr uint32_t kMaxHeadDim = 1024;
inline constexpr uint32_t kMinSectionAlignment = 16;
inline constexpr uint32_t kMaxSectionAlignment = 4096;

// Codec families. A block's exact parameters are in its codec spec text.
enum class CodecId : uint16_t {
  kFp16 = 1,      // identity at fp16 (the baseline)
  kBf16 = 2,      // identity at bf16
  kInt8 = 3,      // int8 per token
  kFp8E4M3 = 4,   // fp8 e4m3, per-tensor scale
  kKivi = 5,      // per-channel K / per-token V asymmetric quantization, group g
  kKcvt = 6,      // GEAR's KCVT: one group per whole channel / token of the chunk
  kGear = 7,      // GEAR: backbone + low-rank + sparse
  kGearL = 8,     // GEAR-L: backbone + low-rank
  kZipCache = 9,  // saliency mixed precision, channel-separable tokenwise V
  kSkvq = 10,     // channel reordering, clipped group quantization
  kTada = 11,     // mean-centered, per-layer precision
  kStrata = 12,   // the combination
  kCq = 13,       // coupled quantization: channel groups as codebook indices (calibrated)
};

enum class SourceDType : uint8_t { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

enum class SectionKind : uint8_t {
  kCodes = 1,                // backbone values: packed codes, or raw values for identity codecs
  kScales = 2,               // quantization scales
  kZeroPoints = 3,           // quantization zero points (minimums)
  kLowRankA = 4,             // low-rank factor over tokens, H*T*r elements
  kLowRankB = 5,             // low-rank factor over channels, H*D*r elements
  kOutlierValues = 6,        // sparse outlier values
  kOutlierIndices = 7,       // their positions
  kFullPrecisionValues = 8,  // whole tokens kept at full precision, n*H*D elements
  kFullPrecisionTokens = 9,  // which tokens those are (n indices)
  kHeadMean = 10,            // per-token mean over KV heads (mean-centering)
  kChannelNormalizers = 11,  // per-channel normalizers (channel-separable quantization)
  kTokenBits = 12,           // per-token precision map (mixed precision)
  // Codes of coupled channels (coupled quantization): each stands for 2, 4 or 8 elements.
  kCodesPer2 = 13,
  kCodesPer4 = 14,
  kCodesPer8 = 15,
};

// Elements one element of a codes section stands for: 1 for kCodes, 2/4/8 for kCodesPerN, 0
// for a section that holds no codes.
uint32_t ElementsPerCode(SectionKind k);

// Which tensor a section belongs to; kShared for metadata used by both K and V.
enum class Tensor : uint8_t { kKey = 0, kValue = 1, kShared = 2 };

// Element types. kUInt1..kUInt8 are bit-packed unsigned codes of that many bits: a section of
// `count` such elements is exactly ceil(count * bits / 8) bytes.
enum class ElemType : uint8_t {
  kUInt1 = 1,
  kUInt2 = 2,
  kUInt3 = 3,
  kUInt4 = 4,
  kUInt5 = 5,
  kUInt6 = 6,
  kUInt7 = 7,
  kUInt8 = 8,
  kInt8 = 16,
  kUInt16 = 17,
  kUInt32 = 18,
  kFloat16 = 32,
  kBFloat16 = 33,
  kFloat32 = 34,
  kFp8E4M3 = 35,
  kFp8E5M2 = 36,
};

// Bits per element; 0 for a value that is not an ElemType.
int ElemBits(ElemType t);

const char* CodecIdName(CodecId id);         // "fp16", "gear", ...; "?" if unknown
const char* SourceDTypeName(SourceDType t);  // "float32", ...
const char* SectionKindName(SectionKind k);  // "codes", "scales", ...
const char* TensorName(Tensor t);            // "K", "V", "shared"
const char* ElemTypeName(ElemType t);        // "u2", "f16", ...

bool IsKnownCodecId(uint16_t v);
bool IsKnownSourceDType(uint8_t v);
bool IsKnownSectionKind(uint8_t v);
bool IsKnownTensor(uint8_t v);
bool IsKnownElemType(uint8_t v);

// Header fields of a block. codec_spec views memory owned elsewhere: for a parsed block, the
// block's own bytes.
struct BlockHeader {
  CodecId codec = CodecId::kFp16;
  absl::string_view codec_spec;
  SourceDType source_dtype = SourceDType::kFloat16;
  uint32_t layer = 0;
  uint32_t chunk_index = 0;
  uint32_t token_count = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint64_t codec_fingerprint = 0;  // Fingerprint64(codec_spec); the writer computes it
  uint64_t model_fingerprint = 0;
  uint64_t calibration_fingerprint = 0;

  // Elements in one of K or V: token_count * kv_heads * head_dim.
  uint64_t elements_per_tensor() const { return uint64_t{token_count} * kv_heads * head_dim; }
};

// One section as laid out in a block.
struct SectionEntry {
  SectionKind kind = SectionKind::kCodes;
  Tensor tensor = Tensor::kKey;
  ElemType elem = ElemType::kFloat16;
  uint32_t alignment = kMinSectionAlignment;  // power of two in [16, 4096]
  uint32_t offset = 0;
  uint32_t length = 0;  // bytes
  uint32_t count = 0;   // elements
};

// Bytes needed by `count` elements of type t (bit-packed types round up to whole bytes).
uint64_t SectionBytes(ElemType t, uint64_t count);

// Checks everything about a block that does not need its bytes, and returns kDataLoss naming the
// offending field or section otherwise:
//  - header fields within limits (heads, head dim, tokens >= 1; spec bytes in 0x21..0x7e);
//  - every section: known kind, tensor and element type; alignment a power of two in
//    [16, 4096]; offset a multiple of it; the section inside [data_begin, total_bytes); no two
//    sections overlapping; length == SectionBytes(elem, count); sections placed canonically
//    (see the layout above) and ending at total_bytes;
//  - sizes consistent with the shape: for K and for V, codes plus full-precision values cover
//    exactly T*H*D elements; full-precision values come in whole tokens (n*H*D) with n token
//    indices; outlier values and indices have equal counts; low-rank factors come in pairs of
//    H*T*r and H*D*r elements with the same rank r >= 1; index sections use integer types.
// `data_begin` is where the section area starts (after header, table and spec). The values
// inside sections (e.g. that outlier indices are in range) are the codec's to check: see
// kernels/block_operands.h. The reader checks that padding is zero.
absl::Status ValidateBlockStructure(const BlockHeader& header,
                                    absl::Span<const SectionEntry> sections, uint64_t data_begin,
                                    uint64_t total_bytes);

}  // namespace strata
