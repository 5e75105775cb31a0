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
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate this process presents to its gRPC peers, as server and as client "
          "(mutual TLS; scripts/make_certs.sh makes node.crt)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate: peers must present a certificate it signed, and servers are "
          "verified against it");
ABSL_FLAG(std::string, cluster_token_file, "",
          "file holding the cluster token: sent on every gRPC call, required of every call "
          "served (UNAUTHENTICATED otherwise)");
ABSL_FLAG(bool, insecure, false,
          "plaintext gRPC without a cluster token, instead of the four TLS flags (logged as a "
          "warning)");

ABSL_FLAG(std::string, device, "cpu",
          "where the node runs the model: cpu, or cuda[:N] (not in these binaries yet: they say "
          "so at start)");

namespace strata::cluster {

absl::StatusOr<model::Device> NodeDeviceFromFlags() {
  return model::ParseDevice(absl::GetFlag(FLAGS_device));
}

absl::StatusOr<std::shared_ptr<const kvstore::GrpcSecurity>> NodeSecurityFromFlags() {
  return LoadGrpcSecurity({.tls_cert = absl::GetFlag(FLAGS_tls_cert),
                           .tls_key = absl::GetFlag(FLAGS_tls_key),
                           .tls_ca = absl::GetFlag(FLAGS_tls_ca),
                           .cluster_token_file = absl::GetFlag(FLAGS_cluster_token_file),
                           .insecure = absl::GetFlag(FLAGS_insecure)});
}

}  // namespace strata::cluster
