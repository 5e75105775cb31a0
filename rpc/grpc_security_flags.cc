#include "rpc/grpc_security_flags.h"

#include "absl/flags/flag.h"

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
          "warning; the router's HTTP API is then plain HTTP too)");

namespace strata::rpc {

GrpcSecurityOptions GrpcSecurityOptionsFromFlags() {
  return {.tls_cert = absl::GetFlag(FLAGS_tls_cert),
          .tls_key = absl::GetFlag(FLAGS_tls_key),
          .tls_ca = absl::GetFlag(FLAGS_tls_ca),
          .cluster_token_file = absl::GetFlag(FLAGS_cluster_token_file),
          .insecure = absl::GetFlag(FLAGS_insecure)};
}

}  // namespace strata::rpc
