// Coupled quantization, the codebook stage (CQ: Zhang et al., "KV Cache is 1 Bit Per Channel",
// 2024): each run of c adjacent channels of a head is one point in c dimensions, stored as the
// index of its nearest centroid in a codebook of 2^b centroids learned offline (k-means on a
// model's KV over calibration text), so that b bits cover c channels: b / c bits per element.
// Channels that move together (a RoPE pair of keys, correlated value channels) cost less jointly
// than one at a time, which is what lets CQ hold quality below 2 bits where per-channel
// quantizers fall apart.
//
// Attention reads the codes in place (decode_attention.cc): a query's dot products with every
// centroid of a group make a table of 2^b entries, a key's score is the sum of its groups' table
// entries; the output adds each group's centroids weighted by the probability mass of the tokens
// that chose them. Nothing is decoded to memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::kernels {

// The codebooks of one tensor, fp16 bits [heads, head_dim / coupled, 2^bits, coupled], learned
// from x: [tokens, heads, head_dim] fp32. Per (head, group): k-means++ seeding (deterministic in
// `seed`), then Lloyd iterations until no point changes centroid or `iterations` ran; a centroid
// left without points takes the point farthest from its own. With fewer distinct points than
// centroids the spare centroids repeat points (never NaN). `weights` ([heads][tokens], or null
// for 1 each) make it weighted k-means: seeding draws by weight times squared distance, a
// centroid is its points' weighted mean, so the codebook spends its precision where the
// weights say errors cost most (CQ's Fisher-guided centroids; the calibration passes the
// attention each token receives). `metric` ([heads][head_dim], or null for 1 each) weights each
// channel in the distance, sum_d (w_d (x_d - c_d))^2 (LayerCalibration::k_metric): k-means runs
// on the points scaled by it and the centroids are scaled back, so a codebook is still centroids
// of x, spent where the metric says errors cost most.
std::vector<uint16_t> TrainCodebooks(const float* x, uint32_t tokens, uint32_t heads,
                                     uint32_t head_dim, int coupled, int bits, uint32_t seed = 1,
                                     int iterations = 30, const float* weights = nullptr,
                                     const float* metric = nullptr);

// cq's norm: divides each row of x [tokens, heads, head_dim] by its RMS rounded to fp16 (the
// value blocks keep; a row of zeros keeps its zeros, scale 0), writing the fp16 bits to
// rms[head * tokens + token] when rms is not null. Calibration and encoding both normalize
// through it, so the codebooks learn the rows the encoder quantizes.
void NormalizeRows(float* x, uint32_t tokens, uint32_t heads, uint32_t head_dim, uint16_t* rms);

// Index of the centroid nearest `point` (squared distance) among `entries` centroids, fp32
// [entries, coupled]; the lowest index on a tie. The reference CentroidSearch is tested against.
uint32_t NearestCentroid(const float* point, const float* centroids, uint32_t entries, int coupled);

// The encoder's and k-means' search of one codebook (entries a multiple of 8, at most 256;
// coupled at most 8): the centroid with the least |c|^2 - 2 p.c, the squared distance less
// |p|^2, from the centroids laid out by coordinate. The nearest up to fp32 rounding (two centroids
// nearly as near may come out either way); the lowest index on a tie. AVX2 where the CPU has it,
// with the same arithmetic in the same order as the portable loop, so codes never depend on the
// machine.
class CentroidSearch {
 public:
  CentroidSearch(const float* centroids, uint32_t entries, int coupled);
  uint32_t Nearest(const float* point) const;
  // codes[i * out_stride] = Nearest(points + i * stride), i in [0, n).
  void NearestMany(const float* points, size_t n, size_t stride, uint8_t* codes,
                   size_t out_stride) const;
  // The portable loop alone (the reference the AVX2 loop is tested against).
  void NearestManyPortable(const float* points, size_t n, size_t stride, uint8_t* codes,
                           size_t out_stride) const;

 private:
  uint32_t entries_;
  int coupled_;
  std::vector<float> by_coordinate_;  // [coupled][entries]
  std::vector<float> norm_;           // |c|^2 per centroid
};

}  // namespace strata::kernels
