#include "cluster/node_flags.h"

#include "absl/flags/flag.h"
#include "cluster/node_process.h"

ABSL_FLAG(std::string, cluster, "", "the cluster file (required)");
ABSL_FLAG(std::string, node, "", "this node's id in the cluster file (required)");
ABSL_FLAG(std::string, listen, "", "gRPC address (default: the node's grpc in the file)");
ABSL_FLAG(std::string, metrics, "", "Prometheus /metrics address (default: the file's; off: none)");
ABSL_FLAG(std::string, etcd, "",
          "etcd's client address (host:port): register there under a lease, for routers that "
          "follow etcd (empty: the cluster file is the membership)");
ABSL_FLAG(std::string, etcd_prefix, "/strata/", "the cluster's key prefix in etcd");
ABSL_FLAG(int, etcd_ttl_s, 6, "the registration lease, in seconds (renewed at half of it)");
ABSL_FLAG(std::string, ucx_tls, "", "UCX transports (UCX_TLS), e.g. tcp; empty: UCX's choice");

ABSL_FLAG(std::string, device, "cpu",
          "where the node runs the model: cpu, or cuda[:N] (not in these binaries yet: they say "
          "so at start)");

ABSL_FLAG(std::string, store, "",
          "the store this node reads and writes (host:port), where every host runs a store of "
          "its own: its host's (default: the node's \"store\" in the cluster file, else the "
          "cluster's); registered in etcd with the node, so that the router credits the node with "
          "that store's chunks");

namespace strata::cluster {

absl::Status UseNodeStoreFromFlags(ClusterSpec* spec, NodeSpec* self) {
  if (const std::string flag = absl::GetFlag(FLAGS_store); !flag.empty()) {
    if (absl::Status s = ValidateHostPort(flag, "--store"); !s.ok()) return s;
    self->store = flag;
  }
  if (!self->store.empty()) spec->store = self->store;
  return absl::OkStatus();
}

absl::StatusOr<model::Device> NodeDeviceFromFlags() {
  return model::ParseDevice(absl::GetFlag(FLAGS_device));
}

absl::StatusOr<std::shared_ptr<const kvstore::GrpcSecurity>> NodeSecurityFromFlags() {
  return LoadGrpcSecurity(kvstore::GrpcSecurityOptionsFromFlags());
}

}  // namespace strata::cluster
