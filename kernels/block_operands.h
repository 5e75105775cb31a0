// BlockOperands: a parsed, codec-validated view of a block, with typed pointers to every section
// attention needs. PrepareBlock checks what the generic block reader cannot: that the sections
// the codec named in the header needs are all there, with the element types and counts its spec
// and the block's shape imply, and that every outlier index is in range. After it succeeds,
// kernels may index the sections without further checks.
//
// Sections of each codec, for K and for V (H = kv_heads, T = tokens, D = head_dim,
// G = groups per vector, r = rank, n = outliers per vector):
//   fp16 / bf16   codes f16|bf16 [H, T, D]
//   int8          codes i8 [H, T, D]; scales f16 [H, T]            (symmetric, per token)
//   fp8e4m3       codes f8e4m3 [H, T, D]; scales f32 [1]           (per tensor)
//   kivi / kcvt   codes uB [H, T, D] (LSB-first stream, rows byte-aligned);
//                 K: scales, zero_points f16 [H, G, D], G = ceil(T / g) token groups
//                 V: scales, zero_points f16 [H, T, G], G = ceil(D / g) channel groups
//   gear / gearl  the above, plus lowrank_a f16 [H, T, r] and lowrank_b f16 [H, D, r]
//                 (the residual is A B^T per head);
//   gear          plus outlier_values f16 and outlier_indices u8|u16:
//                 K: [H, D, n], the token of each outlier in its channel;
//                 V: [H, T, n], the channel of each outlier in its token;
//                 each value is added to the backbone's dequantized element.
//   skvq          K and V both like kivi's V (per token, G channel groups), stored in the
//                 calibration's channel order: channel_perm (from the calibration, not the
//                 block) maps stored channel i of head h to original channel perm[h * D + i].
//   tada          kivi / kcvt of each head's deviation from the mean over heads, plus
//                 head_mean f16 [T, D] per tensor, added to every head (exposed as mean_ops,
//                 an fp16 one-head block the kernels attend over alongside the deviations).
//   cq            codes uB [H, T, D / c]: per token, each run of c channels as an index into
//                 the calibration's codebook for (layer, head, run), fp16 [H, D / c, 2^B, c]
//                 (exposed as `codebook`); with norm, plus scales f16 [H, T] (each row's RMS).
//   zipcache      a part: K as kcvt (per channel over the part's tokens); V per token with one
//                 group, plus channel_normalizers f16 [H, D] that multiply every dequantized
//                 element of their channel (channel-separable tokenwise quantization).
// Blocks with parts (a spec with sinkN, or zipcache) begin with a token map, token_bits u8 [T]
// (shared): the part of each token, indexing CodecSpec::PartSpecs(); then each non-empty part's
// sections, as above for its own token count. Attention does not depend on the order of a
// block's tokens (they all precede the query), so each part is attended as a block of its own.
// Errors: kDataLoss naming the missing or mis-sized section; kInvalidArgument when the codec
// spec in the header does not parse.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_reader.h"
#include "kernels/codec_spec.h"

namespace strata::kernels {

enum class CodeKind { kFloat16, kBFloat16, kInt8, kFp8E4M3, kAffine, kCodebook };

struct TensorOperands {
  CodeKind kind = CodeKind::kFloat16;
  int bits = 16;
  const uint8_t* codes = nullptr;  // [H, T, row_bytes]
  uint32_t row_bytes = 0;          // bytes of one token's codes in one head
  // kAffine: per group; kInt8: [H, T]; kFp8E4M3: tensor_scale only.
  const uint16_t* scales = nullptr;  // fp16 bits
  const uint16_t* zeros = nullptr;   // fp16 bits
  // m8: the stored fp8 e4m3 scales and zeros (scales/zeros above are them times the block's two
  // multipliers, widened to fp16) for kernels that read a block in place; nullptr otherwise.
  const uint8_t* scales_fp8 = nullptr;
  const uint8_t* zeros_fp8 = nullptr;
  const uint8_t* meta_mult_at = nullptr;  // m8: where the two multipliers (f32) are stored
  bool token_groups = false;         // params per (head, token, channel group), as V's; else
                                     // per (head, token group, channel), as KIVI's K
  uint32_t groups = 1;               // G: token groups (K) or channel groups (V) per vector
  uint32_t group_size = 0;           // tokens (K) or channels (V) per group
  float tensor_scale = 1.0f;
  const uint8_t* tensor_scale_at = nullptr;  // kFp8E4M3: where tensor_scale (f32) is stored
  // Low-rank correction; rank 0 when absent.
  uint32_t rank = 0;
  const uint16_t* lowrank_a = nullptr;  // [H, T, r] fp16 bits
  const uint16_t* lowrank_b = nullptr;  // [H, D, r] fp16 bits
  // Sparse outliers; per_vector 0 when absent.
  uint32_t outliers_per_vector = 0;
  const uint16_t* outlier_values = nullptr;  // fp16 bits
  const uint8_t* outlier_index8 = nullptr;   // one of the two is set
  const uint16_t* outlier_index16 = nullptr;
  // Per-channel multipliers of the dequantized values, fp16 [H, D]; nullptr when absent.
  const uint16_t* channel_norm = nullptr;
  // Stored channel i of head h is original channel channel_perm[h * D + i]; nullptr: identity.
  const uint16_t* channel_perm = nullptr;
  // TaDA: fp16 [T, D] added to every head's dequantized row; nullptr when absent.
  const uint16_t* head_mean = nullptr;
  // kCodebook (CQ): codes [H, T, groups] of `bits` each, one per run of group_size channels,
  // indexing codebook fp16 [H, groups, 2^bits, group_size] (the calibration's, for this layer);
  // with cq's norm, `scales` [H, T] multiply each token's decoded row.
  const uint16_t* codebook = nullptr;

  uint32_t OutlierIndex(size_t i) const {
    return outlier_index8 != nullptr ? outlier_index8[i] : outlier_index16[i];
  }
};

// One homogeneous part of a block (the whole block for a spec without parts).
struct BlockOperands {
  CodecSpec spec;  // the part's plain spec
  uint32_t tokens = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  TensorOperands k;
  TensorOperands v;
  // TaDA: the head means of K and V as a one-head fp16 block over the same tokens.
  std::shared_ptr<const BlockOperands> mean_ops;
};

struct PreparedBlock {
  CodecSpec spec;  // the block's spec, as in its header
  uint32_t tokens = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  std::vector<BlockOperands> parts;               // the non-empty parts, in block order
  std::vector<std::vector<uint32_t>> part_tokens;  // each part's token positions, ascending
  // fp8 scales and zero points (m8) widened to fp16 for the kernels: metadata only, small.
  std::vector<std::shared_ptr<std::vector<uint16_t>>> widened;
};

// A block made with a calibration (nonzero calibration fingerprint in its header) needs that
// calibration: kFailedPrecondition when `calibration` is null or another one. The pointers into
// the calibration stay valid while it lives.
struct Calibration;
absl::StatusOr<PreparedBlock> PrepareBlock(const BlockView& block,
                                           const Calibration* calibration = nullptr);

// Reference decoder: the block's K and V at fp32, [tokens, kv_heads, head_dim] each, in token
// order, exactly as attention over the block sees them (backbone + low-rank + outliers).
absl::Status DecodeBlockRef(const BlockView& block, float* k, float* v,
                            const Calibration* calibration = nullptr);
absl::Status DecodePreparedRef(const PreparedBlock& block, float* k, float* v);
// One part alone: [part tokens, kv_heads, head_dim].
absl::Status DecodeOperandsRef(const BlockOperands& ops, float* k, float* v);

}  // namespace strata::kernels
