// The decode scheduler's two decisions, over byte counts only (no model, no sequences, no locks),
// so that they can be read and tested on their own (DecodeEngine::Loop runs them every step):
//
//   Admission: which waiting sequences join the running batch. In queue order (first come, first
//   served: a large sequence is never overtaken and starved), while the batch has a place and the
//   KV budget holds the newcomer's bytes. An empty batch always takes the first (it has to run
//   sometime; preemption makes room for the others later).
//   Preemption: how many running sequences stay when their KV outgrew the budget (the shared
//   blocks of a cached prefix count once, so it is not a sum): the newest go to the store until
//   the rest fit, never the last one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"

namespace strata::decode {

struct BatchLimits {
  uint32_t max_batch = 0;        // sequences stepped together, >= 1
  uint64_t kv_budget_bytes = 0;  // compressed blocks + windows of the running sequences
};

// `running` sequences hold `in_use` bytes; need[i] is what the i-th waiting sequence would add
// (its bytes less the blocks running ones hold already). Returns how many join, from the front.
size_t PlanAdmission(const BatchLimits& limits, size_t running, uint64_t in_use,
                     absl::Span<const uint64_t> need);

// `live` running sequences, oldest first; bytes_of_first(k) is what the first k hold together.
// Returns how many stay (the first ones, at least one when live > 0); the others are preempted,
// newest first.
size_t PlanPreemption(const BatchLimits& limits, size_t live,
                      absl::FunctionRef<uint64_t(size_t)> bytes_of_first);

}  // namespace strata::decode
