// Internal to kernels/: the quantized backbone stage, asymmetric affine codes in groups. It is
// the whole of KIVI and KCVT, and the backbone under GEAR and GEAR-L (which correct its residual:
// outlier_stage.h, low_rank.h), ZipCache, SKVQ (with its clipping) and TaDA (after centering);
// codec.cc writes its output into each block's sections. Its AVX2 loops
// (internal/codec_simd.h) give the same bytes as the portable ones.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/internal/head_major.h"

namespace strata::kernels::internal {

// How QuantizeAffine groups and codes a tensor. The caller keeps the fields consistent with the
// tensor (CodecLayout does): group_size in [1, T] (per channel) or [1, D] (per token) and
// groups = ceil(T or D / group_size).
struct AffineOptions {
  // True: one group is `group_size` tokens of one (head, channel), as keys are quantized; false:
  // `group_size` channels of one (head, token), as values are.
  bool per_channel = false;
  uint32_t group_size = 0;
  uint32_t groups = 0;  // groups per (head, channel), or per (head, token)
  int bits = 2;         // code width: 2, 3, 4 or 8
  // SKVQ's clipping: each per-token group's min and max are multiplied by it (1: none).
  float clip = 1.0f;
  // Scales and zero points as fp8 e4m3 times a per-tensor multiplier (`:m8`), not fp16.
  bool fp8_meta = false;
  // Also return x minus its dequantized backbone (GEAR's low-rank terms and outliers take it).
  bool want_residual = false;
};

struct AffineResult {
  std::vector<uint8_t> packed;           // the codes, head-major, packed at `bits` (bit_pack.h)
  std::vector<uint16_t> scales, zeros;   // fp16 bits
  std::vector<uint8_t> scales8, zeros8;  // fp8 e4m3, when asked for
  float multipliers[2] = {1.0f, 1.0f};   // of the fp8 scales and zero points
  Scratch<float> residual;  // x minus its dequantized backbone, head-major; empty unless asked for
};

// Quantizes x asymmetrically in groups; `mask` (may be empty; else one byte per element of x)
// marks outliers left out of each group's min/max. Parameters are [H, groups, D] per channel and
// [H, T, groups] per token.
AffineResult QuantizeAffine(const HeadMajor& x, const std::vector<uint8_t>& mask,
                            const AffineOptions& options);

}  // namespace strata::kernels::internal
