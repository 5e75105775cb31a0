// RoutingPolicy: picks the prefill node and the decode node for one request; LoadTracker: the
// router's own, optimistic account of the load it has sent since the nodes last reported.
//
//   OverlapResult overlap = index.Overlap(chain, now);
//   std::vector<NodeLoad> nodes = LatestReports();
//   tracker.Overlay(absl::MakeSpan(nodes));              // add what was routed since the reports
//   STRATA_ASSIGN_OR_RETURN(RouteDecision d, policy->Route(request, overlap, nodes));
//   index.Predict(d.prefill_id, chain, now);             // the next turn finds this node
//   tracker.Add(request_id, d, now);                     // MarkPrefillDone / Complete later
//   LOG(INFO) << d.Explain();
//
// Prefill pick (Dynamo's KV router cost, in chunk units, C = chunk_tokens):
//   raw_P    = (queued_prefill_tokens_P + prompt_tokens) / C
//   credit_P = w_dev·device_P + w_ram·ram_P + w_disk·disk_P + m·max(0, store − local_P)
//   cost_P   = max(0, raw_P − credit_P) + α·active_requests_P
// where device_P/ram_P/disk_P split the node's leading local overlap (predicted chunks count as
// device) and `store` is the leading overlap of the shared store (only for nodes that read the
// store). A store hit earns less than a local one (m < 1) because it is still fetched. The
// lowest cost wins, ties broken uniformly at random; with temperature T > 0 a node is drawn
// with p ∝ exp(−(cost − min)/((max − min)·T)) instead. A node is never chosen when unhealthy, or
// when its queue with this request's uncached tokens would exceed max_queued_prefill_tokens, or
// when the node itself reports a queue bound (NodeLoad::max_queued_prefill_tokens, what it
// computes within its queue time) that its queue with this request's prompt tokens would exceed
// (a node with an empty queue takes any request); nodes over busy_prefill_tokens are passed over
// unless every remaining node is over it.
//
// Decode pick: by load only (Dynamo routes the decode leg with no overlap credit; its prefix is
// pushed to it by the prefill node anyway). A decode node can take the request when healthy and
// kv_bytes_in_use + kv_bytes_reserved + the request's decode_kv_bytes fit in kv_bytes_capacity.
// Nodes whose batch is full (active_requests >= max_batch) are passed over while another has room;
// when none has, the request still goes to one (it waits there for a place in the batch: a full
// batch is continuous batching's normal state, not a reason for a 429) unless its waiting queue is
// full too (active_requests >= max_batch + max_waiting, when the node reports max_waiting): a node
// never gets more than it holds. Among those the least
// loaded wins, load = the tighter of its KV fraction
// after the reservation and its batch fraction; ties at random. Least-loaded rather than power
// of two choices: this router accounts for its own decisions at once (LoadTracker), so it does
// not herd onto one node between reports (Dynamo #589), and the argmin packs better; power of
// two is the remedy when several routers share no predictions.
//
// Errors from Route: kInvalidArgument for a malformed request; kUnavailable when no healthy
// prefill node or no healthy decode node exists; kResourceExhausted when healthy nodes exist but
// none of one role can take the request (the router answers 429 with Retry-After). The
// message starts with kNoPrefillRoom or kNoDecodeRoom and names each node's reason.
//
// Thread safety: RoutingPolicy and LoadTracker are thread-safe. Route is O(nodes + overlap
// holders) apart from the Explain-ready candidate lists it fills.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "router/prefix_index.h"

namespace strata::router {

// The index holder id of the store at `address`: "store" for the cluster's store
// (`cluster_store`, the cluster file's), "store@ADDRESS" for a store a node names as its host's
// (membership::NodeSpec::store).
std::string StoreHolderId(const std::string& address, const std::string& cluster_store);
// The holder id of the shared tier behind the stores (kvstore/shared_tier.h), whose chunks every
// node that reads a store can have.
inline constexpr char kSharedTierHolder[] = "shared-tier";

enum class NodeRole : uint8_t { kPrefill, kDecode };
// How Route's kResourceExhausted messages begin, by the role that has no room.
inline constexpr char kNoPrefillRoom[] = "no prefill node can take the request";
inline constexpr char kNoDecodeRoom[] = "no decode node can take the request";
const char* NodeRoleName(NodeRole role);

// The latest load report of one node (plus LoadTracker::Overlay's additions).
struct NodeLoad {
  std::string id;  // same as its holder id in the PrefixIndex
  NodeRole role = NodeRole::kPrefill;
  bool healthy = true;
  uint64_t queued_prefill_tokens = 0;  // prefill: tokens waiting or being prefilled
  uint32_t active_requests = 0;        // requests the node holds (queued or running)
  uint64_t kv_bytes_in_use = 0;        // decode: KV of running sequences
  uint64_t kv_bytes_reserved = 0;      // decode: reserved for transfers under way
  uint64_t kv_bytes_capacity = 0;      // decode: 0 means not reported, and the node is skipped
  uint32_t max_batch = 0;              // decode: concurrent sequences; 0 = no limit
  uint32_t max_waiting = 0;  // decode: requests held beyond max_batch at most; 0 = not reported
  // prefill: the node's own queue bound in prompt tokens (0 = not reported), and its rate.
  uint64_t max_queued_prefill_tokens = 0;
  double prefill_tokens_per_second = 0;
  bool reads_store = true;             // prefill: can fetch chunks from the shared store
  // prefill: the holder of the store it reads (StoreHolderId), whose chunks (and the shared
  // tier's, kSharedTierHolder) it is credited with; "": every kStore holder's (one store).
  std::string store_holder = "";
  // When the report was taken, in the router's clock; LoadTracker adds only what was routed
  // after it. InfinitePast: nothing routed is reflected yet.
  absl::Time reported_at = absl::InfinitePast();
};

struct RoutingOptions {
  // Credit per cached leading chunk on the node itself, by its fastest tier (Dynamo's defaults).
  double device_hit_weight = 1.0;
  double ram_hit_weight = 0.75;
  double disk_hit_weight = 0.25;
  // m: credit per chunk the shared store holds beyond the node's local run (Dynamo's
  // shared_cache_multiplier when a shared cache is on).
  double store_hit_weight = 0.5;
  // α: cost in chunks per request already on the prefill node; small, it breaks near-ties
  // towards idle nodes.
  double active_request_weight = 0.1;
  // Softmax temperature over range-normalised costs; 0 = argmin.
  double temperature = 0.0;
  // Prefill nodes with more queued tokens are passed over unless all are; 0 = off.
  uint64_t busy_prefill_tokens = 0;
  // A prefill node cannot take a request that would bring its queue above this; 0 = no limit.
  uint64_t max_queued_prefill_tokens = 0;
  // Seed of the tie-break and softmax draws (fixed in tests).
  uint64_t seed = 0x5eed;

  // kInvalidArgument for a negative or non-finite weight or temperature, or
  // busy_prefill_tokens > max_queued_prefill_tokens when both are set.
  absl::Status Validate() const;
};

struct RouteRequest {
  uint64_t prompt_tokens = 0;    // ISL, >= 1
  uint32_t chunk_tokens = 0;     // C, >= 1 (PrefixKeyOptions::chunk_tokens)
  uint64_t decode_kv_bytes = 0;  // estimated compressed KV the decode node must reserve
};

struct PrefillCandidate {
  std::string id;
  std::string skipped;        // empty when it was a candidate; else why not
  uint32_t local_chunks = 0;  // leading chunks in its own cache
  uint32_t tier_chunks[kNumHolderTiers] = {0, 0, 0};
  uint32_t store_chunks = 0;     // further leading chunks it would read from the store
  uint64_t uncached_tokens = 0;  // prompt tokens it would compute
  double raw = 0, credit = 0, cost = 0;
};

struct DecodeCandidate {
  std::string id;
  std::string skipped;        // empty when it was a candidate; else why not
  double kv_fraction = 0;     // (in use + reserved + this request) / capacity
  double batch_fraction = 0;  // (active + 1) / max_batch; 0 without a limit
  double load = 0;            // max of the two
};

struct RouteDecision {
  std::string prefill_id;
  std::string decode_id;
  uint32_t chain_chunks = 0;  // full chunks in the prompt
  uint32_t local_chunks = 0;  // cached at the chosen prefill node
  uint32_t store_chunks = 0;  // read from the shared store beyond those
  uint64_t uncached_tokens = 0;
  uint64_t decode_kv_bytes = 0;
  double prefill_cost = 0;
  double decode_load = 0;
  std::vector<PrefillCandidate> prefill_candidates;  // every prefill node, in input order
  std::vector<DecodeCandidate> decode_candidates;    // every decode node, in input order

  uint32_t expected_cached_chunks() const { return local_chunks + store_chunks; }
  // One line: the choice, its cached chunks, and every candidate's cost or reason.
  std::string Explain() const;
};

class RoutingPolicy {
 public:
  // kInvalidArgument when options.Validate() fails.
  static absl::StatusOr<std::unique_ptr<RoutingPolicy>> Create(RoutingOptions options);

  // `overlap` is the PrefixIndex's answer for this prompt's chain (prompt_tokens / chunk_tokens
  // full chunks): node holders are matched to nodes by id, kStore holders give the store
  // overlap. Errors: see the file comment.
  absl::StatusOr<RouteDecision> Route(const RouteRequest& request, const OverlapResult& overlap,
                                      absl::Span<const NodeLoad> nodes) const;

  const RoutingOptions& options() const { return options_; }

 private:
  explicit RoutingPolicy(RoutingOptions options);
  // Index into `costs` of the pick among `eligible` (indices into costs).
  size_t Pick(absl::Span<const double> costs, absl::Span<const size_t> eligible,
              double temperature) const;

  const RoutingOptions options_;
  // std::mutex rather than absl::Mutex here and in LoadTracker: Debian's Abseil is not built
  // with ThreadSanitizer annotations (see common/thread_pool.h). Guards rng_.
  mutable std::mutex rng_mu_;
  mutable std::mt19937_64 rng_;
};

// The load the router has sent but the nodes' reports do not show yet, kept per request as
// Dynamo's slot manager does: at routing the prefill node gains the request's uncached tokens
// and one active request, the decode node its decode_kv_bytes (as reserved) and one active
// request. The prefill share goes at first token (MarkPrefillDone), the rest at completion,
// failure or cancellation (Complete). Overlay adds a share to a node only if it was routed after
// that node's reported_at: a later report already counts it.
//
// Memory: one entry per request in flight; Forget drops entries a lost completion left behind.
class LoadTracker {
 public:
  LoadTracker() = default;
  LoadTracker(const LoadTracker&) = delete;
  LoadTracker& operator=(const LoadTracker&) = delete;

  // kAlreadyExists when request_id is in flight; kInvalidArgument for an empty id or a
  // decision without both nodes.
  absl::Status Add(absl::string_view request_id, const RouteDecision& decision, absl::Time now);
  // First token: drops the prefill share. False if unknown or already done.
  bool MarkPrefillDone(absl::string_view request_id);
  // Drops everything the request holds. False if unknown.
  bool Complete(absl::string_view request_id);
  // Drops requests routed before `cutoff`. Returns how many.
  size_t Forget(absl::Time cutoff);

  // Adds to each node the shares routed to it after its reported_at. O(nodes + those shares).
  void Overlay(absl::Span<NodeLoad> nodes) const;
  size_t in_flight() const;

 private:
  using ShareKey = std::pair<absl::Time, uint64_t>;  // (routed at, sequence)
  struct Share {
    uint64_t tokens = 0;    // prefill: uncached tokens
    uint64_t kv_bytes = 0;  // decode: reservation
  };
  struct NodeShares {
    std::map<ShareKey, Share> prefill;  // by routing time: Overlay reads a suffix
    std::map<ShareKey, Share> decode;
  };
  struct Request {
    std::string prefill_id, decode_id;
    ShareKey key;
    bool prefill_done = false;
  };
  // Both run under mu_.
  void DropPrefill(const Request& r);
  void DropDecode(const Request& r);

  mutable std::mutex mu_;  // guards every member below
  absl::flat_hash_map<std::string, Request> requests_;
  absl::flat_hash_map<std::string, NodeShares> nodes_;
  uint64_t next_sequence_ = 0;
};

}  // namespace strata::router
