#include "kernels/rotation.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/mix64.h"

namespace strata::kernels {
namespace {

// In-place unnormalized fast Walsh-Hadamard transform of n (a power of two) floats.
void Fwht(float* x, uint32_t n) {
  for (uint32_t h = 1; h < n; h <<= 1) {
    for (uint32_t i = 0; i < n; i += h << 1) {
      for (uint32_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

uint64_t SplitMix64(uint64_t& state) {
  const uint64_t z = Mix64(state);
  state += kSplitMix64Gamma;
  return z;
}

}  // namespace

absl::StatusOr<HadamardRotation> HadamardRotation::Make(uint32_t dim, uint32_t layer) {
  if (dim < 2 || dim > 4096 || (dim & (dim - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation: head_dim ", dim, " is not a power of two in [2, 4096]"));
  }
  return HadamardRotation(dim, layer);
}

HadamardRotation::HadamardRotation(uint32_t dim, uint32_t layer) : dim_(dim), signs_(dim) {
  // The layer's stream: fixed forever, since blocks carry no seed (a change would silently
  // misread every rotated block ever stored).
  uint64_t state = 0x5374726174615254ull ^ (uint64_t{layer} * 0x100000001b3ull);
  for (uint32_t i = 0; i < dim; ++i) signs_[i] = (SplitMix64(state) >> 63) != 0 ? -1.0f : 1.0f;
}

void HadamardRotation::Apply(float* x, size_t rows) const {
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim_));
  for (size_t r = 0; r < rows; ++r, x += dim_) {
    for (uint32_t i = 0; i < dim_; ++i) x[i] *= signs_[i];
    Fwht(x, dim_);
    for (uint32_t i = 0; i < dim_; ++i) x[i] *= norm;
  }
}

void HadamardRotation::Invert(float* x, size_t rows) const {
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim_));
  for (size_t r = 0; r < rows; ++r, x += dim_) {
    Fwht(x, dim_);
    for (uint32_t i = 0; i < dim_; ++i) x[i] *= norm * signs_[i];
  }
}

}  // namespace strata::kernels
