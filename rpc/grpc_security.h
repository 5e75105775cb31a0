// How every Strata gRPC server and client secures its calls: mutual TLS under the cluster's CA,
// and a cluster token on every call, or, only when asked for with --insecure, neither.
//
//   GrpcSecurityOptions o{.tls_cert = "node.crt", .tls_key = "node.key", .tls_ca = "ca.crt",
//                         .cluster_token_file = "cluster.token"};
//   STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const GrpcSecurity> security, GrpcSecurity::Load(o));
//   builder.AddListeningPort(address, security->ServerCredentials(), &port);
//   std::shared_ptr<grpc::Channel> channel = security->CreateChannel(address, args);
//
// Secure mode (all four files given): a server presents its certificate and requires a client
// certificate signed by the CA (a client without one, or with one from another CA, fails the
// handshake: UNAVAILABLE at the client); a client presents the same certificate and verifies the
// server's against the CA and the address it dials (the certificate's SANs must name it:
// scripts/make_certs.sh --san). Every call carries the token as metadata kClusterTokenHeader
// (gRPC call credentials, which gRPC sends over secure channels only); a server checks it
// (grpc::AuthMetadataProcessor on the server credentials, before any handler runs: constant-time
// over SHA-256 digests) and answers UNAUTHENTICATED naming what is wrong, never echoing a token.
//
// Insecure mode (--insecure, none of the files): plaintext, no token, no check. gRPC attaches call
// credentials to secure channels only, and a token in clear text would be readable by anyone on
// the path: insecure mode carries none. Processes log kInsecureWarning when they start and when
// they listen.
//
// GrpcSecurity is immutable and thread-safe; one instance serves every server and channel of a
// process.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/sha256.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace strata::rpc {

// The metadata key the cluster token travels under.
inline constexpr char kClusterTokenHeader[] = "x-strata-cluster-token";

// What an --insecure process logs at start and on each listening port.
inline constexpr char kInsecureWarning[] =
    "WARNING: --insecure: gRPC is plaintext and unauthenticated (no TLS, no cluster token): "
    "anyone who reaches its ports can read and write the cluster's blocks";

struct GrpcSecurityOptions {
  std::string tls_cert = "";            // PEM certificate (chain) presented as server and client
  std::string tls_key = "";             // its PEM private key
  std::string tls_ca = "";              // PEM CA certificate(s) that peers' certificates chain to
  std::string cluster_token_file = "";  // the cluster token: the file's first line, trimmed
  bool insecure = false;                // plaintext and no token; excludes the four files

  // INVALID_ARGUMENT naming the flags: with --insecure none of the files may be given; without
  // it all four are needed (no flag at all: the message names --insecure and the TLS flags).
  absl::Status Validate() const;
};

class GrpcSecurity {
 public:
  // Validates `options` and reads the files: INVALID_ARGUMENT for bad options, an unreadable or
  // empty file, PEM text that is not a certificate / key, or a token that is not 16..4096
  // printable ASCII characters without spaces.
  static absl::StatusOr<std::shared_ptr<const GrpcSecurity>> Load(
      const GrpcSecurityOptions& options);
  // Secure mode from PEM text and the token itself (tests). Same checks as Load.
  static absl::StatusOr<std::shared_ptr<const GrpcSecurity>> FromPem(std::string cert_pem,
                                                                     std::string key_pem,
                                                                     std::string ca_pem,
                                                                     std::string token);
  // Insecure mode (tests and in-process use; the binaries ask for it with --insecure).
  static std::shared_ptr<const GrpcSecurity> Insecure();

  bool insecure() const { return insecure_; }
  // For a ServerBuilder's AddListeningPort.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // A channel to `address` with `args`, carrying this process's certificate and the token.
  std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                               const grpc::ChannelArguments& args) const;
  // One line for a startup log: "mutual TLS (CA ..., certificate ...) + cluster token (...)", or
  // kInsecureWarning.
  const std::string& Describe() const { return description_; }

 private:
  GrpcSecurity() = default;
  static absl::StatusOr<std::shared_ptr<const GrpcSecurity>> Secure(std::string cert_pem,
                                                                    std::string key_pem,
                                                                    std::string ca_pem,
                                                                    std::string token,
                                                                    std::string description);

  bool insecure_ = true;
  std::string cert_pem_;
  std::string key_pem_;
  std::string ca_pem_;
  std::string token_;
  std::string description_ = kInsecureWarning;
};

}  // namespace strata::rpc
