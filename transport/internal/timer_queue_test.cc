// The timers of a BlockSender's transfers (timer_queue.h): due ones are taken in time order, ones
// no longer live are dropped, removal forgets one, and a waiter wakes when told.
#include "transport/internal/timer_queue.h"

#include <thread>

#include "gtest/gtest.h"

namespace strata::transport::internal {
namespace {

TEST(TimerQueueTest, DueTimersComeOutInTimeOrderAndDeadOnesAreDropped) {
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  TimerQueue q;
  const absl::Time past = absl::Now() - absl::Seconds(10);
  q.Add(past + absl::Seconds(2), 7);
  q.Add(past, 5);
  q.Add(past + absl::Seconds(1), 6);
  q.Add(past + absl::Seconds(3), 8);
  q.Remove(past + absl::Seconds(3), 8);
  q.Remove(past + absl::Seconds(3), 9);  // not there: nothing
  EXPECT_EQ(q.size(), 3u);
  const auto live = [](uint64_t seq) { return seq != 6; };
  EXPECT_EQ(q.TakeDue(live, cv, lock), 5u);
  EXPECT_EQ(q.TakeDue(live, cv, lock), 7u);  // 6 is dead: dropped
  EXPECT_EQ(q.size(), 0u);
}

TEST(TimerQueueTest, ATimerNotYetDueWaitsUntilItIsOrTheWaiterIsWoken) {
  std::mutex mu;
  std::condition_variable cv;
  TimerQueue q;
  std::unique_lock<std::mutex> lock(mu);
  const auto live = [](uint64_t) { return true; };
  q.Add(absl::Now() + absl::Milliseconds(50), 1);
  std::optional<uint64_t> got;
  const absl::Time start = absl::Now();
  while (!(got = q.TakeDue(live, cv, lock)).has_value()) {
    ASSERT_LT(absl::Now() - start, absl::Seconds(10));
  }
  EXPECT_EQ(*got, 1u);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(49));
  // Empty: waits until notified, then returns nothing.
  std::thread waker([&] {
    std::lock_guard<std::mutex> l(mu);
    cv.notify_all();
  });
  EXPECT_FALSE(q.TakeDue(live, cv, lock).has_value());
  lock.unlock();
  waker.join();
}

}  // namespace
}  // namespace strata::transport::internal
