// Codecs: one chunk of K and V in, one block in the Strata block format out.
//
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, Codec::Create("gear:k2v2:g32:r4:s2"));
//   STRATA_ASSIGN_OR_RETURN(AlignedBuffer block, codec->Encode(chunk, {.layer = 3}));
//
// Every codec lays K and V out head-major inside the block ([kv_heads, tokens, head_dim]), so
// that decode attention streams one KV head's bytes contiguously for all its query heads. What
// each section holds is listed in block_operands.h, which also parses blocks back.
//
// Input must be finite; the 16-bit metadata (scales, zero points, factors, outliers) needs
// |x| < 60000. Violations return kInvalidArgument naming the tensor and position. Quantized
// codecs (int8, fp8 and the affine family) need head_dim to be a multiple of 8, so each row of
// packed codes starts on a byte. Codecs are immutable and thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/aligned_buffer.h"
#include "common/block_format.h"
#include "common/block_writer.h"
#include "kernels/calibration.h"
#include "kernels/codec_spec.h"

namespace strata::kernels {

// One chunk of KV as a model produced it: keys after RoPE.
struct KvChunkView {
  const void* k = nullptr;  // [tokens, kv_heads, head_dim], source dtype, contiguous
  const void* v = nullptr;  // [tokens, kv_heads, head_dim], source dtype, contiguous
  SourceDType dtype = SourceDType::kFloat32;
  uint32_t tokens = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  // Optional: the queries of these same tokens (after RoPE), fp32 [tokens, q_heads, head_dim].
  // ZipCache draws its probe queries from them; without them it falls back to a data-only
  // saliency (see codec_spec.h).
  const float* q = nullptr;
  uint32_t q_heads = 0;
};

// Where a block sits: recorded in its header.
struct BlockContext {
  uint32_t layer = 0;
  uint32_t chunk_index = 0;
  uint64_t model_fingerprint = 0;
};

class Codec {
 public:
  // Codecs that need a calibration (CodecSpec::needs_calibration) fail with
  // kFailedPrecondition without one, or with one made for another codec.
  static absl::StatusOr<std::unique_ptr<Codec>> Create(
      absl::string_view spec, std::shared_ptr<const Calibration> calibration = nullptr);
  explicit Codec(CodecSpec spec, std::shared_ptr<const Calibration> calibration = nullptr)
      : spec_(spec), calibration_(std::move(calibration)) {}
  const Calibration* calibration() const { return calibration_.get(); }
  // The spec the blocks of `layer` carry: the calibration's choice for that layer, if any.
  std::string LayerSpec(uint32_t layer) const;

  const CodecSpec& spec() const { return spec_; }
  // True when Encode uses the chunk's queries (ZipCache's probes).
  bool wants_queries() const { return spec_.id == CodecId::kZipCache; }

  absl::StatusOr<AlignedBuffer> Encode(const KvChunkView& chunk, const BlockContext& context) const;
  // Encode into memory the caller owns (a transport's registered buffer): `allocate` is asked
  // once for the block's exact size (BlockAllocator: 64-byte aligned). Returns the block's size;
  // its bytes equal Encode's.
  absl::StatusOr<size_t> EncodeInto(const KvChunkView& chunk, const BlockContext& context,
                                    const BlockAllocator& allocate) const;

  // The exact size of a block of this shape, in bits per element of K and V, everything
  // counted (header, table, scales, zero points, factors, outliers, padding), for a chunk other
  // than the first (no sinks) with ZipCache's nominal salient share.
  absl::StatusOr<double> BitsPerElement(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim,
                                        uint32_t chunk_index = 1) const;

 private:
  // Encode and EncodeInto: the block built and filled (sealed by the caller); in the caller's
  // memory when `allocate` is given.
  absl::StatusOr<BlockBuilder> Build(const KvChunkView& chunk, const BlockContext& context,
                                     const BlockAllocator* allocate) const;

  CodecSpec spec_;
  std::shared_ptr<const Calibration> calibration_;
  std::vector<std::unique_ptr<Codec>> layer_codecs_;  // per layer, when the calibration chose
};

}  // namespace strata::kernels
