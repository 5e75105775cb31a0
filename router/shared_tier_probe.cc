#include "router/shared_tier_probe.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "common/check.h"

namespace strata::router {

SharedTierProbe::SharedTierProbe(std::unique_ptr<kvstore::SharedTier> tier,
                                 std::vector<BlockName> layer_names, uint32_t max_chunks)
    : tier_(std::move(tier)), layer_names_(std::move(layer_names)), max_chunks_(max_chunks) {
  STRATA_CHECK(tier_ != nullptr && !layer_names_.empty() && max_chunks_ >= 1,
               "SharedTierProbe needs a tier, the model's layer names and max_chunks >= 1");
}

uint32_t SharedTierProbe::LeadingChunks(absl::Span<const BlockHash> chain, uint32_t known,
                                        SharedTierProbeStats* call) {
  SharedTierProbeStats unused;
  if (call == nullptr) call = &unused;
  *call = {};
  const uint32_t total = static_cast<uint32_t>(chain.size());
  known = std::min(known, total);
  if (known == total) return known;
  const uint32_t asked = std::min(max_chunks_, total - known);
  std::vector<kvstore::SharedTier::Key> keys;
  keys.reserve(asked);
  for (uint32_t c = known; c < known + asked; ++c) {
    BlockName name = layer_names_.back();
    name.key = chain[c];
    keys.push_back({.name = name, .chunk_index = c});
  }
  const absl::Time start = absl::Now();
  const std::vector<absl::StatusOr<bool>> present = tier_->Contains(keys);
  const absl::Duration took = absl::Now() - start;
  call->probes = 1;
  call->seconds = absl::ToDoubleSeconds(took);
  uint32_t run = 0;
  for (const absl::StatusOr<bool>& p : present) {
    if (!p.ok()) {  // what answered before the error stands
      call->errors = 1;
      break;
    }
    if (!*p) break;
    ++run;
  }
  call->chunks_found = run;
  return known + run;
}

}  // namespace strata::router
