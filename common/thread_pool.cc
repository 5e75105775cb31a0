#include "common/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace strata {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::Default() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

namespace {

// How long a thread polls for what it waits on before it sleeps on a condition variable.
constexpr auto kSpin = std::chrono::microseconds(50);

// Polls ready() until it is true or kSpin has passed.
template <typename Ready>
void SpinUntil(Ready ready) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return;
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#else
      std::this_thread::yield();
#endif
    }
    if (std::chrono::steady_clock::now() >= end) return;
  }
}

}  // namespace

// Claims and runs task indices until none are left.
void ThreadPool::RunTasks() {
  std::unique_lock<std::mutex> lock(mu_);
  while (fn_ != nullptr && next_ < n_) {
    const size_t i = next_++;
    const std::function<void(size_t)>* fn = fn_;
    lock.unlock();
    (*fn)(i);
    lock.lock();
    if (++done_ == n_) done_cv_.notify_all();
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    SpinUntil([&] { return generation_.load(std::memory_order_relaxed) != seen; });
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock,
                    [&] { return stop_ || (generation_ != seen && fn_ != nullptr && next_ < n_); });
      if (stop_) return;
      seen = generation_;
    }
    RunTasks();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    done_ = 0;
    ++generation_;
  }
  work_cv_.notify_all();
  RunTasks();
  SpinUntil([&] { return done_.load(std::memory_order_relaxed) == n; });
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ == n_; });
  fn_ = nullptr;
}

}  // namespace strata
