// libFuzzer target for what Strata reads from etcd: any bytes, as a node's registration value
// (membership::NodeFromJson), as a line of a watch stream, as a range answer and as the body of an
// HTTP error answer, give a value or a clear error, never a crash; whatever NodeFromJson accepts
// must hold its invariants and survive a NodeToJson round trip.
#include <cstddef>
#include <cstdint>
#include <string>

#include "membership/cluster_file.h"
#include "membership/etcd_client.h"
#include "membership/etcd_membership.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::membership;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<NodeSpec> node = NodeFromJson(text);
  if (node.ok()) {
    if (!ValidNodeId(node->id) || node->grpc.empty()) __builtin_trap();
    absl::StatusOr<NodeSpec> back = NodeFromJson(NodeToJson(*node));
    if (!back.ok() || back->id != node->id || back->grpc != node->grpc ||
        back->transport != node->transport || back->metrics != node->metrics ||
        back->role != node->role) {
      __builtin_trap();
    }
  } else if (node.status().message().empty()) {
    __builtin_trap();
  }
  absl::StatusOr<EtcdWatchBatch> batch = ParseEtcdWatchLine(text, "etcd:2379");
  if (!batch.ok() && batch.status().message().empty()) __builtin_trap();
  (void)ParseEtcdRange(text, "etcd:2379");
  const int http = 400 + static_cast<int>(size % 200);
  if (EtcdAnswerStatus(http, text, "etcd:2379/v3/kv/range").ok()) __builtin_trap();
  return 0;
}
