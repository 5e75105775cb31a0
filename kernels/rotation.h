// The rotation stage: a random-sign Walsh-Hadamard transform of each head's vectors, applied to a
// layer's K and V before any backbone quantizes them (QuaRot, RotateKV, TurboQuant). An outlier
// channel's energy is spread over all channels, so per-token and per-group ranges shrink and the
// codes resolve the ordinary channels better; the transform is orthonormal, so attention needs no
// inverse for keys (q rotated the same way: (qR)·(kR) = q·k) and one for the output of values
// (sum p (vR) = (sum p v) R).
//
// Where it sits: a codec spec with `:rot` (codec_spec.h) makes the KV cache (model/kv_cache.h)
// hold that layer's K and V rotated, window and blocks alike, and the model rotate each query
// and un-rotate each attention output around the attention kernel, which is unchanged. The codec
// itself encodes what it is given; a block records `:rot` in its spec, so rotated and unrotated
// blocks never mix. No metadata is stored: the signs come from the layer's index, so the stage
// costs no bits.
//
//   const HadamardRotation r(/*dim=*/128, /*layer=*/3);
//   r.Apply(k, rows);    // each row of 128 in place
//   r.Invert(out, rows);
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace strata::kernels {

class HadamardRotation {
 public:
  // kInvalidArgument unless `dim` is a power of two in [2, 4096].
  static absl::StatusOr<HadamardRotation> Make(uint32_t dim, uint32_t layer);

  uint32_t dim() const { return dim_; }

  // x <- H (s * x) / sqrt(dim) for each of `rows` consecutive rows of dim floats, in place.
  void Apply(float* x, size_t rows) const;
  // The inverse: x <- s * (H x) / sqrt(dim).
  void Invert(float* x, size_t rows) const;

 private:
  HadamardRotation(uint32_t dim, uint32_t layer);
  uint32_t dim_;
  std::vector<float> signs_;  // +-1, from the layer's seed
};

}  // namespace strata::kernels
