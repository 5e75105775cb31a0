#include "router/api_keys.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/sha256.h"

namespace strata::router {
namespace {

bool Token(absl::string_view s, size_t min, size_t max) {
  if (s.size() < min || s.size() > max) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

std::string HashOf(absl::string_view key) { return ToHex(Sha256::Hash(key)); }

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("API keys: cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str(), path);
}

absl::StatusOr<ApiKeys> ApiKeys::Parse(absl::string_view text, absl::string_view source) {
  ApiKeys keys;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    auto error = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("API keys: ", source, ":", line_no, ": ", what));
    };
    if (f.size() != 2) return error("expected 'KEY TENANT'");
    if (!Token(f[0], 16, 256)) {
      return error("a key is 16 to 256 characters of A-Z, a-z, 0-9, '.', '_' and '-'");
    }
    if (!Token(f[1], 1, 64)) {
      return error("a tenant is 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'");
    }
    if (!keys.tenant_by_hash_.emplace(HashOf(f[0]), std::string(f[1])).second) {
      return error("this key is listed twice");
    }
  }
  if (keys.tenant_by_hash_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("API keys: ", source, " lists no key"));
  }
  return keys;
}

std::optional<std::string> ApiKeys::TenantOf(absl::string_view key) const {
  if (key.empty()) return std::nullopt;
  auto it = tenant_by_hash_.find(HashOf(key));
  if (it == tenant_by_hash_.end()) return std::nullopt;
  return it->second;
}

absl::string_view BearerKey(absl::string_view authorization) {
  authorization = absl::StripAsciiWhitespace(authorization);
  if (authorization.size() < 7 || !absl::EqualsIgnoreCase(authorization.substr(0, 7), "bearer ")) {
    return "";
  }
  return absl::StripAsciiWhitespace(authorization.substr(7));
}

std::string TenantSalt(absl::string_view tenant, absl::string_view client_salt) {
  return absl::StrCat("tenant=", tenant, ";", client_salt);
}

}  // namespace strata::router
