// A fixed pool of worker threads for data-parallel loops (attention, compression).
//
//   ThreadPool pool(4);
//   pool.ParallelFor(n, [&](size_t i) { ... });   // returns when all n calls have run
//
// The calling thread takes part in the work. ParallelFor may be called from several threads at
// once (calls are serialized); it must not be called from inside one of its own tasks.
#pragma once

#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace strata {

class ThreadPool {
 public:
  // threads <= 0: one per hardware thread. A pool of 1 runs everything on the caller.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

  // A process-wide pool with one thread per hardware thread.
  static ThreadPool& Default();

 private:
  void WorkerLoop();
  void RunTasks();

  absl::Mutex call_mu_;  // serializes ParallelFor calls
  absl::Mutex mu_;
  const std::function<void(size_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t n_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  size_t done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace strata
