// The one adapter between absl::Status and grpc::Status for the store's service and client.
// Codes map one to one (gRPC's and Abseil's numbering are the same); FromGrpc prefixes the
// message with where the call went, so that an error read in a node's log names the store.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace strata::rpc {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// "<where>: UNAVAILABLE: <gRPC's message>", with the gRPC code.
inline absl::Status FromGrpc(const grpc::Status& s, absl::string_view where) {
  if (s.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(s.error_code());
  return absl::Status(
      code, absl::StrCat(where, ": ", absl::StatusCodeToString(code), ": ", s.error_message()));
}

}  // namespace strata::rpc
