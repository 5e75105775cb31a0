// NodePool: the router's connections to the cluster's prefill and decode nodes, and what it last
// heard from each (proto/serving.proto NodeLoad, polled with Load).
//
//   NodePool pool(options, membership, registry);
//   pool.PollOnce();                                  // the router's poller, every poll interval
//   std::vector<NodeLoad> nodes = pool.Loads();       // the routing policy's input
//   std::shared_ptr<const NodeConnection> c = pool.Connection("decode-0");  // to call the node
//
// The pool lists the membership's nodes from construction on (unhealthy until they answer).
// PollOnce follows the membership (new nodes get a channel, departed ones are dropped; a request
// in flight keeps its node's connection alive through the shared_ptr) and calls Load on every
// node at once with a deadline of load_timeout, waiting for all answers. A node is healthy from
// its first good answer until a Load fails; a node that has never answered is unhealthy. An
// answer that contradicts the cluster (another role, another node id, another model or chunk
// size than the router's) also makes the node unhealthy: routing to it would be wrong. Every
// transition is logged (serving::Log) and mirrored in the gauge strata_router_node_healthy{node,
// role}. Channels reconnect within max_reconnect_backoff once a node is back.
//
// Thread safety: every method is thread-safe; PollOnce is meant to run on one thread at a time
// (the router's poller) and blocks up to about load_timeout.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "membership/cluster_file.h"
#include "model/served_format.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "proto/serving.grpc.pb.h"
#include "router/routing_policy.h"
#include "rpc/grpc_security.h"

namespace strata::router {

struct NodePoolOptions {
  // Deadline of one Load call.
  absl::Duration load_timeout = absl::Seconds(1);
  // Upper bound of a channel's reconnection backoff (gRPC's default is two minutes: far too long
  // to notice a restarted node).
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // What every node must report: the model's name ("": not checked) and the cluster's format
  // (codec and chunk size; an empty codec or chunk size 0: not checked). A node reporting an
  // empty model or codec, or chunk size 0, is not checked either.
  std::string model_name = "";
  model::ServedFormat format = {.codec = "", .chunk_tokens = 0};
  // NodeLoad::reads_store of every prefill node (the cluster has a store); a node that names a
  // store of its own (NodeSpec::store) reads that one in any case.
  bool prefill_reads_store = false;
  // The cluster's store (ClusterSpec::store): NodeLoad::store_holder of a node that names none.
  std::string cluster_store = "";
  // TLS and the cluster token of the nodes' channels; null: insecure (plaintext, no token).
  std::shared_ptr<const rpc::GrpcSecurity> security = nullptr;

  absl::Status Validate() const;
};

// One node's channel and stub (the one its role serves). Immutable; shared with requests in flight.
struct NodeConnection {
  membership::NodeSpec spec = {};
  std::shared_ptr<grpc::Channel> channel = nullptr;
  std::unique_ptr<strata::v1::PrefillNode::Stub> prefill = nullptr;  // role prefill
  std::unique_ptr<strata::v1::DecodeNode::Stub> decode = nullptr;    // role decode
  // "prefill node prefill-0 (127.0.0.1:7101)": how error messages name it.
  std::string description = "";
};

// What the pool knows of one node.
struct NodeStatus {
  membership::NodeSpec spec = {};
  bool healthy = false;
  std::string problem = "never answered";         // why it is unhealthy; "" when healthy
  strata::v1::NodeLoad report = {};               // the last good answer (empty before one)
  absl::Time reported_at = absl::InfinitePast();  // the router's clock at that answer
};

class NodePool {
 public:
  // `membership` must not be null; `registry` (optional; must outlive the pool) receives
  // strata_router_node_healthy. Options must be valid (Validate).
  NodePool(NodePoolOptions options, std::shared_ptr<const membership::Membership> membership,
           prometheus::Registry* registry);
  ~NodePool();
  NodePool(const NodePool&) = delete;
  NodePool& operator=(const NodePool&) = delete;

  // Syncs with the membership, then polls every node; returns when every Load has answered or
  // timed out.
  void PollOnce();

  // The routing view: one NodeLoad per member (healthy or not) from its latest report, in the
  // membership's order.
  std::vector<NodeLoad> Loads() const;
  // The largest kv_bytes_per_token a healthy decode node reports (0 when none does).
  double DecodeKvBytesPerToken() const;
  // nullptr when `id` is not a member (any more).
  std::shared_ptr<const NodeConnection> Connection(const std::string& id) const;
  std::vector<NodeStatus> Status() const;

 private:
  struct Node {
    std::shared_ptr<const NodeConnection> connection;
    NodeStatus status;
    prometheus::Gauge* health_gauge = nullptr;  // in health_family_; null without a registry
  };
  // One Load in flight (PollOnce).
  struct Probe;

  std::shared_ptr<const NodeConnection> Connect(const membership::NodeSpec& spec) const;
  // Follows the membership (connects new nodes, drops departed ones); returns one unstarted
  // probe per member.
  std::vector<std::unique_ptr<Probe>> SyncMembership();
  // Updates `id`'s status from a finished probe; logs and sets the gauge on a change.
  void Record(const std::string& id, const Probe& probe);
  // "" when the report fits the cluster, else why not.
  std::string Contradiction(const membership::NodeSpec& spec,
                            const strata::v1::NodeLoad& report) const;

  const NodePoolOptions options_;
  const std::shared_ptr<const membership::Membership> membership_;
  prometheus::Family<prometheus::Gauge>* health_family_ = nullptr;

  mutable std::mutex mu_;  // guards nodes_ and order_
  std::map<std::string, Node> nodes_;
  std::vector<std::string> order_;  // member ids in membership order
};

}  // namespace strata::router
