// Internal to kernels/: AVX2 loops of the encoders (codec.cc and the stages it calls: the affine
// quantizer in affine_stage.cc, head_major.cc, outlier_stage.cc, saliency_stage.cc), each equal
// bit for bit to the portable loop it replaces (same operations in the same order, no FMA
// contraction), so that a block's bytes do not depend on the machine that made it. Call only when
// HaveCodecSimd().
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace strata::kernels::internal {

// The affine quantizer's rounding of one value (round half up, clamped to [0, qmax]; truncation
// of a non-negative value is floor): the portable loop and the vector loops' tails.
inline uint8_t AffineCode(float x, float z, float inv, float qmax) {
  const float y = std::max((x - z) * inv + 0.5f, 0.0f);
  return static_cast<uint8_t>(std::min(static_cast<float>(static_cast<int32_t>(y)), qmax));
}

// True on a CPU with AVX2 and F16C unless a test turned the loops off (SetCodecSimdForTesting).
bool HaveCodecSimd();
void SetCodecSimdForTesting(bool enabled);

// mn[d] = std::min(mn[d], v) and mx[d] = std::max(mx[d], v) over v = rows[t * stride + d],
// t in [0, n), d in [0, D). `mask` (null: none) has the layout of the values; an element whose
// mask byte is nonzero (GEAR's outliers) is left out, as the portable loops skip it.
void ColumnMinMaxAvx2(const float* rows, size_t stride, uint32_t n, uint32_t D, float* mn,
                      float* mx, const uint8_t* mask = nullptr);

// The min and max of each group of `gs` values (gs a multiple of 8) of each of n rows of D at
// `rows` (contiguous), to lo and hi [n][groups], leaving out masked elements as above (mask
// [n][D] or null). Equal as values to std::min / std::max folded from +inf / -inf; of two zeros
// either may be kept (the order of the scan differs).
void GroupMinMaxAvx2(const float* rows, uint32_t n, uint32_t D, uint32_t gs, float* lo, float* hi,
                     const uint8_t* mask = nullptr);

// out[d] = z[d] + code[d] * s[d] (multiply, then add), d in [0, n).
void DequantRowAvx2(const uint8_t* codes, const float* z, const float* s, uint32_t n, float* out);

// The indices i in [0, n), ascending, with row[i] < lo[i] or row[i] >= hi[i] (per-element
// thresholds), or against one lo and hi (Scalar): the elements that could enter a vector's
// outlier lists, a superset of those that do once the lists tighten. Returns their count.
uint32_t OutlierCandidatesAvx2(const float* row, uint32_t n, const float* lo, const float* hi,
                               uint32_t* out);
uint32_t OutlierCandidatesScalarAvx2(const float* row, uint32_t n, float lo, float hi,
                                     uint32_t* out);

// The thresholds of the k smallest and k largest values (k in [1, 8], D a multiple of 8): for
// each channel c of n rows of D (contiguous), lo[c] = the k-th smallest and hi[c] = the k-th
// largest of rows[t * D + c] over t (+inf and -inf with fewer than k values: all of them
// pass); RowExtremesAvx2 the same over the D values of one row. No NaNs.
void ColumnExtremesAvx2(const float* rows, uint32_t n, uint32_t D, uint32_t k, float* lo,
                        float* hi);
void RowExtremesAvx2(const float* row, uint32_t D, uint32_t k, float* lo, float* hi);

// codes[d] = AffineCode(x[d], z[d], inv[d], qmax), d in [0, n).
void QuantizeRowAvx2(const float* x, const float* z, const float* inv, uint32_t n, float qmax,
                     uint8_t* codes);

// The fp16 parameters of n groups from their ranges, as the quantizer's scalar code makes them:
// (lo, hi) = (0, 0) where lo > hi; scale16 = fp16((hi - lo) / qmax), zero16 = fp16(lo); s and z
// those widened back, inv = s > 0 ? 1 / s : 0. (Needs F16C besides AVX2.)
void AffineParamsAvx2(const float* lo, const float* hi, uint32_t n, float qmax, uint16_t* scale16,
                      uint16_t* zero16, float* s, float* z, float* inv);

// The same with fp8 parameters (the codec's m8): zero8 = Fp8E4M3Floor(lo / mz), z =
// fp16(e4m3(zero8) * mz) widened, scale8 = Fp8E4M3Ceil((hi - z) / qmax / ms), s = fp16(e4m3(scale8)
// * ms) widened, inv = s > 0 ? 1 / s : 0; the multipliers mz, ms > 0 and the ranges finite.
void AffineParamsFp8Avx2(const float* lo, const float* hi, uint32_t n, float qmax, float ms,
                         float mz, uint8_t* scale8, uint8_t* zero8, float* s, float* z, float* inv);

// dst[i] = the fp16 src[i] widened, i in [0, n); true when every |dst[i]| <= limit (false for a
// NaN). One pass for ToHeadMajor's conversion and range check.
bool HalfToFloatWithinAvx2(const uint16_t* src, uint32_t n, float limit, float* dst);

// out[i] = x[idx[i]], i in [0, n) (the indices below 65536, within x).
void GatherAvx2(const float* x, const uint16_t* idx, uint32_t n, float* out);

// Each of `rows` rows of d floats at x (contiguous) in place to row[i] = old row[perm[i]] (perm a
// permutation of [0, d)).
void PermuteRowsAvx2(float* x, uint32_t rows, uint32_t d, const uint16_t* perm);

// HalfToFloatWithinAvx2 and PermuteRowsAvx2 in one pass over eight rows: row k of dst (d
// floats, contiguous) is the fp16 row at src + k * src_stride widened, channel i taken from
// channel perm[i]. False, with dst untouched, when some |value| > limit or a value is NaN (the
// caller's slow path then names it). d a multiple of 8.
bool HalfToFloatPermutedWithinAvx2(const uint16_t* src, size_t src_stride, uint32_t d,
                                   const uint16_t* perm, float limit, float* dst);

// True when every |x[i]| <= limit (false for a NaN), i in [0, n).
bool AllWithinAvx2(const float* x, uint32_t n, float limit);

// max(init, max |x[i]|) over i in [0, n), NaNs skipped: the bits of a scalar std::max scan.
float MaxAbsAvx2(const float* x, size_t n, float init);

// TaDA's head mean of x [H][T][D] (head-major, D a multiple of 8): mean16[t][d] = fp16 of
// (x[0][t][d] + x[1][t][d] + ... in head order) / H, and every head's x[h][t][d] less that
// mean widened back; bit for bit the scalar loops'.
void HeadMeanAvx2(float* x, uint32_t H, uint32_t T, uint32_t D, uint16_t* mean16);

// ZipCache's channel norms of x [H][T][D] (D a multiple of 8): norm16[h][d] = fp16 of
// sqrt(max over t of |x[h][t][d]|) (1 where that is 0), and x[h][t][d] multiplied by 1 / the
// norm widened back; bit for bit the scalar loops'.
void ChannelNormsAvx2(float* x, uint32_t H, uint32_t T, uint32_t D, uint16_t* norm16);

// out[i] = FloatToFp8E4M3(x[i] * mul) for i in [0, n) (common/fp8.h), bit for bit.
void ScaleToFp8E4M3Avx2(const float* x, size_t n, float mul, uint8_t* out);

// The int8 codec's codes: y = x[i] * inv rounded half away from zero (y + copysign(0.5, y),
// truncated), clamped to [-127, 127], for i in [0, n); bit for bit the scalar loop's.
void QuantizeInt8Avx2(const float* x, uint32_t n, float inv, int8_t* out);

// QuantizeRowAvx2 over a row of n values in groups of gs (a multiple of 8) with one parameter
// per group: z[g], inv[g] for values [g * gs, (g + 1) * gs).
void QuantizeGroupsAvx2(const float* x, const float* z, const float* inv, uint32_t n, uint32_t gs,
                        float qmax, uint8_t* codes);

// GEAR's power iteration (kernels/low_rank.cc), element for element as its portable loops:
// at[j][i] = sum_c bt[j][c] * rt[c][i] (c ascending from +0), for R^T given as rt [cols, rows]
// row-major (R [rows, cols] transposed once for all the iterations), bt [rank, cols],
// at [rank, rows].
void LowRankRbAvx2(const float* rt, uint32_t rows, uint32_t cols, const float* bt, uint32_t rank,
                   float* at);
// bt[j][c] = sum_i a[i][j] * r[i][c] (i ascending from +0), a [rows, rank], bt [rank, cols].
void LowRankRtaAvx2(const float* r, uint32_t rows, uint32_t cols, const float* a, uint32_t rank,
                    float* bt);

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols (8x8 blocks).
void TransposeAvx2(const float* src, size_t src_stride, uint32_t rows, uint32_t cols, float* dst,
                   size_t dst_stride);

// ZipCache's probe softmax before normalization: p[t] = ExpScalar(dots[t] * scale - m) for t in
// [0, n), m the largest dots[t] * scale (internal/vector_exp.h: the same bits as that loop).
void ProbeWeightsAvx2(const float* dots, uint32_t n, float scale, float* p);

// ZipCache's probe scores: out[g * T + t] = sum_d q[g * D + d] * kt[d * T + t] in float, one
// fused multiply-add per d, ascending from +0 (as std::fma), for the G query heads of q and
// tokens t in [0, n), kt a head's keys transposed [D][T].
void ProbeDotsAvx2(const float* kt, uint32_t T, uint32_t D, const float* q, uint32_t G, uint32_t n,
                   float* out);

// PackBits (kernels/bit_pack.h) for 2 and 4 bits; other widths go to it.
void PackBitsAvx2(const uint8_t* codes, size_t n, int bits, uint8_t* out);

// CQ's nearest centroids (codebook.h, CentroidSearch): for each of n points (C coordinates,
// `stride` floats apart), codes[i * out_stride] = the j in [0, K) with the least
// norm[j] + sum over d of (-2 p[d]) * ct[d * K + j], added in order of d (multiply, then add),
// the lowest j on a tie. K a multiple of 8 and at most 256; C at most 8.
void NearestCentroidsAvx2(const float* points, size_t n, size_t stride, const float* ct,
                          const float* norm, uint32_t K, uint32_t C, uint8_t* codes,
                          size_t out_stride);

}  // namespace strata::kernels::internal
