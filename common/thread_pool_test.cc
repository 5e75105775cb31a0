#include "common/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace strata {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (size_t n : {0, 1, 3, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << i;
    }
  }
}

TEST(ThreadPoolTest, BackToBackCallsEachRunTheirOwnIndicesOnce) {
  // Calls of a few short tasks in a row, each with its own function and size: a worker still
  // running an earlier call must not claim an index of the next one (it would run it with the
  // earlier function, and the next call would miss that index or return before it ran).
  ThreadPool pool(4);
  for (int rep = 0; rep < 3000; ++rep) {
    const size_t n = 2 + rep % 17;
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&, n](size_t i) {
      ASSERT_LT(i, n);
      hits[i].fetch_add(1);
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "call " << rep << " index " << i;
  }
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerializedSafely) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) {
        pool.ParallelFor(64, [&](size_t i) { sum.fetch_add(static_cast<long>(i)); });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4L * 50 * (63 * 64 / 2));
}

}  // namespace
}  // namespace strata
