// ApiKeys: who may use the router, and as which tenant. A file with one key per line:
//
//   # KEY                               TENANT
//   sk-team-a-9f3c2e71d0b84a5f9e1c   team-a
//   sk-team-b-41aa07c3e6d24f0c8b77   team-b
//
// Keys are at least 16 characters of [A-Za-z0-9._-]; tenants 1..64 of the same. A request must
// carry `Authorization: Bearer KEY` (401 otherwise). Its tenant goes first in its cache salt
// (TenantSalt), so its prefix keys are its own: tenants never share a block, and a tenant cannot
// find, or time, another's prefix (its chunk keys differ, so every lookup is a plain miss). The
// keys are kept hashed (SHA-256), never in the clear.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::router {

class ApiKeys {
 public:
  // Errors (kInvalidArgument / kNotFound) name the file and the line.
  static absl::StatusOr<ApiKeys> Load(const std::string& path);
  static absl::StatusOr<ApiKeys> Parse(absl::string_view text, absl::string_view source);

  // The tenant of `key`, or nullopt for a key that is not on the list.
  std::optional<std::string> TenantOf(absl::string_view key) const;
  size_t size() const { return tenant_by_hash_.size(); }

 private:
  absl::flat_hash_map<std::string, std::string> tenant_by_hash_;  // SHA-256 (hex) of the key
};

// The key of an `Authorization: Bearer KEY` header value; "" when it is not one.
absl::string_view BearerKey(absl::string_view authorization);

// The cache salt of a tenant's request: the tenant, then the client's own salt (vLLM's
// cache_salt, which then partitions within the tenant).
std::string TenantSalt(absl::string_view tenant, absl::string_view client_salt);

}  // namespace strata::router
