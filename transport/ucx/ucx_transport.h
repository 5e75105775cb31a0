// The UCX transport (UCP active messages, one-sided put with remote keys).
//
// One UCP worker per transport, driven by one progress thread that makes every UCP call; the
// public methods hand it commands. Peers connect by socket address ("ucx://HOST:PORT") through
// UCX's connection manager; the data then moves over whatever transports UCX picks among those
// allowed (UCX_TLS in the environment, or UcxTransportOptions::tls): here TCP and shared memory
// (posix/sysv/cma), in a cluster RDMA (rc/dc/ud verbs) and CUDA IPC/GDR copy where the UCX build
// has them. Large messages go by rendezvous straight into the receiver's registered buffer.
//
// Endpoints use UCX's peer error handling: a peer that dies fails its endpoint (UNAVAILABLE) and
// every transfer on it; partial receives are reported as failed to the receiver's Accept.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace strata::transport {

struct UcxTransportOptions {
  // Listen for peers on this host:port (port 0: any free port, see Transport::address()).
  // Empty host: do not listen (connect-only).
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  // UCX transports allowed (the value of UCX_TLS, e.g. "tcp", "posix,sysv,cma"); empty leaves
  // UCX's own setting (the UCX_TLS environment variable, or all it has).
  std::string tls;
  // After the last activity the progress thread keeps polling this long before it sleeps on
  // UCX's event fd (woken by arriving data and by local commands). Longer: lower latency after a
  // pause, more CPU taken from the threads that verify and consume blocks.
  absl::Duration busy_poll = absl::Microseconds(50);
  // Further UCX settings (names without the UCX_ prefix, e.g. {"RNDV_THRESH", "64k"}). They
  // override the environment's UCX_* values and the transport's own same-host settings
  // (UCX_MM_ERROR_HANDLING=y, UCX_TCP_PUT_ENABLE=n when shared memory is allowed; see the .cc for why).
  std::vector<std::pair<std::string, std::string>> ucx_config = {};

  absl::Status Validate() const;
};

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(UcxTransportOptions options);

// CreateUcxTransport, tried again every second for up to `wait` while its listening port is still
// held: a node restarted on its fixed port finds it held by its previous run's connections
// (TIME_WAIT; UCX's listener sets no SO_REUSEADDR). `waiting`, when given, is called once, with
// the first refusal, if it waits at all. Any other error returns at once.
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransportWaitingForPort(
    const UcxTransportOptions& options, absl::Duration wait,
    const std::function<void(const absl::Status&)>& waiting = nullptr);

// The UCX library version this binary runs with ("1.13.1").
std::string UcxVersion();

}  // namespace strata::transport
