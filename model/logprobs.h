// Log-probabilities of tokens, as OpenAI's `logprobs` report them: the log-softmax of the model's
// raw logits (before temperature, penalties or truncation, as vLLM reports them by default) at
// the chosen token, and the most likely tokens with theirs.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace strata::model {

// The most top_logprobs a request may ask for (OpenAI's chat limit).
inline constexpr uint32_t kMaxTopLogprobs = 20;

struct TokenLogprobs {
  uint32_t token = 0;
  float logprob = 0;  // of `token`
  // The `top` most likely tokens, most likely first (ties: lower id first), with theirs.
  std::vector<std::pair<uint32_t, float>> top;
};

// `logits` [vocab]; `token` < vocab; top <= kMaxTopLogprobs (larger is clamped). Computed in
// double precision; -inf logits give -inf.
TokenLogprobs LogprobsOf(absl::Span<const float> logits, uint32_t token, uint32_t top);

}  // namespace strata::model
