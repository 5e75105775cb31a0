// Byte counts as people write them on command lines: "512", "64K", "8G", "1T" (powers of 1024).
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"

namespace strata {

// False when `text` is not a count with an optional K/M/G/T suffix, or overflows.
inline bool ParseByteSize(const std::string& text, uint64_t* bytes) {
  if (text.empty()) return false;
  int shift = 0;
  std::string digits = text;
  switch (text.back()) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    case 'T': shift = 40; break;
    default: break;
  }
  if (shift != 0) digits.pop_back();
  uint64_t n = 0;
  if (!absl::SimpleAtoi(digits, &n) || (shift != 0 && n > (UINT64_MAX >> shift))) return false;
  *bytes = n << shift;
  return true;
}

}  // namespace strata
