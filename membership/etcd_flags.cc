#include "membership/etcd_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, etcd_prefix, "/strata/",
          "the cluster's key prefix in etcd (starts and ends with '/'; every process of one "
          "cluster gives the same)");

namespace strata::membership {

absl::StatusOr<std::string> EtcdPrefixFromFlags() {
  const std::string prefix = absl::GetFlag(FLAGS_etcd_prefix);
  if (!absl::StartsWith(prefix, "/") || !absl::EndsWith(prefix, "/")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--etcd_prefix must start and end with '/', got '", prefix, "'"));
  }
  return prefix;
}

}  // namespace strata::membership
