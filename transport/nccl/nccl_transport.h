// The NCCL transport: device-memory payloads move GPU to GPU by NCCL send/recv on CUDA streams;
// everything else (headers, the control messages NCCL needs, host-memory payloads) goes over a
// host transport it is given (UCX between nodes, inproc in one process).
//
// Connect(address) connects the host transport, then builds the pair's NCCL communicators: two,
// one per direction, so that each carries sends one way only (NCCL runs a communicator's
// operations in order; one communicator for both directions could deadlock two streams each
// waiting on the other's send). A transport that connects to its own address() gets one
// single-rank communicator and moves its payloads by NCCL's send-to-self.
//
// A device payload travels as: the sender announces it (header, size) over the host transport;
// the receiver's handler Accepts it into device memory; the receiver posts ncclRecv and answers
// "clear to send"; the sender posts ncclSend; each side completes when its stream has passed its
// operation. A handler that does not Accept answers "dropped" and the sender completes OK, as
// with the other backends. Announcements and answers travel in order on one host connection,
// so both sides post their operations in the same order, which NCCL requires.
//
// NCCL cannot recall an operation once posted, and the receiver posts its receive before the
// sender learns of it: cancelling a device transfer, or its timeout passing, after it was
// announced resets the pair's communicators (ncclCommAbort) and fails the endpoint's other
// transfers with UNAVAILABLE, as Endpoint::Cancel allows. A peer that dies fails the endpoint
// through the host transport, and NCCL's own errors (ncclCommGetAsyncError) fail it too.
//
// Capabilities: device memory yes; one-sided Put no (UNIMPLEMENTED); Map no. Needs a CUDA
// device: CreateNcclTransport answers FAILED_PRECONDITION, with CUDA's reason, where there is
// none. NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU detected"): two
// transports on the same device can reach each other's host messages but Connect fails
// (UNAVAILABLE, with NCCL's message); use one transport per GPU.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace strata::transport {

struct NcclTransportOptions {
  // Carries headers, control messages and host payloads. The NCCL transport takes over its
  // message handlers (ids 0 and 1); nothing else may use it. Required.
  std::shared_ptr<Transport> host;
  // The CUDA device this transport's memory and communicators live on.
  int device = 0;
  // How long building a pair's communicators may take (on top of Connect's own timeout for the
  // host connection); the acceptor's side gives up after it too.
  absl::Duration setup_timeout = absl::Seconds(60);
};

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(NcclTransportOptions options);

// The NCCL library version this binary runs with ("2.28.9"), or why it cannot say.
std::string NcclVersion();

}  // namespace strata::transport
