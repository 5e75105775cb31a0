#include "common/sha256.h"

#include <openssl/evp.h>

#include <cstring>

#include "common/check.h"

namespace strata {

struct Sha256::Ctx {
  EVP_MD_CTX* md;
};

// OpenSSL fails here only on allocation failure or a broken installation: programmer-level
// errors, hence STRATA_CHECK rather than a Status.
Sha256::Sha256() : ctx_(new Ctx{EVP_MD_CTX_new()}) {
  STRATA_CHECK(ctx_->md != nullptr, "EVP_MD_CTX_new failed");
  STRATA_CHECK(EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) == 1,
               "EVP_DigestInit_ex(sha256) failed");
}

Sha256::~Sha256() {
  EVP_MD_CTX_free(ctx_->md);
  delete ctx_;
}

void Sha256::Update(const void* data, size_t n) {
  if (n == 0) return;
  STRATA_CHECK(EVP_DigestUpdate(ctx_->md, data, n) == 1, "EVP_DigestUpdate failed");
}

Sha256Digest Sha256::Finish() {
  Sha256Digest d{};
  unsigned int len = 0;
  STRATA_CHECK(EVP_DigestFinal_ex(ctx_->md, d.data(), &len) == 1 && len == d.size(),
               "EVP_DigestFinal_ex failed");
  return d;
}

Sha256Digest Sha256::Hash(const void* data, size_t n) {
  Sha256 h;
  h.Update(data, n);
  return h.Finish();
}

std::string ToHex(const uint8_t* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kDigits[data[i] >> 4];
    s[2 * i + 1] = kDigits[data[i] & 0xf];
  }
  return s;
}

uint64_t Fingerprint64(absl::string_view bytes) {
  const Sha256Digest d = Sha256::Hash(bytes);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | d[i];
  return v;
}

}  // namespace strata
