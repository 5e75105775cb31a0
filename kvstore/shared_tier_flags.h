// The flags of the shared tier (shared_tier.h), defined once here with one help text each:
// strata-store writes through to it and reads it, strata-router asks it which chunks it holds
// when it routes. A main's --help lists them when its filter takes kSharedTierFlagsFile.
#pragma once

#include <optional>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "kvstore/shared_tier.h"

ABSL_DECLARE_FLAG(std::string, shared_tier);
ABSL_DECLARE_FLAG(std::string, shared_tier_user);
ABSL_DECLARE_FLAG(std::string, shared_tier_password_file);
ABSL_DECLARE_FLAG(int, shared_tier_ttl_s);

namespace strata::kvstore {

// --shared_tier and the flags beside it as SharedTierOptions; nullopt when --shared_tier is
// empty. kInvalidArgument naming the flag: a password file that cannot be read or is empty, a
// TTL below one second.
absl::StatusOr<std::optional<SharedTierOptions>> SharedTierOptionsFromFlags();

inline constexpr char kSharedTierFlagsFile[] = "shared_tier_flags.cc";

}  // namespace strata::kvstore
