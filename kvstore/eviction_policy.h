// Eviction policies of the store's tiers: which resident entry goes next.
//
//   LRU      least recently used first.
//   S3-FIFO  (Yang et al., SOSP'23) a small FIFO (10 % of the bytes) that new entries enter, a
//            main FIFO for entries that were hit while in the small one or that come back soon
//            after eviction (a ghost FIFO remembers recently evicted ids), two-bit access counts
//            that buy entries another lap of the main FIFO. Scan-resistant: a one-pass scan of
//            new prefixes leaves through the small FIFO without flushing the reused ones.
//
// Sizes are bytes; entries are ids the tier assigns. Policies are not thread-safe (the tier
// holds its lock). Victim() skips entries `pinned` says are in use (leased, or prefixes whose
// descendants are still resident: prefix caches evict leaves first) and treats them as used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::kvstore {

enum class PolicyKind { kLru, kS3Fifo };

// "lru" or "s3fifo"; kInvalidArgument otherwise.
absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name);
const char* PolicyName(PolicyKind kind);

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual void Insert(uint64_t id, size_t bytes) = 0;  // a new resident entry
  virtual void Access(uint64_t id) = 0;                // a hit
  virtual void Erase(uint64_t id) = 0;                 // removed, not by eviction (delete)
  virtual void Evict(uint64_t id) = 0;                 // removed by eviction (S3-FIFO: ghost)
  // The entry to evict next; nullopt when every entry is pinned (or there are none). May
  // reorder entries (S3-FIFO moves hit entries on); does not remove the victim.
  virtual std::optional<uint64_t> Victim(const std::function<bool(uint64_t)>& pinned) = 0;
  virtual size_t size() const = 0;  // resident entries
};

std::unique_ptr<EvictionPolicy> MakePolicy(PolicyKind kind, size_t capacity_bytes);

}  // namespace strata::kvstore
