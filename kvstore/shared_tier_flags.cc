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
ABSL_FLAG(bool, shared_tier_tls, false,
          "speak TLS to --shared_tier's nodes (Redis's tls-port); their certificates are verified "
          "against --shared_tier_tls_ca (else the system's CAs) and for their address (or "
          "--shared_tier_tls_server_name)");
ABSL_FLAG(std::string, shared_tier_tls_ca, "",
          "PEM file of the CA certificates the Redis nodes' certificates chain to (empty: the "
          "system's)");
ABSL_FLAG(std::string, shared_tier_tls_cert, "",
          "PEM file of this process's client certificate, for nodes that require one (Redis's "
          "tls-auth-clients, on by default)");
ABSL_FLAG(std::string, shared_tier_tls_key, "", "PEM file of --shared_tier_tls_cert's key");
ABSL_FLAG(std::string, shared_tier_tls_server_name, "",
          "the name every Redis node's certificate must carry (empty: the address connected to)");
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
  o.redis.tls = {.enabled = absl::GetFlag(FLAGS_shared_tier_tls),
                 .ca_file = absl::GetFlag(FLAGS_shared_tier_tls_ca),
                 .cert_file = absl::GetFlag(FLAGS_shared_tier_tls_cert),
                 .key_file = absl::GetFlag(FLAGS_shared_tier_tls_key),
                 .server_name = absl::GetFlag(FLAGS_shared_tier_tls_server_name)};
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
