#include "model/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace strata::model {

TokenLogprobs LogprobsOf(absl::Span<const float> logits, uint32_t token, uint32_t top) {
  TokenLogprobs out;
  out.token = token;
  const uint32_t vocab = static_cast<uint32_t>(logits.size());
  if (vocab == 0) return out;
  double mx = -std::numeric_limits<double>::infinity();
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double log_z = mx + std::log(sum);
  auto lp = [&](uint32_t t) { return static_cast<float>(static_cast<double>(logits[t]) - log_z); };
  out.logprob = token < vocab ? lp(token) : -std::numeric_limits<float>::infinity();
  const uint32_t k = std::min({top, kMaxTopLogprobs, vocab});
  if (k == 0) return out;
  // A partial selection of the k largest (vocabularies run to 10^5: no full sort).
  std::vector<uint32_t> ids;
  ids.reserve(k + 1);
  auto better = [&](uint32_t a, uint32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  for (uint32_t t = 0; t < vocab; ++t) {
    if (ids.size() < k) {
      ids.push_back(t);
      std::push_heap(ids.begin(), ids.end(), better);  // heap top: the worst kept
    } else if (better(t, ids.front())) {
      std::pop_heap(ids.begin(), ids.end(), better);
      ids.back() = t;
      std::push_heap(ids.begin(), ids.end(), better);
    }
  }
  std::sort(ids.begin(), ids.end(), better);
  out.top.reserve(k);
  for (uint32_t t : ids) out.top.emplace_back(t, lp(t));
  return out;
}

}  // namespace strata::model
