// Little-endian loads and stores at any alignment. Strata's formats are little-endian on the
// wire and on disk; these compile to plain moves on x86-64 and ARM64.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace strata {

static_assert(std::endian::native == std::endian::little,
              "Strata's block and key formats assume a little-endian host");

template <typename T>
inline T LoadLE(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void StoreLE(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace strata
