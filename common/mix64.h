// SplitMix64's step and finalizer: a well-mixed 64-bit value from any 64-bit input (small
// integers, a seed plus an index), for hashing ids and seeding without a generator's state.
#pragma once

#include <cstdint>

namespace strata {

inline constexpr uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ull;

// The value SplitMix64 draws from state `x` (the state advanced by the gamma, then mixed).
inline uint64_t Mix64(uint64_t x) {
  x += kSplitMix64Gamma;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace strata
