// Calibration: what a codec learns offline from a model's KV on calibration text, and needs again
// wherever its blocks are encoded or read. SKVQ needs its channel permutations (and the clip
// ratios it encodes with); per-layer precision (TaDA) needs each layer's bits.
//
// The file is versioned JSON; its fingerprint (Fingerprint64 of the canonical serialization) is
// written into every block made with it, and PrepareBlock refuses a block whose calibration is not
// the one loaded (kFailedPrecondition, naming both fingerprints).
//
//   STRATA_ASSIGN_OR_RETURN(Calibration cal, Calibration::Load("skvq.calib.json"));
//   auto codec = Codec::Create("skvq:k2v2:g32", std::make_shared<Calibration>(cal));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::kernels {

struct LayerCalibration {
  // Channel permutations per KV head, [kv_heads * head_dim]: stored channel i of head h holds
  // original channel perm[h * head_dim + i]. Empty: identity.
  std::vector<uint16_t> k_perm, v_perm;
  // Clip ratios: each group's min and max are multiplied by these before quantization.
  float k_clip = 1.0f, v_clip = 1.0f;
  // Bits of this layer (0: the spec's).
  int k_bits = 0, v_bits = 0;
  // CQ's codebooks (codebook.h), fp16 bits [kv_heads, head_dim / c, 2^b, c]; empty for other
  // codecs. Stored in the file as base64 of their little-endian bytes.
  std::vector<uint16_t> k_codebook, v_codebook;
  // CQ's keys: per channel [kv_heads * head_dim], the weight of the channel in the distance the
  // key codebooks were learned with and the encoder picks centroids by, sum_d (w_d (x_d - c_d))^2:
  // the RMS of the channel over the KV head's query heads on the calibration text, so that a
  // key's error counts as much as it moves q.k. Empty: every channel 1 (the plain distance).
  // Finite and positive.
  std::vector<float> k_metric;
  // CQ's values: the same, from the output projection: the norm of the columns of W_o that read
  // the channel (over the KV head's query heads), so that a value's error counts as much as it
  // moves the layer's output.
  std::vector<float> v_metric;
  // This layer's own codec (per-layer precision and the Strata mix); empty: the file's codec.
  // Blocks of the layer carry this spec in their header.
  std::string spec;

  friend bool operator==(const LayerCalibration&, const LayerCalibration&) = default;
};

struct Calibration {
  static constexpr int kVersion = 1;

  std::string codec;            // the spec it was made for
  uint64_t model_fingerprint = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  std::string source;           // what it was calibrated on (text file, tokens), for people
  std::vector<LayerCalibration> layers;

  std::string Serialize() const;  // canonical JSON
  uint64_t fingerprint() const;   // Fingerprint64(Serialize()), never 0
  // Validates everything: version, shapes, permutations are permutations, clip ratios in
  // (0, 1], bits 2/3/4/8 or 0. Errors are kInvalidArgument naming the field and layer.
  static absl::StatusOr<Calibration> Parse(absl::string_view json);
  static absl::StatusOr<Calibration> Load(const std::string& path);
  absl::Status Save(const std::string& path) const;

  friend bool operator==(const Calibration&, const Calibration&) = default;
};

// SKVQ's channel reordering for one head: channels sorted by their range over the calibration
// tokens (max - min), so that channels of similar range share a quantization group.
// x: [tokens, heads, head_dim]; returns the permutation of head `head` ([head_dim]).
std::vector<uint16_t> ChannelOrderByRange(const float* x, uint32_t tokens, uint32_t heads,
                                          uint32_t head_dim, uint32_t head);

}  // namespace strata::kernels
