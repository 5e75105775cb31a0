// A few threads running queued tasks in the order they arrive: work handed off to run later (the
// block receiver's checksum verification and delivery), where ThreadPool (thread_pool.h) runs a
// data-parallel loop and waits for it.
//
//   TaskQueue tasks(2);
//   if (!tasks.Post([=] { Verify(block); })) { ... }  // false once stopped: not run
//   tasks.Stop();  // runs what is queued, then joins (the destructor does too)
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace strata {

class TaskQueue {
 public:
  explicit TaskQueue(int threads);
  ~TaskQueue() { Stop(); }
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // Queues `task`; false once stopped (the task is not run).
  bool Post(std::function<void()> task);
  // Runs what is queued, then joins the threads. Idempotent.
  void Stop();

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::vector<std::thread> threads_;         // constant after construction
};

}  // namespace strata
