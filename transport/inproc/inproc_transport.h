// The in-process transport: peers are other InprocTransports in the same process, found by name
// ("inproc://NAME"). A message is delivered on the receiving transport's own thread (as a network
// backend would), its payload copied once into the receiver's destination. One-sided Put copies
// into the peer's registered region. Destroying a transport fails the endpoints that point at it
// (UNAVAILABLE), as a dead peer would.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace strata::transport {

struct InprocTransportOptions {
  // The name peers connect to; empty picks a unique one. ALREADY_EXISTS if taken.
  std::string name;
};

absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(InprocTransportOptions options);

}  // namespace strata::transport
