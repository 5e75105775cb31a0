// A decode node's whole process — flags, the cluster file, the model, the store, the transport,
// the engine and its gRPC service, membership, drain on SIGTERM — as one function, so that
// strata-decode (decode_main.cc) is `return RunDecodeNode(argc, argv)` and a test binary can run
// the same node with its transport wrapped (tests/e2e/faulty_decode_main.cc: blocks damaged after
// the network), keeping fault injection out of the product binary.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace strata::decode {

// Given the node's transport, returns a transport wrapping it that the engine receives blocks
// through (or null: the transport itself). An error stops the node as a flag error (exit 2).
using TransportHook = std::function<absl::StatusOr<std::unique_ptr<transport::Transport>>(
    transport::Transport* base)>;

// Runs the node until it is drained or killed; the process's exit code.
int RunDecodeNode(int argc, char** argv, const TransportHook& hook = nullptr);

}  // namespace strata::decode
