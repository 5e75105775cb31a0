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

#include <cstdint>
#include <vector>

namespace strata::kernels {

// The codebooks of one tensor, fp16 bits [heads, head_dim / coupled, 2^bits, coupled], learned
// from x: [tokens, heads, head_dim] fp32. Per (head, group): k-means++ seeding (deterministic in
// `seed`), then Lloyd iterations until no point changes centroid or `iterations` ran; a centroid
// left without points takes the point farthest from its own. With fewer distinct points than
// centroids the spare centroids repeat points (never NaN).
std::vector<uint16_t> TrainCodebooks(const float* x, uint32_t tokens, uint32_t heads,
                                     uint32_t head_dim, int coupled, int bits, uint32_t seed = 1,
                                     int iterations = 30);

// cq's norm: divides each row of x [tokens, heads, head_dim] by its RMS rounded to fp16 (the
// value blocks keep; a row of zeros keeps its zeros, scale 0), writing the fp16 bits to
// rms[head * tokens + token] when rms is not null. Calibration and encoding both normalize
// through it, so the codebooks learn the rows the encoder quantizes.
void NormalizeRows(float* x, uint32_t tokens, uint32_t heads, uint32_t head_dim, uint16_t* rms);

// Index of the centroid nearest `point` (squared distance) among `entries` centroids, fp32
// [entries, coupled]; the lowest index on a tie.
uint32_t NearestCentroid(const float* point, const float* centroids, uint32_t entries, int coupled);

}  // namespace strata::kernels
