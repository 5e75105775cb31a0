// The calibration the fuzzers and their seeds share, so that blocks made with it (CQ's codebooks)
// get past PrepareBlock's calibration check into the codec-level checks and the kernels.
#pragma once

#include "kernels/calibration.h"
#include "kernels/codec_spec.h"
#include "kernels/synthetic_kv.h"

namespace strata::fuzz {

inline constexpr char kCqSpec[] = "cq:c4:b6";
inline constexpr uint32_t kCqKvHeads = 2, kCqHeadDim = 16;

inline const kernels::Calibration& CqCalibration() {
  static const kernels::Calibration* c =
      new kernels::Calibration(*kernels::MakeSyntheticCalibration(
          *kernels::CodecSpec::Parse(kCqSpec), kCqKvHeads, kCqHeadDim, 1));
  return *c;
}

}  // namespace strata::fuzz
