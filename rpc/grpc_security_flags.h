// The five flags every Strata process takes for its gRPC security (grpc_security.h), defined once
// here with one help text each: strata-store, strata-router, strata-prefill and strata-decode
// link this. A main's --help lists them when its filter takes kGrpcSecurityFlagsFile.
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "rpc/grpc_security.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, cluster_token_file);
ABSL_DECLARE_FLAG(bool, insecure);

namespace strata::rpc {

// --tls_cert, --tls_key, --tls_ca, --cluster_token_file and --insecure, as GrpcSecurity takes them.
GrpcSecurityOptions GrpcSecurityOptionsFromFlags();

inline constexpr char kGrpcSecurityFlagsFile[] = "grpc_security_flags.cc";

}  // namespace strata::rpc
