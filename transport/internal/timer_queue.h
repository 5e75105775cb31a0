// Timers of a protocol side's transfers (a BlockSender's deadlines and retry times) by sequence
// number. Private to transport/.
//
// Not thread-safe: the owner's mutex guards it; TakeDue waits on the owner's condition variable
// with that mutex held by `lock`.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace strata::transport::internal {

class TimerQueue {
 public:
  void Add(absl::Time when, uint64_t seq) { timers_.emplace(when, seq); }

  // Forgets `seq`'s timer at `when` (one of them, if added twice).
  void Remove(absl::Time when, uint64_t seq) {
    auto range = timers_.equal_range(when);
    for (auto t = range.first; t != range.second; ++t) {
      if (t->second == seq) {
        timers_.erase(t);
        return;
      }
    }
  }

  size_t size() const { return timers_.size(); }

  // Waits on `cv` until the first timer still `live` (the others are dropped) is due, and takes
  // it; nullopt when woken before then (the caller checks why, and calls again).
  std::optional<uint64_t> TakeDue(const std::function<bool(uint64_t)>& live,
                                  std::condition_variable& cv, std::unique_lock<std::mutex>& lock) {
    while (!timers_.empty() && !live(timers_.begin()->second)) timers_.erase(timers_.begin());
    if (timers_.empty()) {
      cv.wait(lock);
      return std::nullopt;
    }
    const auto [when, seq] = *timers_.begin();
    if (absl::Now() < when) {
      cv.wait_until(lock, absl::ToChronoTime(when));
      return std::nullopt;
    }
    timers_.erase(timers_.begin());
    return seq;
  }

 private:
  std::multimap<absl::Time, uint64_t> timers_;
};

}  // namespace strata::transport::internal
