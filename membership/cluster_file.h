// The cluster file: which nodes a Strata cluster has, their roles and addresses, and what they
// all serve (model, codec, chunk size). Every process reads it: a node finds its own entry by id,
// the router lists the nodes it routes to. Membership is the interface the router uses: the file
// (StaticMembership) or etcd (membership/etcd_membership.h), the router the same either way.
//
//   {
//     "model": "../models/strata-tiny",     // relative paths are relative to the file
//     "codec": "kivi:k4v4:g32",
//     "chunk_tokens": 64,
//     "calibration": "",                    // a calibration file, for codecs that need one
//     "store": "127.0.0.1:7070",            // the strata-store's gRPC address; "" = none
//     "nodes": [
//       {"id": "prefill-0", "role": "prefill", "grpc": "127.0.0.1:7101",
//        "metrics": "127.0.0.1:9101"},
//       {"id": "decode-0", "role": "decode", "grpc": "127.0.0.1:7201",
//        "transport": "127.0.0.1:7301", "metrics": "127.0.0.1:9201",
//        "store": "127.0.0.1:7071"}     // optional: the store of the node's host
//     ],
//     "router": {"http": "127.0.0.1:8000"}
//   }
//
// `transport` (decode nodes): where the node's block transport (UCX) listens; the prefill node
// learns it per request from the decode node (GenerateEvent.registered), so only the decode node
// reads it. `metrics`: where the node serves Prometheus /metrics ("" = off). `store`: where
// every host runs a store of its own (its RAM and NVMe), the one on the node's host; the router
// watches each store named and credits a node with its own store's chunks (and the shared
// tier's), not with other hosts'.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace strata::membership {

enum class Role { kPrefill, kDecode };
const char* RoleName(Role role);
// 1..64 characters of [A-Za-z0-9._-], other than "store" and "shared-tier" (the router's
// prefix index names the stores and the shared tier so, beside the nodes).
bool ValidNodeId(const std::string& id);
inline constexpr char kNodeIdRule[] =
    "must be 1..64 characters of [A-Za-z0-9._-], not \"store\" or \"shared-tier\"";

struct NodeSpec {
  std::string id = "";  // [A-Za-z0-9._-], 1..64 chars, unique
  Role role = Role::kPrefill;
  std::string grpc = "";       // host:port of the node's gRPC service
  std::string transport = "";  // decode: host:port the block transport listens on
  std::string metrics = "";    // host:port of /metrics; "" = off
  // host:port of the store this node reads and writes: its host's, where every host runs one;
  // "" = the cluster's (ClusterSpec::store).
  std::string store = "";
};

// A store that registers itself in etcd (strata-store --etcd): one per host, where every host
// runs one; nodes started with `--store host` use the one on their own host.
struct StoreSpec {
  std::string id = "";       // [A-Za-z0-9._-], 1..64 chars, unique
  std::string grpc = "";     // host:port of its gRPC service
  std::string metrics = "";  // host:port of /metrics; "" = off
  // The machine whose store it is, as nodes started with --store host name theirs: "" = the
  // host of `grpc`. Where addresses do not name machines (Kubernetes pods), the machine's name.
  std::string host = "";

  friend bool operator==(const StoreSpec&, const StoreSpec&) = default;
};

struct ClusterSpec {
  std::string path = "";   // the file it was read from
  std::string model = "";  // absolute or relative to the current directory (resolved)
  std::string codec = "fp16";
  uint32_t chunk_tokens = 256;
  std::string calibration = "";  // resolved like model; "" = none
  std::string store = "";        // host:port; "" = no store
  std::vector<NodeSpec> nodes = {};
  std::string router_http = "127.0.0.1:8000";

  const NodeSpec* Find(const std::string& id) const;
  std::vector<NodeSpec> WithRole(Role role) const;
};

// Parses a cluster file. kNotFound when it cannot be read; kInvalidArgument naming the field
// (e.g. "cluster.json: nodes[2].grpc: 'x' is not host:port") for anything malformed: unknown
// keys, wrong types, duplicate ids, a role other than prefill/decode, a decode node without a
// transport address, no node of a role.
absl::StatusOr<ClusterSpec> ParseClusterFile(const std::string& text, const std::string& path);
absl::StatusOr<ClusterSpec> LoadClusterFile(const std::string& path);

// kInvalidArgument unless `address` is host:port with a port in 0..65535 (`what` names it).
absl::Status ValidateHostPort(const std::string& address, const std::string& what);

// Who is in the cluster, as the router sees it: the cluster file's nodes (StaticMembership) or
// the nodes registered in etcd (EtcdMembership, membership/etcd_membership.h).
class Membership {
 public:
  virtual ~Membership() = default;
  // The nodes currently members. Thread-safe.
  virtual std::vector<NodeSpec> Nodes() const = 0;
  // The stores registered on their own (etcd); none for a cluster file. Thread-safe.
  virtual std::vector<StoreSpec> Stores() const { return {}; }
  virtual std::string Describe() const = 0;
};

// The cluster file's nodes, fixed for the life of the process.
class StaticMembership final : public Membership {
 public:
  explicit StaticMembership(ClusterSpec spec) : spec_(std::move(spec)) {}
  std::vector<NodeSpec> Nodes() const override { return spec_.nodes; }
  std::string Describe() const override { return "cluster file " + spec_.path; }

 private:
  const ClusterSpec spec_;
};

}  // namespace strata::membership
