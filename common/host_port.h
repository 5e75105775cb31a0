// "host:port" addresses, as every Strata flag, cluster file and transport address writes them:
// a host name, an IPv4 address, or an IPv6 address in brackets ("[::1]:7101"), then the port.
//
//   STRATA_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort("[::1]:7101"));  // {"::1", 7101}
//   JoinHostPort(hp.host, 0);                                           // "[::1]:0"
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata {

struct HostPort {
  std::string host;  // without the brackets of an IPv6 address
  uint16_t port = 0;
};

// kInvalidArgument (naming `address`) unless it is host:port with a non-empty host and a port in
// 0..65535; an IPv6 host must be in brackets.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address);

// "host:port", with brackets around a host that holds a ':' (IPv6).
std::string JoinHostPort(absl::string_view host, uint16_t port);

}  // namespace strata
