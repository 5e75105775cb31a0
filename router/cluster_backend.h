// ClusterBackend: the router's Backend (backend.h) — it serves OpenAI requests through the
// cluster's prefill and decode nodes over gRPC (proto/serving.proto).
//
//   ClusterBackendOptions o;
//   o.spec = *membership::LoadClusterFile("cluster.json");
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ClusterBackend> backend, ClusterBackend::Create(o));
//   STRATA_ASSIGN_OR_RETURN(auto server, HttpServer::Start(http_options, backend.get()));
//
// One request (Start):
//   1. Tokenize: a chat prompt (it already holds the template's BOS text) with special tokens
//      parsed and no BOS added; a completions string with special tokens parsed and the model's
//      BOS prepended unless it starts with it; token ids as given. Checked against the
//      vocabulary and the context (the model's max_position_embeddings, or its sliding window
//      when smaller); chat's max_tokens 0 means the rest of the context.
//   2. Route: the prompt's chunk keys (with the request's cache salt, keyed exactly as the
//      prefill engine keys them) give the PrefixIndex overlap; RoutingPolicy::Route picks the
//      nodes from the latest Load reports plus the LoadTracker's account of what was routed since.
//   3. Dispatch with gRPC's callback API (no thread per request): DecodeNode.Generate opens the
//      token stream; on its first message (`registered`) PrefillNode.Prefill is called with the
//      decode node's transport address. Tokens go to the stream as they arrive; `finished`
//      ends it with the usage (cached_tokens as the decode node reports it).
//   Failures: a Prefill error cancels the Generate call and fails the request with the prefill
//   node's error; a Generate stream that ends in an error fails it with the decode node's (when
//   the decode node reports anything but UNAVAILABLE / DEADLINE_EXCEEDED while the Prefill is
//   still out, the Prefill's answer is awaited first: the decode node most likely dropped the
//   request because the prefill failed, and that is the error worth reporting). Messages name
//   the node ("prefill node prefill-0 (127.0.0.1:7101): RESOURCE_EXHAUSTED: ...").
//
// Start's errors: NOT_FOUND (another model), INVALID_ARGUMENT naming the field ("prompt",
// "messages", "max_tokens"), RESOURCE_EXHAUSTED (max_in_flight requests already in flight, or no
// node can take the request: the routing policy's answer, from the nodes' own queue bounds; it
// carries a Retry-After estimate), UNAVAILABLE (no healthy prefill or decode node).
//
// Overload (docs/cluster.md): a request is admitted only where a prefill node's queue and a
// decode node's batch and waiting queue have room for it, so a request once started finishes
// or fails only because a node was lost; a node that refuses it all the same (the router's view
// was stale) fails it with RESOURCE_EXHAUSTED, which the HTTP layer still answers with 429 (no
// token was sent). Retries: once, on other nodes, only after a node was lost (UNAVAILABLE) before
// the first token, before the deadline, and within the retry budget; never on overload or a
// deadline.
//
// Background: a poller thread calls Load on every node each load_poll_interval (NodePool: a node
// that fails is not routed to until it answers again) and sweeps the index. When the cluster has a
// store, its Watch stream feeds the index (StoreFeed) as the holder "store"; a store that is down
// at start is retried every store_retry_interval, and the watch reconnects on its own after.
// With a shared tier (ClusterBackendOptions::shared_tier), the chunks past the store's are asked
// of Redis as each request is routed (SharedTierProbe, CachedOverlap).
//
// Metrics (RenderMetrics, Prometheus text): strata_router_requests_total{status} (every request
// Start saw, by outcome: "ok", "cancelled", or the error code in lower case),
// strata_router_ttft_seconds and strata_router_inter_token_seconds (histograms; TTFT from the
// request's arrival), strata_router_prompt_tokens_total (of routed requests),
// strata_router_completion_tokens_total (tokens streamed), strata_router_cached_tokens_total (as
// the decode nodes report them at the end), strata_router_in_flight,
// strata_router_routed_total{prefill,decode}, strata_router_node_healthy{node,role},
// strata_router_store_connected, strata_router_rejected_total{reason} (429s: router_in_flight,
// prefill_queue, decode_queue, node), strata_router_retries_total and
// strata_router_retries_throttled_total (lost nodes whose request the budget did not retry),
// strata_router_shared_tier_probes_total, strata_router_shared_tier_chunks_total (chunks found
// beyond the store's), strata_router_shared_tier_errors_total and
// strata_router_shared_tier_probe_seconds (with a shared tier).
//
// Logs (serving::Log, with the request id): one line at routing (RouteDecision::Explain) and one
// at the end (status, tokens, TTFT).
//
// Thread safety: as backend.h requires. Destroying the backend stops the poller and the store
// watch, cancels every request still in flight and waits for their gRPC calls to end. The HTTP
// server in front must be stopped first; a RequestHandle may outlive the backend (it is then
// inert).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/prefix_key.h"
#include "grpcpp/support/status.h"
#include "kvstore/store_client.h"
#include "membership/cluster_file.h"
#include "model/config.h"
#include "model/tokenizer.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "router/backend.h"
#include "router/node_pool.h"
#include "router/prefix_index.h"
#include "router/retry_budget.h"
#include "router/routing_policy.h"
#include "router/shared_tier_probe.h"
#include "router/store_feed.h"

namespace strata::router {

struct ClusterBackendOptions {
  // The cluster: model folder, codec, chunk size, calibration, store, nodes
  // (membership::LoadClusterFile). spec.model must name a model folder (config.json,
  // tokenizer.json, weights: the weights are read once, for the fingerprint that names the
  // model's blocks in the store, then released).
  membership::ClusterSpec spec = {};
  // Who is in the cluster; null: the spec's nodes, fixed (membership::StaticMembership).
  std::shared_ptr<const membership::Membership> membership = nullptr;
  // The model name clients ask for ("model"); "" = the model folder's name (as the nodes report).
  std::string model_name = "";
  // Requests in flight at most (Start to Finish / Fail / cancellation); over it Start answers
  // RESOURCE_EXHAUSTED (HTTP 429). >= 1.
  uint32_t max_in_flight = 1024;
  // How often every node's Load is polled, and how long one poll may take.
  absl::Duration load_poll_interval = absl::Milliseconds(100);
  absl::Duration load_timeout = absl::Seconds(1);
  // A request's deadline: generate_timeout from its arrival, or the client's timeout
  // (CompletionRequest::timeout) when shorter. Both calls carry it (the nodes give the request
  // up then); the Prefill call gives up prefill_timeout after it started, if that comes first.
  absl::Duration prefill_timeout = absl::Seconds(300);
  absl::Duration generate_timeout = absl::Minutes(30);
  // Retries after a lost node, as a fraction of recent requests (retry_budget.h).
  RetryBudgetOptions retry_budget = {};
  // Store: how long one connection attempt waits, and how often a store that is down is retried.
  absl::Duration store_connect_timeout = absl::Milliseconds(250);
  absl::Duration store_retry_interval = absl::Seconds(1);
  // How prefix keys are computed (algorithm, hash block size, seed): must be what the prefill
  // nodes use (PrefillEngineOptions::keys). chunk_tokens comes from the spec and the cache salt
  // from each request; the values here are ignored.
  PrefixKeyOptions keys = {};
  RoutingOptions routing = {};
  PrefixIndexOptions index = {};
  // TLS and the cluster token of every gRPC call to the nodes and the store
  // (rpc/grpc_security.h); null: insecure (plaintext, no token).
  std::shared_ptr<const rpc::GrpcSecurity> security = nullptr;
  // The shared tier behind the stores (kvstore/shared_tier.h), when the stores have one: the
  // router asks it, as it routes a prompt, for the chunks beyond those the store holds
  // (SharedTierProbe), and credits them as store chunks to every node that reads a store (the
  // nodes read the shared tier through their store). A tier that does not answer at start is
  // tried again every store_retry_interval; routing ignores it meanwhile.
  std::optional<kvstore::SharedTierOptions> shared_tier = std::nullopt;
  // Chunks asked of the shared tier per request at most (a store promotes at most
  // StoreService::kMaxPromotedChunks past its own per Lookup: no more should be credited), and
  // how long routing waits for the answer (it replaces the tier's own timeouts where longer).
  uint32_t shared_tier_probe_chunks = 64;
  absl::Duration shared_tier_probe_timeout = absl::Milliseconds(100);

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

class ClusterBackend final : public Backend {
 public:
  // Validates the options, reads the model folder (tokenizer, config, chat template, block
  // names), connects to nothing yet and starts the poller (the first poll runs at once). Errors:
  // INVALID_ARGUMENT (options), NOT_FOUND / INVALID_ARGUMENT from reading the model.
  static absl::StatusOr<std::unique_ptr<ClusterBackend>> Create(ClusterBackendOptions options);
  ~ClusterBackend() override;
  ClusterBackend(const ClusterBackend&) = delete;
  ClusterBackend& operator=(const ClusterBackend&) = delete;

  // Backend.
  std::vector<ModelCard> Models() const override;
  std::string ChatTemplateText(const std::string& model) const override;
  absl::StatusOr<std::unique_ptr<RequestHandle>> Start(
      CompletionRequest request, std::shared_ptr<CompletionStream> stream) override;
  // True when at least one prefill and one decode node are healthy; *detail names the unhealthy
  // nodes and why (also when true, if any are).
  bool Healthy(std::string* detail) const override;
  std::string RenderMetrics() const override;

  // The HTTP side's report of one streamed token: from its arrival (the Token call) to the end of
  // the socket write that carried it (HttpServerOptions::on_token_written). Thread-safe.
  void RecordTokenWritten(absl::Duration since_arrival);

  // For tests and status pages.
  const std::string& model_name() const { return model_name_; }
  uint32_t context_tokens() const { return context_tokens_; }
  size_t in_flight() const { return in_flight_.load(); }
  std::vector<NodeStatus> Nodes() const { return pool_->Status(); }
  const PrefixIndex& prefix_index() const { return *index_; }
  // The prompt's chunk keys as the prefill nodes compute them.
  absl::StatusOr<std::vector<BlockHash>> ChunkKeys(const std::vector<uint32_t>& tokens,
                                                   const std::string& cache_salt) const;
  // Null when the cluster has no store.
  const StoreFeed* store_feed() const { return store_feed_; }
  // What routing counts as cached for `chain`: the index's overlap, plus, with a shared tier
  // that answers, a kStore holder kSharedTierHolder with the leading chunks Redis holds (asked
  // in one round trip, up to shared_tier_probe_chunks; not asked for store_retry_interval after
  // a probe the tier did not answer). Nodes on any host read it through their own store.
  OverlapResult CachedOverlap(absl::Span<const BlockHash> chain, absl::Time now) const;
  // True once the shared tier answered its connection (false without one).
  bool shared_tier_connected() const;

 private:
  struct Request;
  struct HandleCell;
  struct StoreLink;
  struct ChoiceSet;
  class Handle;
  class GenerateReactor;

  explicit ClusterBackend(ClusterBackendOptions options);
  absl::Status Init();
  void PollLoop();
  void MaybeConnectStores();
  void MaybeConnectStore(const std::string& address, StoreLink& link);
  // The shared tier's connection, on a thread of its own (attempts can take the probe timeout
  // per seed: the poller must not wait on them): until it connects or the backend stops.
  void ConnectSharedTierLoop();
  std::shared_ptr<SharedTierProbe> shared_probe() const;
  void MaybeWatchNodeTiers();

  // Tokenization and the context check: the prompt tokens; *max_tokens resolved.
  // The logprobs and echo of a request (CompletionRequest::logprobs, echo) need the prefill
  // node's answer: the first token's logprobs and the prompt's are in its PrefillResponse, so
  // the first token waits for it (held in the request) when it comes first.
  absl::StatusOr<std::vector<uint32_t>> Tokenize(const CompletionRequest& request) const;
  absl::Status CheckContext(const CompletionRequest& request, size_t prompt_tokens,
                            uint32_t* max_tokens) const;

  // Request lifecycle (see cluster_backend.cc).
  // Starts one choice of a request (the only one when n is 1) on `cell`; `later`: the choices
  // to start once this one's prefill is done. The caller holds its in-flight slot.
  absl::Status StartChoice(CompletionRequest request, std::shared_ptr<CompletionStream> stream,
                           std::vector<uint32_t> tokens, std::vector<BlockHash> chain,
                           uint32_t max_tokens, std::shared_ptr<HandleCell> cell,
                           std::shared_ptr<ChoiceSet> later, absl::Time now);
  void StartLater(const std::shared_ptr<ChoiceSet>& later);
  // Routes `r` (never to node `avoid`) and starts its Generate call; the tracker holds it then.
  absl::Status Launch(const std::shared_ptr<Request>& r, const std::string& avoid);
  // After `lost` failed `r` with UNAVAILABLE or DEADLINE_EXCEEDED before any token reached the
  // client, on the first attempt: ends it quietly and routes the request once more, elsewhere
  // (failing the stream if that cannot start). False when it does not apply.
  bool MaybeRetry(const std::shared_ptr<Request>& r, const absl::Status& error,
                  const std::string& lost);
  // The decode node is draining and handed `r` off: continues it on another decode node, its
  // prompt followed by the tokens streamed so far (their KV from the store), the same stream.
  void OnHandedOff(const std::shared_ptr<Request>& r, const strata::v1::HandedOff& handed_off);
  // A new attempt of `r`'s request, for `stream`: registered, copied from `r`.
  std::shared_ptr<Request> NextAttempt(const std::shared_ptr<Request>& r,
                                       std::shared_ptr<CompletionStream> stream);
  // Ends `r` on its nodes and launches `next` (never to `avoid`); if it cannot start, fails the
  // stream with `error` and "`failed_how`: why".
  void StartNext(const std::shared_ptr<Request>& r, const std::shared_ptr<Request>& next,
                 const std::string& avoid, const absl::Status& error,
                 const std::string& failed_how);
  void OnRegistered(const std::shared_ptr<Request>& r, const strata::v1::Registered& registered);
  void OnToken(const std::shared_ptr<Request>& r, const strata::v1::TokenEvent& token);
  // Under r->mu: hands `token` to the stream, with its logprobs when the request asked for them
  // (`logprobs`: the decode node's, or the prefill node's for the first token), after the echo
  // of the prompt when that is due.
  void DeliverLocked(Request& r, const strata::v1::TokenEvent& token,
                     const strata::v1::TokenLogprobs& logprobs);
  // A token's logprobs with the tokens' bytes, for the stream.
  TokenLogprobs LogprobsOf(uint32_t token, const strata::v1::TokenLogprobs& lp) const;
  std::string TokenBytes(uint32_t token) const;
  void OnFinished(const std::shared_ptr<Request>& r, const strata::v1::Finished& finished);
  void OnGenerateDone(const std::shared_ptr<Request>& r, const grpc::Status& status);
  void OnPrefillDone(const std::shared_ptr<Request>& r, const grpc::Status& status);
  // Ends the request once: the stream's Finish (status OK) or Fail (unless cancelled), the
  // tracker, metrics and the end log line.
  void End(const std::shared_ptr<Request>& r, const absl::Status& status);
  // From ~Request: forgets it and keeps its node connections for the poller to drop.
  void RequestGone(Request* r, std::shared_ptr<const NodeConnection> prefill,
                   std::shared_ptr<const NodeConnection> decode);
  void CountOutcome(const absl::Status& status);
  // A routing refusal as Start returns it: RESOURCE_EXHAUSTED counted by reason, with a
  // Retry-After estimate from the nodes' queues and rates.
  absl::Status Refusal(const absl::Status& route_error, absl::Span<const NodeLoad> nodes,
                       uint64_t prompt_tokens);

  const ClusterBackendOptions options_;
  std::string model_name_;
  model::ModelConfig config_;
  uint32_t context_tokens_ = 0;
  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::string chat_template_;
  std::vector<BlockName> layer_names_;    // per layer: this model's block namespace in the store
  int64_t created_ = 0;                   // Unix seconds, for ModelCard
  std::unique_ptr<PrefixHasher> hasher_;  // no cache salt; salted requests make their own
  model::ServedFormat format_;            // the cluster's (serving::FormatOf)

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_total_ = nullptr;
  prometheus::Family<prometheus::Counter>* routed_total_ = nullptr;
  prometheus::Histogram* ttft_ = nullptr;
  prometheus::Histogram* inter_token_ = nullptr;
  prometheus::Histogram* token_relay_ = nullptr;
  prometheus::Counter* prompt_tokens_ = nullptr;
  prometheus::Counter* cached_tokens_ = nullptr;
  prometheus::Counter* completion_tokens_ = nullptr;
  prometheus::Gauge* in_flight_gauge_ = nullptr;
  prometheus::Gauge* store_connected_ = nullptr;
  prometheus::Counter* retries_ = nullptr;
  prometheus::Counter* retries_throttled_ = nullptr;
  prometheus::Family<prometheus::Counter>* rejected_total_ = nullptr;
  prometheus::Counter* handoffs_ = nullptr;
  prometheus::Counter* shared_probes_ = nullptr;
  prometheus::Counter* shared_chunks_ = nullptr;
  prometheus::Counter* shared_errors_ = nullptr;
  prometheus::Histogram* shared_probe_seconds_ = nullptr;

  std::unique_ptr<PrefixIndex> index_;
  std::unique_ptr<RoutingPolicy> policy_;
  LoadTracker tracker_;
  std::unique_ptr<NodePool> pool_;
  const StoreFeed* store_feed_ = nullptr;  // the cluster store's (stores_[spec.store].feed)
  std::atomic<size_t> in_flight_{0};
  RetryBudget retry_budget_;

  mutable std::mutex seed_mu_;  // guards seed_rng_
  std::mt19937_64 seed_rng_;    // seeds of requests that name none

  // The stores whose events feed the index: the cluster's (spec.store, holder "store") and
  // every other store a node names as its host's (NodeSpec::store, holder "store@ADDRESS").
  // Created by Init (the cluster's) and the poller thread (the others); the poller thread's alone
  // after Init.
  struct StoreLink {
    std::unique_ptr<StoreFeed> feed;
    std::unique_ptr<kvstore::StoreClient> client;
    std::unique_ptr<kvstore::StoreWatch> watch;  // declared last: stopped first
    absl::Time next_attempt = absl::InfinitePast();
    bool down_logged = false;
  };
  std::map<std::string, StoreLink> stores_;  // by address
  // Prefill nodes with their own RAM tier (NodeLoad.local_tier_bytes): the watch of each feeds
  // the index as a kNode holder named by the node's id. Poller thread only.
  struct NodeFeed {
    std::unique_ptr<StoreFeed> feed;
    std::unique_ptr<kvstore::StoreClient> client;
    std::unique_ptr<kvstore::StoreWatch> watch;  // declared last: stopped first
  };
  std::map<std::string, NodeFeed> node_feeds_;
  mutable std::mutex shared_mu_;                   // guards shared_probe_
  std::shared_ptr<SharedTierProbe> shared_probe_;  // null until connected
  mutable std::atomic<int64_t> shared_quiet_until_ns_{
      0};  // no probe before (Unix ns): after an error

  // Poller thread.
  std::mutex poll_mu_;  // guards stop_ (the poller and shared_connector_ wait on poll_cv_)
  std::condition_variable poll_cv_;
  bool stop_ = false;
  std::thread poller_;
  std::thread shared_connector_;  // ConnectSharedTierLoop; stops with stop_ too

  // Requests alive (their gRPC calls own them), for the destructor, which cancels them and waits
  // for them all to be gone.
  std::mutex calls_mu_;  // guards the members below
  std::condition_variable calls_cv_;
  absl::flat_hash_map<Request*, std::weak_ptr<Request>> live_;
  // Node connections of requests that are gone, dropped by the poller thread (never on a gRPC
  // callback thread: see ~Request).
  std::vector<std::shared_ptr<const NodeConnection>> retired_;
};

}  // namespace strata::router
