// Codec spec strings: the name and parameters of a codec, as users write them and as blocks
// record them. Parse() accepts and ToString() writes the canonical form, so specs round-trip:
//
//   fp16 | bf16                     identity at 16 bits (the baseline)
//   int8                            symmetric int8, one fp16 scale per token and head
//   fp8e4m3                         fp8 E4M3, one fp32 scale per tensor (K, V) per block
//   kivi:k2v2:g32                   KIVI: K per channel, V per token, groups of g (tokens for K,
//                                   channels for V), asymmetric, 2/3/4/8 bits, fp16 scale+zero
//   kcvt:k2v2                       GEAR's KCVT: one group per whole channel / whole token
//   gear:k2v2:g32:r4:s2[:i3]        GEAR over a KIVI (gN) or KCVT (kcvt) backbone: top/bottom
//   gear:k4v4:kcvt:r4:s2              s/2 % outliers per vector, rank-r residual per head by
//                                   power iteration (i iterations, default 3)
//   gearl:k2v2:g32:r4[:i3]          GEAR-L: low-rank without the sparse part
//   zipcache:k2v2:h4:s10[:p5]       ZipCache: the s % most salient tokens (normalized attention
//                                   of probe queries: p % most recent + p % random) at h bits,
//                                   the rest at k/v bits; K per channel over the chunk, V per
//                                   token after dividing each channel by sqrt(max |x|)
//
//   tada:k2v2:g32                   TaDA: per token the mean over KV heads at fp16, each head's
//   tada:k2v2:kcvt                    deviation from it quantized as KIVI (gN) or KCVT
//   strata:b3                       the Strata mix: each layer's codec chosen by calibration
//   (strata
//                                   calibrate) among all the methods above to minimize the loss
//                                   at an average of b bits per element, metadata included;
//                                   blocks carry their layer's own spec
//   cq:c4:b6                        coupled quantization (CQ): every c adjacent channels of a
//                                   head (2, 4 or 8) stored as the index of the nearest of 2^b
//                                   centroids (b in 4..8) of a codebook learned offline per layer,
//                                   head and channel group; b / c bits per element (c4:b6: 1.5,
//                                   c8:b8: 1), no scales; needs a calibration file (its codebooks);
//   cq:c4:b6:norm                     with `norm`, each token's row of each head is divided by its
//                                   RMS (kept at fp16: 16 / head_dim bits per element) before
//                                   the codebook (gain-shape: the codebook learns directions)
//   skvq:k2v2:g32                   SKVQ: channels reordered (calibrated permutation) so similar
//                                   channels share a group, then per-token groups of g channels
//                                   for K and V, min/max clipped by calibrated ratios; needs a
//                                   calibration file (strata calibrate)
//
// The affine codecs (kivi, kcvt, gear, gearl, zipcache, skvq, tada) take `m8`: scales and zero
// points in fp8 e4m3 instead of fp16 (as SKVQ stores them), each set relative to one fp32
// multiplier per tensor and block (so any range fits), zero points rounded down and scales up so
// every value stays in range; e.g. skvq:k2v2:g32:m8.
//
// Every quantizing codec but the calibrated ones (skvq, strata) takes `rot`: the rotation stage
// (rotation.h), K and V of each head through a random-sign Walsh-Hadamard transform before the
// backbone quantizes them, e.g. kivi:k2v2:g32:rot; no bits are stored for it.
//
// Every quantizing codec takes a trailing `sinkN`: the first N tokens of a sequence (attention
// sinks) stay at fp16 inside the first chunk's block, e.g. kivi:k2v2:g32:sink4.
//
// A block may hold several parts (token subsets with their own encoding: sinks, salient
// tokens, the rest); PartSpecs() lists them in block order.
// Errors are kInvalidArgument naming the offending field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/block_format.h"

namespace strata::kernels {

struct CodecSpec {
  static constexpr int kDefaultPowerIterations = 3;

  CodecId id = CodecId::kFp16;
  int k_bits = 16;             // backbone bits for K
  int v_bits = 16;             // backbone bits for V
  int group = 0;               // quantization group size; 0 = whole vector (KCVT)
  int rank = 0;                // low-rank r per head (GEAR, GEAR-L); 0 = none
  double outlier_percent = 0;  // s: top s/2 % and bottom s/2 % per vector (GEAR); 0 = none
  int power_iterations = kDefaultPowerIterations;
  int sink_tokens = 0;  // first tokens of a sequence kept at fp16 (chunk 0 only)
  double budget_bits = 0;  // strata: average bits per element of the mix
  bool fp8_meta = false;   // m8: affine scales and zero points in fp8 e4m3
  bool rotate = false;     // rot: K and V rotated per head before quantization (rotation.h)
  bool token_norm = false;  // cq's norm: rows divided by their RMS (fp16 per token and head)
  // ZipCache
  int hi_bits = 0;                // bits of salient tokens
  double salient_percent = 0;     // share of tokens that are salient
  double probe_percent = 5;       // probe queries: this % most recent plus this % random

  static absl::StatusOr<CodecSpec> Parse(absl::string_view text);
  std::string ToString() const;

  bool is_affine() const;  // affine backbone codes (kivi, kcvt, gear, gearl, zipcache)
  bool needs_calibration() const {
    return id == CodecId::kSkvq || id == CodecId::kStrata || id == CodecId::kCq;
  }
  // cq: group is the channels coupled (c), k_bits = v_bits the codebook's bits (b).
  bool is_codebook() const { return id == CodecId::kCq; }
  // Codecs whose per-layer choice a calibration may make (TaDA's precision search, the mix).
  bool searches_layers() const { return id == CodecId::kTada || id == CodecId::kStrata; }
  // K quantized per token in channel groups (like V) rather than per channel over tokens.
  bool k_token_groups() const { return id == CodecId::kSkvq; }
  bool has_parts() const { return sink_tokens > 0 || salient_percent > 0; }
  // Tokens of a chunk of `tokens` that ZipCache keeps at hi_bits (0 for other codecs).
  uint32_t SalientTokens(uint32_t tokens) const;
  // Bits per element the way papers count them: the backbone's bit width only.
  double nominal_bits() const;

  // The parts of a block, in block order, each a plain spec (no parts of its own): the fp16
  // sinks when sink_tokens > 0, ZipCache's salient part, then the main part.
  std::vector<CodecSpec> PartSpecs() const;

  friend bool operator==(const CodecSpec&, const CodecSpec&) = default;
};

}  // namespace strata::kernels
