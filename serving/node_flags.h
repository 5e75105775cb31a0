// The flags every serving node (strata-prefill, strata-decode) takes alike, defined once here
// (serving/node_flags.cc, listed by --help through ConfigureFlagsUsage) and read by both mains:
// the cluster file and the node's entry, its addresses, etcd membership, UCX transports and
// transport security (rpc/grpc_security_flags.h's, shared with the store and the router).
// Flags whose meaning differs by role stay in each main.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "membership/cluster_file.h"
#include "model/compute_backend.h"
#include "rpc/grpc_security.h"
#include "rpc/grpc_security_flags.h"  // the security flags, defined there
#include "serving/node_process.h"

ABSL_DECLARE_FLAG(std::string, cluster);
ABSL_DECLARE_FLAG(std::string, node);
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(std::string, metrics);
ABSL_DECLARE_FLAG(std::string, etcd);
ABSL_DECLARE_FLAG(std::string, etcd_prefix);
ABSL_DECLARE_FLAG(int, etcd_ttl_s);
ABSL_DECLARE_FLAG(std::string, ucx_tls);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, store);

namespace strata::serving {

// The node's gRPC security from --tls_cert, --tls_key, --tls_ca, --cluster_token_file and
// --insecure (LoadGrpcSecurity: its errors, and its log line).
absl::StatusOr<std::shared_ptr<const rpc::GrpcSecurity>> NodeSecurityFromFlags();

// The store the node reads and writes: --store, else its entry's (membership::NodeSpec::store),
// else the cluster's. Sets self->store to it when the node names one (its etcd registration says
// so) and spec->store to it (what ConnectStore connects to). kInvalidArgument when --store is not
// host:port.
absl::Status UseNodeStoreFromFlags(membership::ClusterSpec* spec, membership::NodeSpec* self);

// The start every serving node shares, from the node flags (after ParseCommandLine): the
// cluster file and this node's entry in it, its gRPC and metrics addresses, the log identity,
// gRPC security, the model on its --device, and the store connection with the node's own RAM tier
// in front. Each main then builds its engine and service on it (flags -> options -> run).
struct NodeStartOptions {
  const char* process = "strata-node";  // the log identity and the messages' prefix
  membership::Role role = membership::Role::kPrefill;
  std::string transport = "";         // the decode node's --transport flag ("" for a prefill node)
  std::string local_ram_bytes = "0";  // the node's --local_ram_bytes flag
};
struct NodeStart {
  membership::ClusterSpec spec;
  membership::NodeSpec self;
  std::string listen;   // gRPC address (--listen, else the node's entry)
  std::string metrics;  // /metrics address; "" = off
  std::shared_ptr<const rpc::GrpcSecurity> security;
  ServedModel served;
  uint64_t local_ram_bytes = 0;
  StoreConnection store;
  std::string etcd_prefix;                           // --etcd_prefix, checked
  absl::Duration etcd_lease = absl::ZeroDuration();  // --etcd_ttl_s
};
// What stopped a node's start: the step (for the process's message) and the exit code (2 for
// bad flags or a bad cluster file, 1 for what failed at run time).
struct NodeStartError {
  std::string what;
  absl::Status status;
  int exit_code = 1;
};
absl::Status StartNodeFromFlags(const NodeStartOptions& options, NodeStart* out,
                                NodeStartError* error);

// The serving every node shares once its services exist: `services` on the node's gRPC address,
// `registry` on its /metrics address, the node's line in the log (`serving_line`, given the
// bound port), its entry registered in etcd (with --etcd: the bound port, the metrics address and
// `transport`, a decode node's block address), and "PROCESS: serving on port N" on stdout.
// Registered last, so that a router following etcd finds a node that answers; destroying the
// registration first when stopping deregisters it before anything else goes.
struct NodeServing {
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<prometheus::Exposer> metrics;
  std::unique_ptr<membership::EtcdRegistration> registration;
};
absl::Status ServeNode(const NodeStart& n, const char* process,
                       const std::vector<grpc::Service*>& services,
                       const std::shared_ptr<prometheus::Registry>& registry,
                       const std::string& transport,
                       const std::function<std::string(int port)>& serving_line, NodeServing* out,
                       NodeStartError* error);

// ConnectStore with the node's --shared_tier flags (kvstore/shared_tier_flags.h, the store's and
// the router's too): with them, the store fails over to the shared tier while it cannot answer.
absl::StatusOr<StoreConnection> ConnectStoreFromFlags(
    const membership::ClusterSpec& spec, std::shared_ptr<const rpc::GrpcSecurity> security,
    uint64_t local_ram_bytes);

// Where the node runs the model, from --device (model::ParseDevice: its errors). For a CUDA
// device it opens the CUDA plugin (--cuda_plugin, model/cuda_plugin.h) with the --gpu_* options and
// registers it as the CUDA backend loader; a plugin missing, not opening or of another build is an
// error naming the device and the plugin.
absl::StatusOr<model::Device> NodeDeviceFromFlags();

}  // namespace strata::serving
