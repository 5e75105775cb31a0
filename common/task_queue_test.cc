#include "common/task_queue.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace strata {
namespace {

// One thread runs tasks in the order they were posted; Stop runs what is queued first.
TEST(TaskQueueTest, OneThreadRunsTasksInOrderAndStopRunsWhatIsQueued) {
  std::vector<int> order;
  std::mutex mu;
  TaskQueue q(1);
  std::atomic<bool> release{false};
  ASSERT_TRUE(q.Post([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }));
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(q.Post([&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    }));
  }
  release.store(true);
  q.Stop();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_FALSE(q.Post([&] { order.push_back(-1); }));  // stopped: not run
  q.Stop();                                            // again: nothing
  EXPECT_EQ(order.size(), 100u);
}

// Several threads run every task exactly once, posted from several threads.
TEST(TaskQueueTest, EveryTaskRunsOnceAcrossThreads) {
  std::atomic<int> sum{0};
  {
    TaskQueue q(3);
    std::vector<std::thread> posters;
    for (int p = 0; p < 4; ++p) {
      posters.emplace_back([&] {
        for (int i = 1; i <= 250; ++i) EXPECT_TRUE(q.Post([&, i] { sum += i; }));
      });
    }
    for (std::thread& t : posters) t.join();
  }  // the destructor runs what is queued
  EXPECT_EQ(sum.load(), 4 * (250 * 251 / 2));
}

}  // namespace
}  // namespace strata
