// A fixed pool of worker threads for data-parallel loops (attention, compression).
//
//   ThreadPool pool(4);
//   pool.ParallelFor(n, [&](size_t i) { ... });   // returns when all n calls have run
//
// The calling thread takes part in the work. Between calls a worker polls for the next one for
// 50 us before it sleeps, and the caller polls as long for its last task: a call then costs 2-5 us
// beyond its tasks on 2 threads, against 12-25 when they sleep. ParallelFor may be called from
// several threads at once (calls are serialized); it must not be called from inside one of its
// own tasks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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

  // std::mutex rather than absl::Mutex: Debian's Abseil is not built with ThreadSanitizer
  // annotations, so TSan cannot see absl::Mutex synchronize and reports false races; pthread-based
  // std::mutex it understands. Everything below call_mu_ is guarded by mu_.
  std::mutex call_mu_;  // serializes ParallelFor calls
  std::mutex mu_;
  std::condition_variable work_cv_;  // a new generation of tasks, or stop
  std::condition_variable done_cv_;  // done_ reached n_
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  size_t next_ = 0;
  // Written under mu_; atomic so that a worker done with a call can watch for the next one, and
  // the caller for the last task, without the lock before they sleep (the polling of the file
  // comment; measured by common_benchmark's BM_ParallelForOverhead).
  std::atomic<size_t> done_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace strata
