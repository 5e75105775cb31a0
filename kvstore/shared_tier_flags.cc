#include "kvstore/shared_tier_flags.h"

#include <fstream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

ABSL_FLAG(std::string, shared_tier, "",
          "Redis Cluster nodes (host:port,...) of the cluster-wide tier behind the stores: a "
          "store writes every block put in it through to this tier and reads it past what it "
          "holds; the router asks it which chunks of a prompt it holds (empty: none)");
ABSL_FLAG(std::string, shared_tier_user, "", "Redis ACL user for --shared_tier (empty: default)");
ABSL_FLAG(std::string, shared_tier_password_file, "",
          "file holding the Redis password (AUTH) for --shared_tier");
ABSL_FLAG(int, shared_tier_ttl_s, 3600,
          "seconds a block lives in the shared tier unread (the root chunk twice as long; a read "
          "renews it)");

namespace strata::kvstore {

absl::StatusOr<std::optional<SharedTierOptions>> SharedTierOptionsFromFlags() {
  const std::string seeds = absl::GetFlag(FLAGS_shared_tier);
  if (seeds.empty()) return std::nullopt;
  SharedTierOptions o;
  o.redis.seeds = absl::StrSplit(seeds, ',', absl::SkipEmpty());
  o.redis.user = absl::GetFlag(FLAGS_shared_tier_user);
  if (const std::string file = absl::GetFlag(FLAGS_shared_tier_password_file); !file.empty()) {
    std::ifstream in(file);
    if (!in || !std::getline(in, o.redis.password) || o.redis.password.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shared_tier_password_file: cannot read a password from ", file));
    }
  }
  const int ttl_s = absl::GetFlag(FLAGS_shared_tier_ttl_s);
  if (ttl_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared_tier_ttl_s must be >= 1, got ", ttl_s));
  }
  o.ttl = absl::Seconds(ttl_s);
  o.root_bonus = o.ttl;
  if (absl::Status s = o.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--shared_tier: ", s.message()));
  }
  return o;
}

}  // namespace strata::kvstore
