// EventFeed: what enters and leaves a store, for readers that pull (a router's index of who holds
// which prefix). Each event gets the next id (consecutive from 1 in one incarnation of the store);
// the last `capacity` events are kept in a ring. A reader that fell behind the ring (or holds ids
// of another incarnation) is told so (EventRead::gap) and takes the store's Snapshot() instead.
// Thread-safe; Append never waits on a reader for longer than a copy takes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "absl/time/time.h"
#include "common/prefix_key.h"
#include "kvstore/tier_ledger.h"

namespace strata::kvstore {

enum class BlockEventKind : uint8_t { kStored = 1, kRemoved = 2 };
const char* BlockEventKindName(BlockEventKind k);

struct BlockEvent {
  uint64_t id = 0;  // consecutive from 1 per incarnation of the store
  BlockEventKind kind = BlockEventKind::kStored;
  BlockName name;
  Tier tier = Tier::kNone;  // kStored: the fastest tier holding it; kRemoved: kNone
};

struct EventRead {
  std::vector<BlockEvent> events;   // ids after_id + 1, after_id + 2, ... (none on a gap)
  uint64_t first_available_id = 1;  // oldest id the ring holds (last_id + 1 when it holds none)
  uint64_t last_id = 0;             // newest id so far (0: none yet)
  // The events after `after_id` are no longer all in the ring, or after_id is beyond last_id
  // (ids of another incarnation): the reader lost events and must take a Snapshot().
  bool gap = false;
};

class EventFeed {
 public:
  explicit EventFeed(size_t capacity) : capacity_(capacity) {}

  // Gives the event the next id, keeps it (dropping the oldest beyond capacity), wakes readers.
  void Append(BlockEventKind kind, const BlockName& name, Tier tier);
  // At most `max` events after `after_id`, oldest first. Waits up to `timeout` while there are
  // none (returns at once on a gap).
  EventRead Read(uint64_t after_id, size_t max, absl::Duration timeout) const;
  uint64_t last_id() const;

 private:
  const size_t capacity_;
  // std::mutex, not absl::Mutex: Debian's Abseil is not built for TSan, which then reports the
  // readers' waits as races.
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<BlockEvent> events_;  // the last capacity_ events (guarded by mu_)
  uint64_t last_id_ = 0;           // (guarded by mu_)
};

}  // namespace strata::kvstore
