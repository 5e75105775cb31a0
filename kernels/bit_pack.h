// Bit packing of unsigned codes: an LSB-first bit stream, value i occupying bits
// [i*bits, (i+1)*bits). With bits in {2, 4, 8} a byte holds whole values; with 3 bits, 8 values
// fill 3 bytes. PackedBytes(n, bits) == ceil(n * bits / 8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::kernels {

constexpr size_t PackedBytes(size_t n, int bits) { return (n * bits + 7) / 8; }

namespace internal {
template <int kBits>
inline void PackWhole(const uint8_t* codes, size_t n, uint8_t* out) {
  constexpr size_t kPer = 8 / kBits;
  size_t i = 0;
  for (; i + kPer <= n; i += kPer) {
    uint8_t b = 0;
    for (size_t k = 0; k < kPer; ++k) b |= static_cast<uint8_t>(codes[i + k] << (kBits * k));
    *out++ = b;
  }
  if (i < n) {
    uint8_t b = 0;
    for (size_t k = 0; i + k < n; ++k) b |= static_cast<uint8_t>(codes[i + k] << (kBits * k));
    *out = b;
  }
}
}  // namespace internal

// out must hold PackedBytes(n, bits) bytes; codes must be < 2^bits.
inline void PackBits(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  if (n == 0) return;
  switch (bits) {
    case 8:
      std::memcpy(out, codes, n);
      return;
    case 4:
      internal::PackWhole<4>(codes, n, out);
      return;
    case 2:
      internal::PackWhole<2>(codes, n, out);
      return;
    case 1:
      internal::PackWhole<1>(codes, n, out);
      return;
    default:
      break;
  }
  std::memset(out, 0, PackedBytes(n, bits));
  size_t bit = 0;
  for (size_t i = 0; i < n; ++i, bit += bits) {
    const uint32_t v = static_cast<uint32_t>(codes[i]) << (bit & 7);
    out[bit >> 3] |= static_cast<uint8_t>(v);
    if ((bit & 7) + bits > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(v >> 8);
  }
}

// The code at index i of a packed stream.
inline uint32_t UnpackBit(const uint8_t* packed, size_t i, int bits) {
  const size_t bit = i * bits;
  uint32_t v = packed[bit >> 3] >> (bit & 7);
  if ((bit & 7) + bits > 8) v |= static_cast<uint32_t>(packed[(bit >> 3) + 1]) << (8 - (bit & 7));
  return v & ((1u << bits) - 1u);
}

}  // namespace strata::kernels
