#include "kernels/internal/affine_stage.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/fp8.h"
#include "kernels/bit_pack.h"
#include "kernels/internal/codec_simd.h"

namespace strata::kernels::internal {

AffineResult QuantizeAffine(const HeadMajor& x, const std::vector<uint8_t>& mask,
                            const AffineOptions& options) {
  const bool per_channel = options.per_channel, fp8_meta = options.fp8_meta;
  const uint32_t gs = options.group_size, groups = options.groups;
  const int bits = options.bits;
  const float clip = options.clip;
  const uint32_t T = x.t, H = x.h, D = x.d;
  const float qmax = static_cast<float>((1 << bits) - 1);
  AffineResult r;
  Scratch<uint8_t> codes(x.x.size());  // every element is written below
  // The residual of each row is taken while its values are in cache: the dequantized backbone
  // (zero + code * scale), then x minus it.
  if (options.want_residual) r.residual.resize(x.x.size());
  float* residual = options.want_residual ? r.residual.data() : nullptr;
  const size_t n_params = per_channel ? size_t{H} * groups * D : size_t{H} * T * groups;
  r.scales.resize(n_params);
  r.zeros.resize(n_params);
  if (fp8_meta) {
    r.scales8.resize(n_params);
    r.zeros8.resize(n_params);
    // Multipliers from the tensor's largest magnitude: zero points lie within it, scales within
    // twice it over qmax (with headroom for the rounded-down zero).
    const float maxabs = std::max(MaxAbs(x.x.data(), x.x.size()), 1e-20f);
    r.multipliers[0] = 2.1f * maxabs / qmax / kFp8E4M3Max;
    r.multipliers[1] = maxabs / kFp8E4M3Max;
  }
  const bool masked = !mask.empty();
  // The AVX2 loops give the same bytes (kernels/internal/codec_simd.h).
  const bool simd = HaveCodecSimd();
  std::vector<float> mn(D), mx(D), scale(D), zero(D), inv(D), glo, ghi, gs_scale, gs_zero, gs_inv;
  // Stores the fp16 parameters of one group and returns them as float (what decode sees).
  auto params = [&](float lo, float hi, size_t p, float* s_out, float* z_out, float* inv_out) {
    if (lo > hi) lo = hi = 0;  // every element of the group is an outlier
    if (fp8_meta) {            // zero rounded down, scale up: the group's range stays covered
      const float ms = r.multipliers[0], mz = r.multipliers[1];
      r.zeros8[p] = Fp8E4M3Floor(lo / mz);
      // What decode sees: fp8 x multiplier, widened to fp16.
      const float z = F32(F16(Fp8E4M3ToFloat(r.zeros8[p]) * mz));
      r.scales8[p] = Fp8E4M3Ceil((hi - z) / qmax / ms);
      *s_out = F32(F16(Fp8E4M3ToFloat(r.scales8[p]) * ms));
      *z_out = z;
    } else {
      r.scales[p] = F16((hi - lo) / qmax);
      r.zeros[p] = F16(lo);
      *s_out = F32(r.scales[p]);
      *z_out = F32(r.zeros[p]);
    }
    *inv_out = *s_out > 0 ? 1.0f / *s_out : 0.0f;
  };
  // V's range of a group as its parameters take it: +0 for a zero (-0 and +0 compare equal, so
  // which one a min or max keeps depends on the order of the scan, and the vector scan's
  // differs), and SKVQ's clipping.
  auto clip_range = [&](float& lo, float& hi) {
    lo += 0.0f;
    hi += 0.0f;
    if (clip != 1.0f && lo <= hi) {
      lo *= clip;
      hi *= clip;
    }
  };
  auto quantize_row = [&](size_t base, uint32_t d0, uint32_t d1, const float* s, const float* z,
                          const float* iv) {
    if (simd) {
      QuantizeRowAvx2(&x.x[base + d0], z + d0, iv + d0, d1 - d0, qmax, &codes[base + d0]);
    } else {
      for (uint32_t d = d0; d < d1; ++d) {
        codes[base + d] = AffineCode(x.x[base + d], z[d], iv[d], qmax);
      }
    }
    if (residual == nullptr) return;
    if (simd) {
      DequantRowAvx2(&codes[base + d0], z + d0, s + d0, d1 - d0, &residual[base + d0]);
    } else {
      for (uint32_t d = d0; d < d1; ++d) {
        residual[base + d] = z[d] + static_cast<float>(codes[base + d]) * s[d];
      }
    }
    for (uint32_t d = d0; d < d1; ++d) residual[base + d] = x.x[base + d] - residual[base + d];
  };
  for (uint32_t h = 0; h < H; ++h) {
    if (per_channel) {
      // K: one group = gs tokens of one channel; scan rows so memory is read in order.
      for (uint32_t g = 0; g < groups; ++g) {
        const uint32_t t0 = g * gs, t1 = std::min(T, t0 + gs);
        std::fill(mn.begin(), mn.end(), INFINITY);
        std::fill(mx.begin(), mx.end(), -INFINITY);
        if (simd) {
          const size_t base = (size_t{h} * T + t0) * D;
          ColumnMinMaxAvx2(&x.x[base], D, t1 - t0, D, mn.data(), mx.data(),
                           masked ? &mask[base] : nullptr);
        } else {
          for (uint32_t t = t0; t < t1; ++t) {
            const size_t base = (size_t{h} * T + t) * D;
            for (uint32_t d = 0; d < D; ++d) {
              const float v = x.x[base + d];
              const bool skip = masked && mask[base + d];
              mn[d] = skip ? mn[d] : std::min(mn[d], v);
              mx[d] = skip ? mx[d] : std::max(mx[d], v);
            }
          }
        }
        const size_t p0 = (size_t{h} * groups + g) * D;
        if (simd && !fp8_meta) {
          AffineParamsAvx2(mn.data(), mx.data(), D, qmax, &r.scales[p0], &r.zeros[p0], scale.data(),
                           zero.data(), inv.data());
        } else if (simd) {
          AffineParamsFp8Avx2(mn.data(), mx.data(), D, qmax, r.multipliers[0], r.multipliers[1],
                              &r.scales8[p0], &r.zeros8[p0], scale.data(), zero.data(), inv.data());
        } else {
          for (uint32_t d = 0; d < D; ++d) {
            params(mn[d], mx[d], p0 + d, &scale[d], &zero[d], &inv[d]);
          }
        }
        for (uint32_t t = t0; t < t1; ++t) {
          quantize_row((size_t{h} * T + t) * D, 0, D, scale.data(), zero.data(), inv.data());
        }
      }
    } else {
      // V: one group = gs channels of one token.
      if (simd && gs % 8 == 0) {
        // Every token of the head at once: ranges, then all parameters in one vector pass
        // (a token has only a few groups), then the codes.
        const size_t n = size_t{T} * groups, p0 = size_t{h} * n;
        glo.resize(n);
        ghi.resize(n);
        gs_scale.resize(n);
        gs_zero.resize(n);
        gs_inv.resize(n);
        const size_t head = size_t{h} * T * D;
        GroupMinMaxAvx2(&x.x[head], T, D, gs, glo.data(), ghi.data(),
                        masked ? &mask[head] : nullptr);
        for (size_t i = 0; i < n; ++i) clip_range(glo[i], ghi[i]);
        if (fp8_meta) {
          AffineParamsFp8Avx2(glo.data(), ghi.data(), static_cast<uint32_t>(n), qmax,
                              r.multipliers[0], r.multipliers[1], &r.scales8[p0], &r.zeros8[p0],
                              gs_scale.data(), gs_zero.data(), gs_inv.data());
        } else {
          AffineParamsAvx2(glo.data(), ghi.data(), static_cast<uint32_t>(n), qmax, &r.scales[p0],
                           &r.zeros[p0], gs_scale.data(), gs_zero.data(), gs_inv.data());
        }
        for (uint32_t t = 0; t < T; ++t) {
          const size_t base = (size_t{h} * T + t) * D, pt = size_t{t} * groups;
          QuantizeGroupsAvx2(&x.x[base], &gs_zero[pt], &gs_inv[pt], D, gs, qmax, &codes[base]);
          if (residual == nullptr) continue;
          for (uint32_t g = 0; g < groups; ++g) {  // as quantize_row's: zero + code * scale
            const float z = gs_zero[pt + g], sc = gs_scale[pt + g];
            for (uint32_t d = g * gs; d < std::min(D, (g + 1) * gs); ++d) {
              const float dequant = z + static_cast<float>(codes[base + d]) * sc;
              residual[base + d] = x.x[base + d] - dequant;
            }
          }
        }
        continue;
      }
      for (uint32_t t = 0; t < T; ++t) {
        const size_t base = (size_t{h} * T + t) * D;
        for (uint32_t g = 0; g < groups; ++g) {
          const uint32_t d0 = g * gs, d1 = std::min(D, d0 + gs);
          float lo = INFINITY, hi = -INFINITY;
          for (uint32_t d = d0; d < d1; ++d) {
            if (masked && mask[base + d]) continue;
            lo = std::min(lo, x.x[base + d]);
            hi = std::max(hi, x.x[base + d]);
          }
          clip_range(lo, hi);
          params(lo, hi, (size_t{h} * T + t) * groups + g, &scale[d0], &zero[d0], &inv[d0]);
          for (uint32_t d = d0 + 1; d < d1; ++d) {
            scale[d] = scale[d0];
            zero[d] = zero[d0];
            inv[d] = inv[d0];
          }
        }
        quantize_row(base, 0, D, scale.data(), zero.data(), inv.data());
      }
    }
  }
  r.packed.resize(PackedBytes(codes.size(), bits));
  if (simd) {
    PackBitsAvx2(codes.data(), codes.size(), bits, r.packed.data());
  } else {
    PackBits(codes.data(), codes.size(), bits, r.packed.data());
  }
  return r;
}

}  // namespace strata::kernels::internal
