// Internal to kernels/: the encoders' working form of a tensor. Every codec (codec.cc) first
// turns a chunk's K or V into head-major fp32 ([kv_heads, tokens, head_dim]), checking each value
// against the codec's range; SKVQ's reordering stage happens in that same pass (ToHeadMajor's
// `perm`). The stages (affine_stage.h, outlier_stage.h) then work on it in per-thread scratch
// memory that is reused from chunk to chunk (Scratch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block_format.h"
#include "common/half.h"
#include "kernels/codec.h"

namespace strata::kernels::internal {

// Freed scratch blocks kept per thread for the next chunk. A chunk's scratch is megabytes, and
// glibc hands blocks that large back to the kernel on free (mmap above 128 KiB, or a trimmed heap
// top), so without this every chunk paid its page faults again: 40 % of GEAR's encode time in
// kernels_benchmark. At most kMaxBlocks blocks and kMaxBytes per thread are kept. Not
// thread-safe: each thread uses its own (ThisThread).
class ScratchCache {
 public:
  ~ScratchCache();
  // A block of at least `bytes`; its real size in *size.
  void* Get(size_t bytes, size_t* size);
  // Takes back a block from Get (`size` as Get reported it), or frees it.
  void Put(void* p, size_t size);
  static ScratchCache& ThisThread();

 private:
  static constexpr size_t kMaxBlocks = 16;
  static constexpr size_t kMaxBytes = size_t{64} << 20;
  struct Block {
    void* p;
    size_t size;
  };
  std::vector<Block> blocks_;
  size_t cached_ = 0;
};

// An allocator whose resize leaves new elements uninitialized: the codecs' per-chunk scratch
// (a chunk's values, codes and residual, up to megabytes) is written whole before it is
// read, and zeroing it first cost a memory pass each. Blocks of 64 KiB and more come from and
// go back to the thread's ScratchCache (a header before the elements keeps the block's size).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  static constexpr size_t kCached = size_t{64} << 10;
  static constexpr size_t kHeader = 16;  // the elements stay aligned as operator new's
  static_assert(alignof(T) <= kHeader);
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kCached) return std::allocator<T>::allocate(n);
    size_t size = 0;
    auto* block = static_cast<char*>(ScratchCache::ThisThread().Get(bytes + kHeader, &size));
    std::memcpy(block, &size, sizeof(size));
    return reinterpret_cast<T*>(block + kHeader);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kCached) {
      std::allocator<T>::deallocate(p, n);
      return;
    }
    char* block = reinterpret_cast<char*>(p) - kHeader;
    size_t size;
    std::memcpy(&size, block, sizeof(size));
    ScratchCache::ThisThread().Put(block, size);
  }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using Scratch = std::vector<T, DefaultInitAllocator<T>>;

// One tensor (K or V) in head-major fp32: x[(h * T + t) * D + d].
struct HeadMajor {
  uint32_t t = 0, h = 0, d = 0;
  Scratch<float> x;
  float& at(uint32_t head, uint32_t tok, uint32_t ch) {
    return x[(size_t{head} * t + tok) * d + ch];
  }
};

// Converts one row of `n` source values at element `offset` of `p` to float.
void SourceRow(const void* p, SourceDType dt, size_t offset, size_t n, float* out);

// The chunk's `src` tensor (c.k or c.v, called `name` in errors) head-major in float, every value
// checked against `limit`: kInvalidArgument naming the first value that is not finite or exceeds
// it. With `perm` ([H][D], SKVQ's calibrated channel order), each row's channels are stored in
// that order (row[i] = channel perm[h * D + i]).
absl::StatusOr<HeadMajor> ToHeadMajor(const KvChunkView& c, const void* src, const char* name,
                                      float limit, const uint16_t* perm = nullptr);

// The fp16 metadata's conversions, by bits.
inline uint16_t F16(float f) { return FloatToHalfBits(f); }
inline float F32(uint16_t h) { return HalfBitsToFloat(h); }

// max |x[i]| over [0, n), NaNs skipped (0 for none).
float MaxAbs(const float* x, size_t n);

}  // namespace strata::kernels::internal
