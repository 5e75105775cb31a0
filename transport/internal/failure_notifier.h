// An endpoint's health and its failure callbacks, for backends (private to transport/).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

#include "absl/status/status.h"

namespace strata::transport::internal {

class FailureNotifier {
 public:
  absl::Status health() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_;
  }

  // Runs `fn` at once (on the caller) if already failed.
  uint64_t Add(std::function<void(const absl::Status&)> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t handle = ++next_;
    if (!failed_.ok()) {
      const absl::Status s = failed_;
      lock.unlock();
      fn(s);
      return handle;
    }
    callbacks_.emplace(handle, std::move(fn));
    return handle;
  }

  void Remove(uint64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks_.erase(handle);
  }

  // The first failure wins; returns false if it had already failed. Callbacks run on the caller.
  bool Fail(absl::Status why) {
    std::map<uint64_t, std::function<void(const absl::Status&)>> callbacks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_.ok()) return false;
      failed_ = why;
      callbacks.swap(callbacks_);
    }
    for (auto& [handle, fn] : callbacks) fn(why);
    return true;
  }

 private:
  mutable std::mutex mu_;
  absl::Status failed_;
  uint64_t next_ = 0;
  std::map<uint64_t, std::function<void(const absl::Status&)>> callbacks_;
};

}  // namespace strata::transport::internal
