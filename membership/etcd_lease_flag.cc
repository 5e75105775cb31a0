// --etcd_ttl_s, apart from --etcd_prefix: only the processes that register link it
// (etcd_flags.h).
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "membership/etcd_flags.h"

ABSL_FLAG(int, etcd_ttl_s, 6, "the registration lease, in seconds (renewed at half of it)");

namespace strata::membership {

absl::StatusOr<absl::Duration> EtcdLeaseFromFlags() {
  const int ttl_s = absl::GetFlag(FLAGS_etcd_ttl_s);
  if (ttl_s < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--etcd_ttl_s must be >= 1, got ", ttl_s));
  }
  return absl::Seconds(ttl_s);
}

}  // namespace strata::membership
