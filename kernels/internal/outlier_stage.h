// Internal to kernels/: the sparse outlier stage of GEAR (`:sN`; gear and the Strata mix's gear
// parts, codec.cc). The largest and smallest values of every vector are left out of the
// backbone's ranges (affine_stage.h) and stored apart in fp16: their residual after the backbone,
// with their index within the vector.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/half.h"
#include "kernels/internal/head_major.h"

namespace strata::kernels::internal {

// Marks the top and bottom n/2 of every vector (per_channel, K: each channel over tokens; else V:
// each token over channels) in `mask` (one byte per element of x, 1 for an outlier) and returns
// their positions in x in block order ([H, D, n] for K, [H, T, n] for V): for each vector the
// bottom n/2 then the top n/2, each ascending by (value, index). `index` gets each outlier's
// index within its vector (the token for K, the channel for V), in the same order. n < 2: no
// outliers (empty positions and index, mask all 0).
std::vector<size_t> SelectOutliers(const HeadMajor& x, bool per_channel, uint32_t n,
                                   std::vector<uint8_t>& mask, std::vector<uint32_t>& index);

// The outliers' values as the block stores them: the residual at each of `positions` rounded to
// fp16, which is then subtracted from `residual` (head-major, as x), so that what follows (the
// low-rank terms) fits only what the backbone and the outliers both missed.
std::vector<Half> TakeOutliers(const std::vector<size_t>& positions, Scratch<float>& residual);

}  // namespace strata::kernels::internal
