#include "decode_node/batch_planner.h"

namespace strata::decode {

size_t PlanAdmission(const BatchLimits& limits, size_t running, uint64_t in_use,
                     absl::Span<const uint64_t> need) {
  size_t admitted = 0;
  while (admitted < need.size() && running + admitted < limits.max_batch) {
    const bool empty = running + admitted == 0;
    if (!empty && in_use + need[admitted] > limits.kv_budget_bytes) break;
    in_use += need[admitted];
    ++admitted;
  }
  return admitted;
}

size_t PlanPreemption(const BatchLimits& limits, size_t live,
                      absl::FunctionRef<uint64_t(size_t)> bytes_of_first) {
  size_t keep = live;
  while (keep > 1 && bytes_of_first(keep) > limits.kv_budget_bytes) --keep;
  return keep;
}

}  // namespace strata::decode
