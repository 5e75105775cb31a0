// AlignedBuffer: an owned, zero-initialized byte buffer whose start is aligned to 64 bytes (a
// cache line; enough for any vector load). Move-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "absl/types/span.h"

namespace strata {

class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t size) : size_(size) {
    if (size == 0) return;
    const size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, rounded);
    data_.reset(static_cast<uint8_t*>(p));
  }

  // Without zeroing, for buffers about to be overwritten whole (copies of blocks).
  static AlignedBuffer Uninitialized(size_t size) {
    AlignedBuffer b;
    b.size_ = size;
    if (size == 0) return b;
    const size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) throw std::bad_alloc();
    if (rounded > size) std::memset(static_cast<uint8_t*>(p) + size, 0, rounded - size);
    b.data_.reset(static_cast<uint8_t*>(p));
    return b;
  }

  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  absl::Span<uint8_t> span() { return {data_.get(), size_}; }
  absl::Span<const uint8_t> span() const { return {data_.get(), size_}; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0;
};

}  // namespace strata
