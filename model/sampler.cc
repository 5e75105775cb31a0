#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace strata::model {
namespace {

// SplitMix64's finalizer: a well-mixed 64-bit value from (seed, index).
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

absl::Status SamplingOptions::Validate() const {
  if (!(temperature >= 0.0f && temperature <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: temperature must be in [0, 2], got ", temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: top_p must be in (0, 1], got ", top_p));
  }
  return absl::OkStatus();
}

uint32_t Sampler::Sample(absl::Span<const float> logits, uint64_t index) const {
  const uint32_t vocab = static_cast<uint32_t>(logits.size());
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
  // Nucleus: the smallest prefix whose mass reaches top_p.
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
  double mass = 0;
  for (uint32_t i = 0; i < keep; ++i) mass += p[i];
  // A uniform draw in [0, 1) from 53 bits of Mix(seed, index).
  const uint64_t r = Mix(Mix(options_.seed) ^ Mix(index + 0x632be59bd9b4e019ull));
  const double u = static_cast<double>(r >> 11) * 0x1.0p-53 * mass;
  double acc = 0;
  for (uint32_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (u < acc) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace strata::model
