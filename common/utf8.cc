#include "common/utf8.h"

#include <cstdint>

namespace strata {
namespace {

enum class Step { kChar, kInvalid, kIncomplete };

// Looks at the sequence starting at p[i] (i < n). kChar: a well-formed character of *len bytes.
// kInvalid: an ill-formed maximal subpart of *len >= 1 bytes. kIncomplete: p[i, n) is a proper
// prefix of a well-formed character (*len = n - i).
Step Next(const uint8_t* p, size_t n, size_t i, size_t* len) {
  const uint8_t c = p[i];
  if (c < 0x80) {
    *len = 1;
    return Step::kChar;
  }
  size_t need;
  uint8_t lo = 0x80, hi = 0xbf;  // allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    need = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    need = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    need = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    *len = 1;
    return Step::kInvalid;
  }
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= n) {
      *len = k;
      return Step::kIncomplete;
    }
    const uint8_t b = p[i + k];
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b & 0xc0) == 0x80;
    if (!ok) {
      *len = k;
      return Step::kInvalid;
    }
  }
  *len = need;
  return Step::kChar;
}

}  // namespace

bool IsValidUtf8(absl::string_view s, size_t* error_offset) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    size_t len = 0;
    if (Next(p, n, i, &len) != Step::kChar) {
      if (error_offset != nullptr) *error_offset = i;
      return false;
    }
    i += len;
  }
  return true;
}

size_t AppendUtf8Replacing(absl::string_view in, bool final, std::string* out) {
  const auto* p = reinterpret_cast<const uint8_t*>(in.data());
  const size_t n = in.size();
  size_t i = 0;
  while (i < n) {
    size_t len = 0;
    switch (Next(p, n, i, &len)) {
      case Step::kChar:
        out->append(in.data() + i, len);
        break;
      case Step::kIncomplete:
        if (!final) return i;
        [[fallthrough]];
      case Step::kInvalid:
        out->append(kUtf8Replacement.data(), kUtf8Replacement.size());
        break;
    }
    i += len;
  }
  return i;
}

}  // namespace strata
