#include "common/thread_pool.h"

namespace strata {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::Default() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

// Claims and runs task indices until none are left.
void ThreadPool::RunTasks() {
  for (;;) {
    size_t i;
    const std::function<void(size_t)>* fn;
    {
      absl::MutexLock lock(&mu_);
      if (fn_ == nullptr || next_ >= n_) return;
      i = next_++;
      fn = fn_;
    }
    (*fn)(i);
    absl::MutexLock lock(&mu_);
    ++done_;
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || (generation_ != seen && fn_ != nullptr && next_ < n_);
      };
      mu_.Await(absl::Condition(&ready));
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
  absl::MutexLock call_lock(&call_mu_);
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    done_ = 0;
    ++generation_;
  }
  RunTasks();
  absl::MutexLock lock(&mu_);
  auto finished = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return done_ == n_; };
  mu_.Await(absl::Condition(&finished));
  fn_ = nullptr;
}

}  // namespace strata
