// The etcd flags that mean the same in every Strata process, defined once: --etcd_prefix (the
// router, the store, the prefill and decode nodes; etcd_flags.cc) and --etcd_ttl_s (only the
// processes that register themselves, the store and the nodes; etcd_lease_flag.cc, so that the
// router, which registers nothing, does not offer it). --etcd itself stays in each main: what
// the process does with etcd differs, and its help says so.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace strata::membership {

// --etcd_prefix: the cluster's key prefix ("/strata/" by default). kInvalidArgument, naming the
// flag, unless it starts and ends with '/' (keys are the prefix then "nodes/ID" or "stores/ID").
absl::StatusOr<std::string> EtcdPrefixFromFlags();

// --etcd_ttl_s: the registration lease (renewed at half of it). kInvalidArgument below 1 s.
absl::StatusOr<absl::Duration> EtcdLeaseFromFlags();

}  // namespace strata::membership
