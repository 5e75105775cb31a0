// Token sampling for generation: greedy, temperature, top-k, top-p, min-p, from a seed, after
// the penalties OpenAI and vLLM define: presence and frequency penalties over the tokens
// generated so far, and a repetition penalty over the prompt and those tokens (vLLM's order:
// penalties on the logits first, then temperature, top-k, top-p and min-p).
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
  // Keeps tokens whose probability is at least min_p x the most likely one's, in [0, 1].
  float min_p = 0.0f;
  // Subtracted from a token's logit once if it was generated (presence) and once per time it
  // was (frequency); each in [-2, 2].
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // A token of the prompt or the output: its logit divided by this when positive, multiplied
  // when negative; > 0, 1 = off (vLLM's repetition_penalty).
  float repetition_penalty = 1.0f;
  absl::Status Validate() const;  // kInvalidArgument naming the field
  bool has_penalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
};

class Sampler {
 public:
  explicit Sampler(SamplingOptions options) : options_(options) {}
  // The token drawn from `logits` [vocab] as the `index`-th generated token (0 = the first).
  // `prompt` and `output` (the tokens generated before this one) feed the penalties; they may be
  // empty when the options set none.
  uint32_t Sample(absl::Span<const float> logits, uint64_t index,
                  absl::Span<const uint32_t> prompt = {},
                  absl::Span<const uint32_t> output = {}) const;
  const SamplingOptions& options() const { return options_; }

 private:
  SamplingOptions options_;
};

}  // namespace strata::model
