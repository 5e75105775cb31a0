// Pages of any codec for the GPU's general decode kernel (paged_decode.h, PageFormat::kGeneral):
// where each section of a page (a block of the Strata block format, read in place) is, and how
// one element of K or V is decoded from them. The arithmetic is the CPU reference decoder's
// (kernels/block_operands.cc DecodeOperandsRef), term for term and in its order (the device may
// fuse a multiply and an add: within an ulp), so that the GPU attends over the values the CPU
// attends over:
//
//   x = backbone(code)          fp16, bf16, int8 * per-token scale, fp8 * tensor scale,
//                               affine zero + code * scale (per channel over token groups, or per
//                               token over channel groups; fp8 metadata widened to fp16 first),
//                               or CQ's codebook entry (times the token's norm)
//     + head_mean[t][c]         TaDA
//     + Σ_r A[t][r] B[c][r]     GEAR / GEAR-L low-rank term
//     + outliers at (t, c)      GEAR's sparse outliers
//   x *= channel_norm[c]        ZipCache's channel normalizers
//   stored channel c is original channel perm[c]   SKVQ (the calibration's order)
//
// A page has up to kMaxPageParts parts (attention sinks kept at fp16, ZipCache's salient tokens,
// the rest), each attended as a block of its own: attention does not depend on token order.
// Descriptors are host-computed (block_pages.h DescribePage) and read by the kernels from device
// memory; a pool keeps one table of distinct descriptors and one index per page. Addresses are
// byte offsets from the page's first byte, or, with kInConstants set, from the start of a
// buffer of calibration data (SKVQ's channel orders, CQ's codebooks) beside the pool; 0 is
// "absent" (no section starts at a block's first byte: the header is there).
//
// Host and device code: the CPU tests decode every codec's pages through these functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#ifndef __CUDA_ARCH__
#include "common/fp8.h"
#include "common/half.h"
#endif

#ifdef __CUDACC__
#define STRATA_PAGE_HD __host__ __device__
#else
#define STRATA_PAGE_HD
#endif

namespace strata::kernels::cuda {

inline constexpr int kMaxPageParts = 3;
inline constexpr uint32_t kInConstants = 0x80000000u;

enum class PageCode : uint8_t { kFp16, kBf16, kInt8, kFp8E4M3, kAffine, kCodebook };

// One tensor (K or V) of one part. Arrays are [kv_heads][tokens][...] as the block format lays
// them out (block_operands.h lists each codec's sections).
struct PageTensorDesc {
  PageCode kind = PageCode::kFp16;
  uint8_t bits = 16;         // code bits
  uint8_t token_groups = 0;  // affine: params per (head, token, channel group); else per
                             // (head, token group, channel)
  uint8_t meta_fp8 = 0;      // affine: scales and zeros stored as fp8 e4m3 times the block's
                             // two multipliers (f32 at meta_mult: scales', zeros')
  uint8_t index_bytes = 1;   // outlier indices: 1 or 2 bytes
  uint8_t pad[3] = {0, 0, 0};
  uint32_t codes = 0;  // [H][T][row_bytes]
  uint32_t row_bytes = 0;
  uint32_t scales = 0;  // affine: per group; int8 and CQ's norm: [H][T]
  uint32_t zeros = 0;
  uint32_t groups = 1, group_size = 0;
  // Per-block numbers stay in the block (a descriptor holds addresses only, so that every block
  // of one codec and shape shares one): fp8 codes' tensor scale (f32), fp8 metadata's two
  // multipliers (f32 x 2).
  uint32_t tensor_scale = 0;
  uint32_t meta_mult = 0;
  uint32_t rank = 0, lowrank_a = 0, lowrank_b = 0;  // A [H][T][r], B [H][D][r] fp16
  uint32_t outliers = 0;                            // per vector (K: per channel, V: per token)
  uint32_t outlier_values = 0, outlier_index = 0;
  uint32_t channel_norm = 0;  // fp16 [H][D]
  uint32_t channel_perm = 0;  // u16 [H][D], in the constants
  uint32_t head_mean = 0;     // fp16 [T][D]
  uint32_t codebook = 0;      // fp16 [H][groups][2^bits][group_size], in the constants
};

struct PagePartDesc {
  uint32_t tokens = 0;
  PageTensorDesc k, v;
};

struct PageDesc {
  uint32_t parts = 0;
  PagePartDesc part[kMaxPageParts];
};
static_assert(sizeof(PageDesc) % 4 == 0, "the kernels copy a descriptor as 32-bit words");

// ---- element decoding (host and device) -------------------------------------------------------

STRATA_PAGE_HD inline float PageBitsToFloat(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

STRATA_PAGE_HD inline float PageHalf(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  return HalfBitsToFloat(h);
#endif
}

// x rounded to fp16 and back (fp8 metadata is widened to fp16 before use, as on the CPU).
STRATA_PAGE_HD inline float PageRoundHalf(float x) {
#ifdef __CUDA_ARCH__
  return __half2float(__float2half_rn(x));
#else
  return HalfBitsToFloat(FloatToHalfBits(x));
#endif
}

STRATA_PAGE_HD inline float PageFp8(uint8_t x) {
#ifdef __CUDA_ARCH__
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t exp = (x >> 3) & 0xfu;
  const uint32_t man = x & 0x7u;
  if (exp == 0xf && man == 0x7) return __uint_as_float(sign | 0x7fc00000u);
  if (exp == 0) return __uint_as_float(sign | __float_as_uint(static_cast<float>(man) * 0x1p-9f));
  return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
#else
  return Fp8E4M3ToFloat(x);
#endif
}

STRATA_PAGE_HD inline const uint8_t* PageAddr(const uint8_t* page, const uint8_t* constants,
                                              uint32_t addr) {
  return (addr & kInConstants) != 0 ? constants + (addr & ~kInConstants) : page + addr;
}

STRATA_PAGE_HD inline uint16_t PageU16(const uint8_t* base, size_t i) {
  return reinterpret_cast<const uint16_t*>(base)[i];
}

STRATA_PAGE_HD inline float PageF32(const uint8_t* base, size_t i) {
#ifdef __CUDA_ARCH__
  return reinterpret_cast<const float*>(base)[i];
#else
  float f;
  std::memcpy(&f, base + 4 * i, 4);
  return f;
#endif
}

// Code i of a row packed low bits first (codes may straddle a byte; rows are whole bytes).
STRATA_PAGE_HD inline uint32_t PageCodeAt(const uint8_t* row, uint32_t i, uint32_t bits) {
  const uint32_t bit = i * bits;
  uint32_t w = row[bit / 8];
  if (bit % 8 + bits > 8) w |= static_cast<uint32_t>(row[bit / 8 + 1]) << 8;
  return (w >> (bit % 8)) & ((1u << bits) - 1u);
}

// An affine scale (which 0) or zero point (which 1) at index p.
STRATA_PAGE_HD inline float PageMeta(const uint8_t* page, const uint8_t* constants,
                                     const PageTensorDesc& t, int which, size_t p) {
  const uint8_t* base = PageAddr(page, constants, which == 0 ? t.scales : t.zeros);
  if (t.meta_fp8 == 0) return PageHalf(PageU16(base, p));
  return PageRoundHalf(PageFp8(base[p]) * PageF32(PageAddr(page, constants, t.meta_mult), which));
}

// Stored channel d of token `tok` (of T) of KV head h, D channels: the value attention sees at
// original channel PageChannel(t, h, d).
STRATA_PAGE_HD inline float PageElement(const uint8_t* page, const uint8_t* constants,
                                        const PageTensorDesc& t, bool is_k, uint32_t T, uint32_t D,
                                        uint32_t h, uint32_t tok, uint32_t d) {
  const size_t row = static_cast<size_t>(h) * T + tok;
  const uint8_t* codes = PageAddr(page, constants, t.codes) + row * t.row_bytes;
  float x = 0;
  switch (t.kind) {
    case PageCode::kFp16:
      x = PageHalf(PageU16(codes, d));
      break;
    case PageCode::kBf16:
      x = PageBitsToFloat(static_cast<uint32_t>(PageU16(codes, d)) << 16);
      break;
    case PageCode::kInt8:
      x = static_cast<float>(static_cast<int8_t>(codes[d])) *
          PageHalf(PageU16(PageAddr(page, constants, t.scales), row));
      break;
    case PageCode::kFp8E4M3:
      x = PageFp8(codes[d]) * PageF32(PageAddr(page, constants, t.tensor_scale), 0);
      break;
    case PageCode::kCodebook: {
      const uint32_t g = d / t.group_size, entries = 1u << t.bits;
      const uint32_t code = PageCodeAt(codes, g, t.bits);
      x = PageHalf(
          PageU16(PageAddr(page, constants, t.codebook),
                  ((static_cast<size_t>(h) * t.groups + g) * entries + code) * t.group_size +
                      d % t.group_size));
      if (t.scales != 0) x *= PageHalf(PageU16(PageAddr(page, constants, t.scales), row));
      break;
    }
    case PageCode::kAffine: {
      const size_t p = t.token_groups == 0
                           ? (static_cast<size_t>(h) * t.groups + tok / t.group_size) * D + d
                           : row * t.groups + d / t.group_size;
      x = PageMeta(page, constants, t, 1, p) +
          static_cast<float>(PageCodeAt(codes, d, t.bits)) * PageMeta(page, constants, t, 0, p);
      break;
    }
  }
  if (t.head_mean != 0) {
    x +=
        PageHalf(PageU16(PageAddr(page, constants, t.head_mean), static_cast<size_t>(tok) * D + d));
  }
  if (t.rank > 0) {
    const uint8_t* a = PageAddr(page, constants, t.lowrank_a);
    const uint8_t* b = PageAddr(page, constants, t.lowrank_b);
    for (uint32_t r = 0; r < t.rank; ++r) {
      x += PageHalf(PageU16(a, row * t.rank + r)) *
           PageHalf(PageU16(b, (static_cast<size_t>(h) * D + d) * t.rank + r));
    }
  }
  if (t.outliers > 0) {  // K: outliers per channel name their token; V: per token, their channel
    const size_t first = (static_cast<size_t>(h) * (is_k ? D : T) + (is_k ? d : tok)) * t.outliers;
    const uint32_t want = is_k ? tok : d;
    const uint8_t* idx = PageAddr(page, constants, t.outlier_index);
    const uint8_t* val = PageAddr(page, constants, t.outlier_values);
    for (uint32_t j = 0; j < t.outliers; ++j) {
      const size_t e = first + j;
      const uint32_t at = t.index_bytes == 1 ? idx[e] : PageU16(idx, e);
      if (at == want) x += PageHalf(PageU16(val, e));
    }
  }
  if (t.channel_norm != 0) {
    x *= PageHalf(
        PageU16(PageAddr(page, constants, t.channel_norm), static_cast<size_t>(h) * D + d));
  }
  return x;
}

// The original channel of stored channel d of head h.
STRATA_PAGE_HD inline uint32_t PageChannel(const uint8_t* constants, const PageTensorDesc& t,
                                           uint32_t D, uint32_t h, uint32_t d) {
  if (t.channel_perm == 0) return d;
  return PageU16(PageAddr(nullptr, constants, t.channel_perm), static_cast<size_t>(h) * D + d);
}

// ---- column decoding (the general kernel's path; host and device) -----------------------------
//
// PageElement decodes one element and re-derives everything else from the descriptor each time.
// The kernel decodes a column instead: stored channel d of rows [t0, t0 + n) of a part, every
// rstep-th row from r0, with what depends on the channel alone (its original channel, its norm,
// its low-rank row, its group and codebook) computed once, and an affine group's scale and zero
// read once per group. Outliers are added by a second pass (PageOutlier), so that a column's
// loop holds no scan. Values equal PageElement's: the same terms in the same order, except that
// an outlier is added after the channel norm's product, as outlier * norm (within an ulp).

// Up to this rank, a channel's low-rank row B[h][d][:] is held in registers.
inline constexpr uint32_t kPageHoistedRank = 8;

// Writes stored channel d of rows r = r0, r0 + rstep, ... < n of the part (token t0 + r of T) of
// KV head h, without outliers, to out[r * stride + PageChannel(d)].
STRATA_PAGE_HD inline void PageDecodeColumn(const uint8_t* page, const uint8_t* constants,
                                            const PageTensorDesc& t, uint32_t T, uint32_t D,
                                            uint32_t h, uint32_t t0, uint32_t n, uint32_t d,
                                            uint32_t r0, uint32_t rstep, float* out,
                                            uint32_t stride) {
  const uint32_t ch = PageChannel(constants, t, D, h, d);
  const float norm = t.channel_norm != 0
                         ? PageHalf(PageU16(PageAddr(page, constants, t.channel_norm),
                                            static_cast<size_t>(h) * D + d))
                         : 1.f;
  const size_t row0 = static_cast<size_t>(h) * T + t0;
  const uint8_t* codes = PageAddr(page, constants, t.codes) + row0 * t.row_bytes;
  const uint8_t* scales = PageAddr(page, constants, t.scales);
  const uint32_t rank = t.rank;
  const uint8_t* lowrank_a = PageAddr(page, constants, t.lowrank_a);
  const uint8_t* lowrank_b =
      PageAddr(page, constants, t.lowrank_b) + (static_cast<size_t>(h) * D + d) * rank * 2;
  float b[kPageHoistedRank];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (uint32_t i = 0; i < kPageHoistedRank; ++i) {
    b[i] = i < rank && rank <= kPageHoistedRank ? PageHalf(PageU16(lowrank_b, i)) : 0.f;
  }
  const uint8_t* mean = PageAddr(page, constants, t.head_mean);
  const float tensor_scale =
      t.kind == PageCode::kFp8E4M3 ? PageF32(PageAddr(page, constants, t.tensor_scale), 0) : 1.f;
  // Codebooks: the channel's group and its place in an entry; affine: the channel's group (per
  // token) or the token group of row r0 (per channel) and where in it.
  const uint32_t gs = t.group_size > 0 ? t.group_size : 1;
  const uint32_t channel_group = d / gs, in_group = d % gs;
  const uint8_t* codebook =
      t.kind == PageCode::kCodebook
          ? PageAddr(page, constants, t.codebook) +
                ((static_cast<size_t>(h) * t.groups + channel_group) << t.bits) * gs * 2
          : nullptr;
  uint32_t token_group = (t0 + r0) / gs, token_in_group = (t0 + r0) % gs;
  size_t meta_at = ~static_cast<size_t>(0);
  float scale = 0, zero = 0;
  for (uint32_t r = r0; r < n; r += rstep) {
    const size_t row = row0 + r;
    const uint8_t* cr = codes + static_cast<size_t>(r) * t.row_bytes;
    float x = 0;
    switch (t.kind) {
      case PageCode::kFp16:
        x = PageHalf(PageU16(cr, d));
        break;
      case PageCode::kBf16:
        x = PageBitsToFloat(static_cast<uint32_t>(PageU16(cr, d)) << 16);
        break;
      case PageCode::kInt8:
        x = static_cast<float>(static_cast<int8_t>(cr[d])) * PageHalf(PageU16(scales, row));
        break;
      case PageCode::kFp8E4M3:
        x = PageFp8(cr[d]) * tensor_scale;
        break;
      case PageCode::kCodebook:
        x = PageHalf(PageU16(
            codebook, static_cast<size_t>(PageCodeAt(cr, channel_group, t.bits)) * gs + in_group));
        if (t.scales != 0) x *= PageHalf(PageU16(scales, row));
        break;
      case PageCode::kAffine: {
        const size_t p = t.token_groups == 0
                             ? (static_cast<size_t>(h) * t.groups + token_group) * D + d
                             : row * t.groups + channel_group;
        if (p != meta_at) {
          scale = PageMeta(page, constants, t, 0, p);
          zero = PageMeta(page, constants, t, 1, p);
          meta_at = p;
        }
        x = zero + static_cast<float>(PageCodeAt(cr, d, t.bits)) * scale;
        break;
      }
    }
    if (t.head_mean != 0) x += PageHalf(PageU16(mean, static_cast<size_t>(t0 + r) * D + d));
    if (rank > 0) {
      const uint8_t* a = lowrank_a + row * rank * 2;
      if (rank <= kPageHoistedRank) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
        for (uint32_t i = 0; i < kPageHoistedRank; ++i) {
          if (i < rank) x += PageHalf(PageU16(a, i)) * b[i];
        }
      } else {
        for (uint32_t i = 0; i < rank; ++i) {
          x += PageHalf(PageU16(a, i)) * PageHalf(PageU16(lowrank_b, i));
        }
      }
    }
    if (t.channel_norm != 0) x *= norm;
    out[static_cast<size_t>(r) * stride + ch] = x;
    token_in_group += rstep;
    while (token_in_group >= gs) {
      token_in_group -= gs;
      ++token_group;
    }
  }
}

// Outliers of one part's tensor in rows [t0, t0 + n): K keeps `outliers` per stored channel,
// each naming its token; V `outliers` per token, each naming its stored channel. Item i of
// PageOutlierItems: K (channel i / outliers, entry i % outliers), V (row i / outliers, ...).
STRATA_PAGE_HD inline uint32_t PageOutlierItems(const PageTensorDesc& t, bool is_k, uint32_t D,
                                                uint32_t n) {
  return t.outliers * (is_k ? D : n);
}

// Adds outlier item i (times its channel's norm) to out[r * stride + original channel] through
// add(float* at, float x), where it falls in rows [t0, t0 + n); an index outside the block's
// tokens or channels is ignored.
template <typename Add>
STRATA_PAGE_HD inline void PageOutlier(const uint8_t* page, const uint8_t* constants,
                                       const PageTensorDesc& t, bool is_k, uint32_t T, uint32_t D,
                                       uint32_t h, uint32_t t0, uint32_t n, uint32_t i, float* out,
                                       uint32_t stride, Add add) {
  const uint32_t vec = i / t.outliers, j = i % t.outliers;
  const size_t e =
      (static_cast<size_t>(h) * (is_k ? D : T) + (is_k ? vec : t0 + vec)) * t.outliers + j;
  const uint8_t* idx = PageAddr(page, constants, t.outlier_index);
  const uint32_t at = t.index_bytes == 1 ? idx[e] : PageU16(idx, e);
  uint32_t r = vec, d = at;
  if (is_k) {
    if (at < t0 || at >= t0 + n) return;
    r = at - t0;
    d = vec;
  } else if (at >= D) {
    return;
  }
  float x = PageHalf(PageU16(PageAddr(page, constants, t.outlier_values), e));
  if (t.channel_norm != 0) {
    x *= PageHalf(
        PageU16(PageAddr(page, constants, t.channel_norm), static_cast<size_t>(h) * D + d));
  }
  add(out + static_cast<size_t>(r) * stride + PageChannel(constants, t, D, h, d), x);
}

}  // namespace strata::kernels::cuda
