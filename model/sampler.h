// Token sampling for generation: greedy, temperature, top-k, top-p, from a seed.
//
// Counter-based: the random draw for the i-th generated token depends only on (seed, i), never
// on what was drawn before, so a sequence sampled partly on a prefill node (its first token) and
// partly on a decode node, or preempted and resumed, gives the same tokens as one process.
//
// Thread-compatible: a Sampler is immutable; Sample may run concurrently.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace strata::model {

struct SamplingOptions {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties); else in (0, 2]
  uint32_t top_k = 0;        // keep the k most likely tokens (0: all)
  float top_p = 1.0f;        // keep the smallest set whose probability reaches p, in (0, 1]
  uint64_t seed = 0;
  absl::Status Validate() const;  // kInvalidArgument naming the field
};

class Sampler {
 public:
  explicit Sampler(SamplingOptions options) : options_(options) {}
  // The token drawn from `logits` [vocab] as the `index`-th generated token (0 = the first).
  uint32_t Sample(absl::Span<const float> logits, uint64_t index) const;
  const SamplingOptions& options() const { return options_; }

 private:
  SamplingOptions options_;
};

}  // namespace strata::model
