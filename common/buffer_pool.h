// BufferPool<Item>: keeps released buffers by exact size and hands them out again. Blocks of one
// model and codec all come in a few sizes, so this removes per-block allocation churn (no
// malloc, no zeroing, pages stay faulted in, registrations stay made). The pool keeps at most
// `max_idle_bytes` of idle items; beyond that a released item is destroyed.
//
// Item is anything with `size_t size() const`: AlignedBuffer for the store's RAM tier, a buffer
// plus its transport registration for the block receiver. Items are handed out as shared_ptrs
// whose deleter returns them here, so one that outlives its owner still ends correctly (the
// deleter keeps the pool alive). Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/aligned_buffer.h"

namespace strata {

template <typename Item>
class BufferPool : public std::enable_shared_from_this<BufferPool<Item>> {
 public:
  static std::shared_ptr<BufferPool> Create(size_t max_idle_bytes) {
    return std::shared_ptr<BufferPool>(new BufferPool(max_idle_bytes));
  }

  // An idle item of exactly `size` bytes, or nullptr when there is none.
  std::shared_ptr<Item> Reuse(size_t size) {
    std::unique_ptr<Item> item;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = idle_.find(size);
      if (it == idle_.end() || it->second.empty()) return nullptr;
      item = std::move(it->second.back());
      it->second.pop_back();
      idle_bytes_ -= size;
      ++reused_;
    }
    return Track(std::move(item));
  }

  // Hands out a new item; it comes back to the pool when released.
  std::shared_ptr<Item> Track(std::unique_ptr<Item> item) {
    std::shared_ptr<BufferPool> self = this->shared_from_this();
    return std::shared_ptr<Item>(item.release(), [self](Item* p) {
      self->Recycle(std::unique_ptr<Item>(p));
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

  void Recycle(std::unique_ptr<Item> item) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_bytes_ + item->size() > max_idle_bytes_) return;  // destroyed
    idle_bytes_ += item->size();
    idle_[item->size()].push_back(std::move(item));
  }

  const size_t max_idle_bytes_;
  mutable std::mutex mu_;
  absl::flat_hash_map<size_t, std::vector<std::unique_ptr<Item>>> idle_;
  size_t idle_bytes_ = 0;
  size_t reused_ = 0;
};

// A buffer of exactly `size` bytes from `pool`, contents undefined.
inline std::shared_ptr<AlignedBuffer> AcquireBuffer(BufferPool<AlignedBuffer>& pool, size_t size) {
  if (std::shared_ptr<AlignedBuffer> b = pool.Reuse(size)) return b;
  return pool.Track(std::make_unique<AlignedBuffer>(AlignedBuffer::Uninitialized(size)));
}

}  // namespace strata
