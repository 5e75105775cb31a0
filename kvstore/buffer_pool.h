// BufferPool: the RAM tier's allocator. Blocks of one model and codec all have the same few
// sizes, so freed block buffers are kept by exact size and handed out again instead of going
// back to malloc (no per-block allocation churn, no zeroing, pages stay faulted in). The pool
// keeps at most `max_idle_bytes` of idle buffers; beyond that they are freed.
//
// Buffers are shared_ptrs whose deleter returns them here, so a lease that outlives the store
// still frees correctly (the deleter keeps the pool alive). Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/aligned_buffer.h"

namespace strata::kvstore {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static std::shared_ptr<BufferPool> Create(size_t max_idle_bytes) {
    return std::shared_ptr<BufferPool>(new BufferPool(max_idle_bytes));
  }

  // A buffer of exactly `size` bytes, contents undefined.
  std::shared_ptr<AlignedBuffer> Acquire(size_t size) {
    std::unique_ptr<AlignedBuffer> b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = idle_.find(size);
      if (it != idle_.end() && !it->second.empty()) {
        b = std::move(it->second.back());
        it->second.pop_back();
        idle_bytes_ -= size;
        ++reused_;
      }
    }
    if (b == nullptr) b = std::make_unique<AlignedBuffer>(AlignedBuffer::Uninitialized(size));
    std::shared_ptr<BufferPool> self = shared_from_this();
    return std::shared_ptr<AlignedBuffer>(b.release(), [self](AlignedBuffer* p) {
      self->Recycle(std::unique_ptr<AlignedBuffer>(p));
    });
  }

  size_t idle_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_bytes_;
  }
  size_t reused() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reused_;
  }

 private:
  explicit BufferPool(size_t max_idle_bytes) : max_idle_bytes_(max_idle_bytes) {}

  void Recycle(std::unique_ptr<AlignedBuffer> b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_bytes_ + b->size() > max_idle_bytes_) return;  // freed
    idle_bytes_ += b->size();
    idle_[b->size()].push_back(std::move(b));
  }

  const size_t max_idle_bytes_;
  mutable std::mutex mu_;
  absl::flat_hash_map<size_t, std::vector<std::unique_ptr<AlignedBuffer>>> idle_;
  size_t idle_bytes_ = 0;
  size_t reused_ = 0;
};

}  // namespace strata::kvstore
