#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/mix64.h"

namespace strata::model {

absl::Status SamplingOptions::Validate() const {
  if (!(temperature >= 0.0f && temperature <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: temperature must be in [0, 2], got ", temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: top_p must be in (0, 1], got ", top_p));
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: min_p must be in [0, 1], got ", min_p));
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: presence_penalty must be in [-2, 2], got ", presence_penalty));
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: frequency_penalty must be in [-2, 2], got ", frequency_penalty));
  }
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 100.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: repetition_penalty must be in (0, 100], got ", repetition_penalty));
  }
  return absl::OkStatus();
}

uint32_t Sampler::Sample(absl::Span<const float> raw, uint64_t index,
                         absl::Span<const uint32_t> prompt,
                         absl::Span<const uint32_t> output) const {
  const uint32_t vocab = static_cast<uint32_t>(raw.size());
  std::vector<float> penalized;
  absl::Span<const float> logits = raw;
  if (options_.has_penalties()) {
    penalized.assign(raw.begin(), raw.end());
    // Only the tokens of the history change: visit those (a prompt and an output are far
    // smaller than a vocabulary), each once.
    const float rep = options_.repetition_penalty;
    absl::flat_hash_map<uint32_t, uint32_t> times;  // token -> times generated (0: prompt only)
    for (uint32_t t : output) ++times[t];
    if (rep != 1.0f) {
      for (uint32_t t : prompt) times.try_emplace(t, 0);
    }
    for (const auto& [t, n] : times) {
      if (t >= vocab) continue;
      float& x = penalized[t];
      if (rep != 1.0f) x = x > 0 ? x / rep : x * rep;
      if (n > 0)
        x -= options_.presence_penalty + options_.frequency_penalty * static_cast<float>(n);
    }
    logits = penalized;
  }
  if (options_.temperature <= 0.0f || options_.top_k == 1) {
    return static_cast<uint32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Candidates by descending logit (ties by id), cut to top_k.
  std::vector<uint32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0u);
  const uint32_t k = options_.top_k == 0 ? vocab : std::min(options_.top_k, vocab);
  auto by_logit = [&](uint32_t a, uint32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  ids.resize(k);
  const double mx = logits[ids[0]];
  std::vector<double> p(k);
  double sum = 0;
  for (uint32_t i = 0; i < k; ++i) {
    p[i] = std::exp((double{logits[ids[i]]} - mx) / options_.temperature);
    sum += p[i];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p; then min-p against the most likely.
  uint32_t keep = k;
  if (options_.top_p < 1.0f) {
    double acc = 0;
    for (uint32_t i = 0; i < k; ++i) {
      acc += p[i] / sum;
      if (acc >= options_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (options_.min_p > 0.0f) {
    // p[0] is the most likely (its weight is exp(0) = 1).
    uint32_t above = 1;
    while (above < keep && p[above] >= options_.min_p * p[0]) ++above;
    keep = above;
  }
  double mass = 0;
  for (uint32_t i = 0; i < keep; ++i) mass += p[i];
  // A uniform draw in [0, 1) from 53 bits of Mix64(seed, index).
  const uint64_t r = Mix64(Mix64(options_.seed) ^ Mix64(index + 0x632be59bd9b4e019ull));
  const double u = static_cast<double>(r >> 11) * 0x1.0p-53 * mass;
  double acc = 0;
  for (uint32_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (u < acc) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace strata::model
