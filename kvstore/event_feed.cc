#include "kvstore/event_feed.h"

#include <algorithm>
#include <utility>

namespace strata::kvstore {

const char* BlockEventKindName(BlockEventKind k) {
  return k == BlockEventKind::kStored ? "stored" : "removed";
}

void EventFeed::Append(BlockEventKind kind, const BlockName& name, Tier tier) {
  BlockEvent ev;
  ev.kind = kind;
  ev.name = name;
  ev.tier = tier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ev.id = ++last_id_;
    events_.push_back(std::move(ev));
    if (events_.size() > capacity_) events_.pop_front();
  }
  cv_.notify_all();
}

EventRead EventFeed::Read(uint64_t after_id, size_t max, absl::Duration timeout) const {
  EventRead r;
  std::unique_lock<std::mutex> lock(mu_);
  auto first_available = [&] { return events_.empty() ? last_id_ + 1 : events_.front().id; };
  auto gap = [&] { return after_id > last_id_ || after_id + 1 < first_available(); };
  auto ready = [&] { return last_id_ > after_id || gap(); };
  if (timeout == absl::InfiniteDuration()) {
    cv_.wait(lock, ready);
  } else if (timeout > absl::ZeroDuration()) {
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24))), ready);
  }
  r.first_available_id = first_available();
  r.last_id = last_id_;
  r.gap = gap();
  if (r.gap || last_id_ <= after_id) return r;
  // Ids are consecutive: the event after `after_id` sits at a known index.
  const size_t from = static_cast<size_t>(after_id + 1 - r.first_available_id);
  const size_t n = std::min(max, events_.size() - from);
  r.events.assign(events_.begin() + from, events_.begin() + from + n);
  return r;
}

uint64_t EventFeed::last_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_id_;
}

}  // namespace strata::kvstore
