// SharedBytes: the one owner type for a block's bytes wherever they live — a buffer the codec
// wrote (AlignedBuffer), a transport receiver's registered memory (BlockReceiver), a store's
// pinned RAM copy (kvstore::Lease). A read-only view plus a shared owner that keeps the view
// valid; copying a SharedBytes shares the bytes, never copies them. So a block computed once is
// sent, kept in a sequence's cache and stored without a copy of its own at each step.
//
// Thread-safe to copy and read from several threads (the bytes are immutable while shared).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/types/span.h"
#include "common/aligned_buffer.h"

namespace strata {

class SharedBytes {
 public:
  SharedBytes() = default;
  // `bytes` must stay valid while `owner` lives.
  SharedBytes(absl::Span<const uint8_t> bytes, std::shared_ptr<const void> owner)
      : bytes_(bytes), owner_(std::move(owner)) {}

  // Takes ownership of a buffer.
  static SharedBytes FromBuffer(AlignedBuffer buffer) {
    auto owned = std::make_shared<const AlignedBuffer>(std::move(buffer));
    absl::Span<const uint8_t> span = owned->span();
    return SharedBytes(span, std::move(owned));
  }
  // Shares a buffer someone else also holds.
  static SharedBytes FromShared(std::shared_ptr<const AlignedBuffer> buffer) {
    if (buffer == nullptr) return SharedBytes();
    absl::Span<const uint8_t> span = buffer->span();
    return SharedBytes(span, std::move(buffer));
  }

  absl::Span<const uint8_t> span() const { return bytes_; }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }
  bool empty() const { return bytes_.empty(); }
  explicit operator bool() const { return owner_ != nullptr; }
  const std::shared_ptr<const void>& owner() const { return owner_; }

 private:
  absl::Span<const uint8_t> bytes_;
  std::shared_ptr<const void> owner_;
};

}  // namespace strata
