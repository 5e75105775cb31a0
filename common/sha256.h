// SHA-256 (through OpenSSL's EVP interface) and the 64-bit fingerprints Strata derives from it.
//
// Sha256 is incremental: Update any number of times, then Finish once. Not thread-safe per
// object; distinct objects are independent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace strata {

using Sha256Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t n);
  void Update(absl::string_view s) { Update(s.data(), s.size()); }
  // Returns the digest; the object must not be updated afterwards.
  Sha256Digest Finish();

  static Sha256Digest Hash(const void* data, size_t n);
  static Sha256Digest Hash(absl::string_view s) { return Hash(s.data(), s.size()); }

 private:
  struct Ctx;
  Ctx* ctx_;  // owned; an EVP_MD_CTX (kept out of this header)
};

// Lower-case hexadecimal of any byte string.
std::string ToHex(const uint8_t* data, size_t n);
inline std::string ToHex(const Sha256Digest& d) { return ToHex(d.data(), d.size()); }

// A 64-bit identifier for configuration text (a codec spec, a model config): the first 8 bytes
// of its SHA-256, read little-endian. Stable across machines and builds.
uint64_t Fingerprint64(absl::string_view bytes);

}  // namespace strata
