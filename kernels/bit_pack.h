// Bit packing of unsigned codes: an LSB-first bit stream, value i occupying bits
// [i*bits, (i+1)*bits). With bits in {2, 4, 8} a byte holds whole values; with 3 bits, 8 values
// fill 3 bytes. PackedBytes(n, bits) == ceil(n * bits / 8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::kernels {

constexpr size_t PackedBytes(size_t n, int bits) { return (n * bits + 7) / 8; }

// out must hold PackedBytes(n, bits) bytes; codes must be < 2^bits.
inline void PackBits(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
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
