#include "router/cluster_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "grpcpp/support/client_callback.h"
#include "model/kv_cache.h"
#include "model/llama.h"
#include "prometheus/text_serializer.h"
#include "router/chat_template.h"
#include "router/openai_api.h"
#include "rpc/grpc_status.h"
#include "serving/node_process.h"

namespace strata::router {
namespace {

std::string OutcomeLabel(const absl::Status& s) {
  return s.ok() ? "ok" : absl::AsciiStrToLower(absl::StatusCodeToString(s.code()));
}

std::string Millis(absl::Duration d) {
  return absl::StrFormat("%.1f ms", absl::ToDoubleMilliseconds(d));
}

absl::Status Positive(absl::Duration d, const char* name) {
  if (d > absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("cluster backend: ", name, " must be positive, got ", absl::FormatDuration(d)));
}

}  // namespace

absl::Status ClusterBackendOptions::Validate() const {
  if (spec.model.empty()) return absl::InvalidArgumentError("cluster backend: spec.model is empty");
  if (spec.nodes.empty() && membership == nullptr) {
    return absl::InvalidArgumentError("cluster backend: the cluster has no nodes");
  }
  if (max_in_flight < 1) {
    return absl::InvalidArgumentError("cluster backend: max_in_flight must be >= 1");
  }
  STRATA_RETURN_IF_ERROR(Positive(load_poll_interval, "load_poll_interval"));
  STRATA_RETURN_IF_ERROR(Positive(load_timeout, "load_timeout"));
  STRATA_RETURN_IF_ERROR(Positive(prefill_timeout, "prefill_timeout"));
  STRATA_RETURN_IF_ERROR(Positive(generate_timeout, "generate_timeout"));
  STRATA_RETURN_IF_ERROR(Positive(store_connect_timeout, "store_connect_timeout"));
  STRATA_RETURN_IF_ERROR(Positive(store_retry_interval, "store_retry_interval"));
  if (absl::Status s = retry_budget.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cluster backend: ", s.message()));
  }
  const model::ServedFormat format{
      .codec = spec.codec, .chunk_tokens = spec.chunk_tokens, .keys = keys};
  if (absl::Status s = format.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cluster backend: ", s.message()));
  }
  if (shared_tier.has_value()) {
    if (absl::Status s = shared_tier->Validate(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("cluster backend: ", s.message()));
    }
    if (shared_tier_probe_chunks < 1) {
      return absl::InvalidArgumentError("cluster backend: shared_tier_probe_chunks must be >= 1");
    }
    STRATA_RETURN_IF_ERROR(Positive(shared_tier_probe_timeout, "shared_tier_probe_timeout"));
  }
  STRATA_RETURN_IF_ERROR(routing.Validate());
  return index.Validate();
}

// One request's state. Owned by its gRPC calls (the Generate reactor and the Prefill callback
// hold it), so it is freed when the last call has ended, on whichever thread that is; the Handle
// only watches it (weak_ptr). Its destructor tells the backend (RequestGone), which waits for
// every request to be gone before it goes itself.
struct ClusterBackend::Request {
  explicit Request(ClusterBackend* b) : backend(b) {}
  // The contexts go first (each drops its call), then the node connections are handed to the
  // backend: a channel must not be destroyed on a gRPC callback thread, which this may be (it
  // would shut down the callback queue the thread serves).
  ~Request() {
    generate_ctx.reset();
    prefill_ctx.reset();
    backend->RequestGone(this, std::move(prefill_node), std::move(decode_node));
  }

  ClusterBackend* const backend;
  std::string id;
  std::shared_ptr<HandleCell> cell;  // shared with the client's Handle and a retry's Request
  CompletionRequest request;         // as Start resolved it (the seed set): a retry's input
  std::vector<BlockHash> chain;      // the prompt's chunk keys
  uint32_t max_tokens = 0;
  int attempt = 0;  // 0, or 1 for the retry after a node was lost before the first token
  int hop = 0;      // hand-offs from draining decode nodes so far
  std::string node_request_id;        // the id the nodes see ("" = id): each attempt its own
  uint32_t client_prompt_tokens = 0;  // the client's prompt (a continuation's prompt is longer)
  uint32_t client_max_tokens = 0;     // the client's max_tokens (a continuation's is what is left)
  uint32_t tokens_at_start = 0;       // tokens streamed before this attempt began
  bool continued = false;             // continues a handed-off attempt (counts go on)
  // n > 1, choice 0: the other choices, started once this one's prefill is done (StartLater).
  std::shared_ptr<ChoiceSet> later;
  std::shared_ptr<const NodeConnection> prefill_node, decode_node;
  std::unique_ptr<grpc::ClientContext> generate_ctx = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientContext> prefill_ctx = std::make_unique<grpc::ClientContext>();
  strata::v1::GenerateRequest generate_req;
  strata::v1::PrefillRequest prefill_req;
  strata::v1::PrefillResponse prefill_resp;  // read only after the Prefill callback
  absl::Time arrival, routed_at;
  absl::Time deadline = absl::InfiniteFuture();  // the request's, on every attempt
  uint32_t prompt_tokens = 0;
  std::atomic<bool> cancelled{false};  // the handle's Cancel (or the backend's destructor)
  std::atomic<bool> ended{false};      // set under mu by End

  // Serializes the stream calls (Token from the reactor, Finish / Fail from whichever call ends
  // the request); guards every member below. Never held while calling into gRPC.
  std::mutex mu;
  std::shared_ptr<CompletionStream> stream;  // dropped by End
  bool registered = false;
  bool prefill_started = false;
  bool prefill_done = false;
  bool finished = false;  // `finished` arrived
  // Logprobs / echo: the attempt's first token, and any after it, held in order until the
  // prefill node's answer (with the first one's logprobs) arrives; whether the prompt was echoed.
  std::vector<strata::v1::TokenEvent> held;
  bool echoed = false;
  bool finish_pending = false;  // `finished` came while tokens were held
  absl::Status generate_error;  // a Generate error held until the Prefill answers
  std::string prefill_summary;  // for the end log line
  uint32_t completion_tokens = 0;
  std::vector<uint32_t> generated;  // the tokens streamed (a hand-off continues after them)
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_token_at = absl::InfinitePast();
  FinishReason reason = FinishReason::kStop;
  Usage usage;
};

// The choices of an n > 1 request after the first, waiting for its prefill.
struct ClusterBackend::ChoiceSet {
  std::vector<CompletionRequest> requests;  // choice 1.. (own id and seed)
  std::vector<std::shared_ptr<CompletionStream>> streams;
  std::vector<std::shared_ptr<HandleCell>> cells;
  std::vector<uint32_t> tokens;
  std::vector<BlockHash> chain;
  uint32_t max_tokens = 0;
};

// What the client's Handle sees of its request: the attempt under way (a retry replaces it).
struct ClusterBackend::HandleCell {
  std::mutex mu;
  std::weak_ptr<Request> current;
  bool cancelled = false;  // once set, no retry starts
};

namespace {

// Takes no lock of the request: TryCancel is thread-safe (also before the call starts: it then
// starts cancelled), and what it sets off ends the request through the calls' callbacks.
template <typename R>
void CancelCalls(R& r) {
  if (r.ended.load() || r.cancelled.exchange(true)) return;
  r.generate_ctx->TryCancel();
  r.prefill_ctx->TryCancel();
}

}  // namespace

// Watches the request without owning it: once its calls have ended the request is gone and
// Cancel (or the destructor) does nothing, even after the backend itself is gone.
class ClusterBackend::Handle final : public RequestHandle {
 public:
  // One cell per choice (n > 1), or one.
  explicit Handle(std::vector<std::shared_ptr<HandleCell>> cells) : cells_(std::move(cells)) {}
  ~Handle() override { Cancel(); }
  void Cancel() override {
    for (const std::shared_ptr<HandleCell>& cell : cells_) {
      std::shared_ptr<Request> r;
      {
        std::lock_guard<std::mutex> lock(cell->mu);
        cell->cancelled = true;
        r = cell->current.lock();
      }
      if (r != nullptr) CancelCalls(*r);
    }
  }

 private:
  std::vector<std::shared_ptr<HandleCell>> cells_;
};

// DecodeNode.Generate as a callback reactor: owns a reference to the request until OnDone, where
// it deletes itself.
class ClusterBackend::GenerateReactor final
    : public grpc::ClientReadReactor<strata::v1::GenerateEvent> {
 public:
  explicit GenerateReactor(std::shared_ptr<Request> r) : r_(std::move(r)) {}

  // Nothing may touch `this` after StartCall: OnDone (and the delete) may already have run.
  void Begin() {
    r_->decode_node->decode->async()->Generate(r_->generate_ctx.get(), &r_->generate_req, this);
    StartRead(&event_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    ClusterBackend* b = r_->backend;
    switch (event_.event_case()) {
      case strata::v1::GenerateEvent::kRegistered:
        b->OnRegistered(r_, event_.registered());
        break;
      case strata::v1::GenerateEvent::kToken:
        b->OnToken(r_, event_.token());
        break;
      case strata::v1::GenerateEvent::kFinished:
        b->OnFinished(r_, event_.finished());
        break;
      case strata::v1::GenerateEvent::kHandedOff:
        b->OnHandedOff(r_, event_.handed_off());
        break;
      default:
        b->End(r_, absl::InternalError(
                       absl::StrCat(r_->decode_node->description, ": an empty GenerateEvent")));
        break;
    }
    StartRead(&event_);
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<Request> r = std::move(r_);
    r->backend->OnGenerateDone(r, status);
    delete this;
    // `r` may be the last reference: the request goes here.
  }

 private:
  std::shared_ptr<Request> r_;
  strata::v1::GenerateEvent event_;
};

ClusterBackend::ClusterBackend(ClusterBackendOptions options)
    : options_(std::move(options)),
      registry_(std::make_shared<prometheus::Registry>()),
      retry_budget_(options_.retry_budget),
      seed_rng_(std::random_device{}()) {}

absl::StatusOr<std::unique_ptr<ClusterBackend>> ClusterBackend::Create(
    ClusterBackendOptions options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<ClusterBackend> b(new ClusterBackend(std::move(options)));
  STRATA_RETURN_IF_ERROR(b->Init());
  b->poller_ = std::thread([p = b.get()] { p->PollLoop(); });
  if (b->options_.shared_tier.has_value()) {
    b->shared_connector_ = std::thread([p = b.get()] { p->ConnectSharedTierLoop(); });
  }
  return b;
}

absl::Status ClusterBackend::Init() {
  const membership::ClusterSpec& spec = options_.spec;
  // The model's identity (config, the fingerprint that names its blocks, tokenizer): no weights.
  STRATA_ASSIGN_OR_RETURN(serving::ServedModel served,
                          serving::LoadServedModelIdentity(spec.model, spec.calibration));
  model_name_ = options_.model_name.empty() ? served.name : options_.model_name;
  config_ = served.config;
  context_tokens_ = config_.max_position_embeddings;
  if (config_.sliding_window > 0)
    context_tokens_ = std::min(context_tokens_, config_.sliding_window);
  tokenizer_ = std::move(served.tokenizer);
  const std::filesystem::path tokenizer_config =
      std::filesystem::path(spec.model) / "tokenizer_config.json";
  if (std::filesystem::exists(tokenizer_config)) {
    std::ifstream in(tokenizer_config);
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<std::string> t = ChatTemplateFromTokenizerConfig(text.str());
    if (!t.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(tokenizer_config.string(), ": ", t.status().message()));
    }
    chat_template_ = *std::move(t);
  }
  format_ = serving::FormatOf(spec, served, options_.keys);
  model::KvCacheOptions cache_options = format_.CacheOptions();
  cache_options.model_fingerprint = served.fingerprint;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::SequenceKvCache> cache,
                          model::SequenceKvCache::Create(cache_options, config_.num_layers,
                                                         config_.num_kv_heads, config_.head_dim));
  for (uint32_t l = 0; l < config_.num_layers; ++l) {
    layer_names_.push_back(cache->NameOf(l, BlockHash{}));
  }
  STRATA_ASSIGN_OR_RETURN(PrefixHasher hasher, PrefixHasher::Create(format_.KeysFor("")));
  hasher_ = std::make_unique<PrefixHasher>(std::move(hasher));
  STRATA_ASSIGN_OR_RETURN(index_, PrefixIndex::Create(options_.index));
  STRATA_ASSIGN_OR_RETURN(policy_, RoutingPolicy::Create(options_.routing));
  created_ = absl::ToUnixSeconds(absl::Now());

  prometheus::Registry& reg = *registry_;
  requests_total_ = &prometheus::BuildCounter()
                         .Name("strata_router_requests_total")
                         .Help("Requests by outcome: ok, cancelled, or the error code")
                         .Register(reg);
  routed_total_ = &prometheus::BuildCounter()
                       .Name("strata_router_routed_total")
                       .Help("Requests routed, by prefill and decode node")
                       .Register(reg);
  ttft_ = &serving::AddHistogram(&reg, "strata_router_ttft_seconds",
                                 "Time from a request's arrival to its first token",
                                 serving::LatencyBuckets());
  inter_token_ = &serving::AddHistogram(&reg, "strata_router_inter_token_seconds",
                                        "Time between consecutive tokens of a request",
                                        serving::LatencyBuckets());
  token_relay_ = &serving::AddHistogram(
      &reg, "strata_router_token_relay_seconds",
      "Per streamed token, from its arrival from the decode node to the end of the socket write to "
      "the client: the router's added latency",
      prometheus::Histogram::BucketBoundaries{25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3,
                                              5e-3, 10e-3, 50e-3, 0.25, 1});
  prompt_tokens_ = &serving::AddCounter(&reg, "strata_router_prompt_tokens_total",
                                        "Prompt tokens of routed requests");
  cached_tokens_ =
      &serving::AddCounter(&reg, "strata_router_cached_tokens_total",
                           "Prompt tokens served from cache, as the decode nodes report");
  completion_tokens_ = &serving::AddCounter(&reg, "strata_router_completion_tokens_total",
                                            "Tokens streamed to clients");
  in_flight_gauge_ = &serving::AddGauge(&reg, "strata_router_in_flight", "Requests in flight");
  handoffs_ =
      &serving::AddCounter(&reg, "strata_router_handoffs_total",
                           "Requests continued on another decode node after theirs was drained");
  retries_ = &serving::AddCounter(
      &reg, "strata_router_retries_total",
      "Requests routed again, once, after their prefill or decode node was lost before the first "
      "token");
  retries_throttled_ = &serving::AddCounter(
      &reg, "strata_router_retries_throttled_total",
      "Requests whose node was lost and that the retry budget did not send again (failed instead)");
  rejected_total_ = &prometheus::BuildCounter()
                         .Name("strata_router_rejected_total")
                         .Help(
                             "Requests refused with 429 before any KV moved, by reason: "
                             "router_in_flight, prefill_queue, decode_queue, node")
                         .Register(reg);
  store_connected_ = &serving::AddGauge(&reg, "strata_router_store_connected",
                                        "1 while every store's block events stream in");
  if (options_.shared_tier.has_value()) {
    shared_probes_ =
        &serving::AddCounter(&reg, "strata_router_shared_tier_probes_total",
                             "Prompts whose chunks past the store's were asked of the shared tier");
    shared_chunks_ =
        &serving::AddCounter(&reg, "strata_router_shared_tier_chunks_total",
                             "Chunks the shared tier held past the store's, as routing found them");
    shared_errors_ = &serving::AddCounter(
        &reg, "strata_router_shared_tier_errors_total",
        "Shared tier probes that the tier did not answer in full (routed without it)");
    shared_probe_seconds_ = &serving::AddHistogram(
        &reg, "strata_router_shared_tier_probe_seconds",
        "Time to ask the shared tier for a prompt's chunks", serving::LatencyBuckets());
  }

  std::shared_ptr<const membership::Membership> membership =
      options_.membership != nullptr ? options_.membership
                                     : std::make_shared<membership::StaticMembership>(spec);
  NodePoolOptions po;
  po.load_timeout = options_.load_timeout;
  po.model_name = served.name;  // nodes report the folder's name, whatever clients call it
  po.format = format_;
  po.prefill_reads_store = !spec.store.empty();
  po.cluster_store = spec.store;
  po.security = options_.security;
  STRATA_RETURN_IF_ERROR(po.Validate());
  pool_ = std::make_unique<NodePool>(po, std::move(membership), registry_.get());
  if (!spec.store.empty()) {
    StoreLink& link = stores_[spec.store];
    link.feed = std::make_unique<StoreFeed>(index_.get(), StoreHolderId(spec.store, spec.store),
                                            layer_names_);
    STRATA_RETURN_IF_ERROR(link.feed->status());
    store_feed_ = link.feed.get();
  }
  serving::Log("", absl::StrCat("serving ", model_name_, " (context ", context_tokens_,
                                " tokens, codec ", format_.codec, ", chunk ", format_.chunk_tokens,
                                " tokens) through ", pool_->Status().size(), " nodes",
                                spec.store.empty() ? "" : ", store " + spec.store));
  return absl::OkStatus();
}

ClusterBackend::~ClusterBackend() {
  {
    std::lock_guard<std::mutex> lock(poll_mu_);
    stop_ = true;
  }
  poll_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
  if (shared_connector_.joinable()) shared_connector_.join();
  stores_.clear();
  node_feeds_.clear();
  // Cancel what is left (the HTTP server was stopped first, so nothing new arrives) without
  // holding calls_mu_: a cancellation may run the calls' callbacks on this thread.
  std::vector<std::shared_ptr<Request>> live;
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    for (const auto& [ptr, weak] : live_) {
      if (std::shared_ptr<Request> r = weak.lock()) live.push_back(std::move(r));
    }
  }
  for (const std::shared_ptr<Request>& r : live) {
    {
      std::lock_guard<std::mutex> cell_lock(r->cell->mu);  // no retry or hand-off starts now
      r->cell->cancelled = true;
    }
    r->cancelled.store(true);
    r->generate_ctx->TryCancel();
    r->prefill_ctx->TryCancel();
  }
  live.clear();
  std::unique_lock<std::mutex> lock(calls_mu_);
  calls_cv_.wait(lock, [this] { return live_.empty(); });
  retired_.clear();
}

void ClusterBackend::PollLoop() {
  std::unique_lock<std::mutex> lock(poll_mu_);
  while (!stop_) {
    lock.unlock();
    pool_->PollOnce();
    MaybeConnectStores();
    MaybeWatchNodeTiers();
    std::vector<std::shared_ptr<const NodeConnection>> retired;
    {
      std::lock_guard<std::mutex> calls_lock(calls_mu_);
      retired.swap(retired_);
    }
    retired.clear();
    index_->Sweep(absl::Now());
    lock.lock();
    poll_cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.load_poll_interval),
                      [this] { return stop_; });
  }
}

void ClusterBackend::MaybeConnectStores() {
  for (const NodeStatus& s : pool_->Status()) {
    if (s.spec.store.empty() || stores_.contains(s.spec.store)) continue;
    StoreLink& link = stores_[s.spec.store];
    link.feed = std::make_unique<StoreFeed>(
        index_.get(), StoreHolderId(s.spec.store, options_.spec.store), layer_names_);
    if (!link.feed->status().ok()) {
      serving::Log("", absl::StrCat("store ", s.spec.store, ": ", link.feed->status().ToString()));
    }
    serving::Log("", absl::StrCat("node ", s.spec.id, " uses the store ", s.spec.store,
                                  " (its host's); watching its blocks too"));
  }
  // Stores registered in etcd on their own, before (or without) a node naming them.
  if (options_.membership != nullptr) {
    for (const membership::StoreSpec& s : options_.membership->Stores()) {
      if (stores_.contains(s.grpc)) continue;
      StoreLink& link = stores_[s.grpc];
      link.feed = std::make_unique<StoreFeed>(
          index_.get(), StoreHolderId(s.grpc, options_.spec.store), layer_names_);
      if (!link.feed->status().ok()) {
        serving::Log("", absl::StrCat("store ", s.grpc, ": ", link.feed->status().ToString()));
      }
      serving::Log("", absl::StrCat("store ", s.id, " at ", s.grpc,
                                    " registered in etcd; watching its blocks"));
    }
  }
  bool all_connected = !stores_.empty();
  for (auto& [address, link] : stores_) {
    MaybeConnectStore(address, link);
    all_connected = all_connected && link.feed->connected();
  }
  store_connected_->Set(all_connected ? 1 : 0);
}

void ClusterBackend::MaybeConnectStore(const std::string& address, StoreLink& link) {
  if (!link.feed->status().ok()) return;  // logged when the feed was made
  auto watch = [&link] {
    StoreFeed* feed = link.feed.get();
    link.watch =
        link.client->Watch(0, [feed](const kvstore::WatchUpdate& u) { feed->OnUpdate(u); });
  };
  if (link.watch != nullptr && link.feed->resync_needed()) {
    link.watch.reset();  // joins the watch thread: no update is delivered meanwhile
    link.feed->ClearResync();
    watch();
  }
  if (link.client != nullptr || absl::Now() < link.next_attempt) return;
  absl::StatusOr<std::unique_ptr<kvstore::StoreClient>> c = kvstore::StoreClient::Connect(
      address, options_.store_connect_timeout, {.security = options_.security});
  if (!c.ok()) {
    link.next_attempt = absl::Now() + options_.store_retry_interval;
    if (!link.down_logged) {
      link.down_logged = true;
      serving::Log("", absl::StrCat(c.status().message(), "; retrying every ",
                                    absl::FormatDuration(options_.store_retry_interval),
                                    " (routing ignores the store meanwhile)"));
    }
    return;
  }
  link.client = *std::move(c);
  serving::Log("", absl::StrCat("store ", address, " connected; watching its blocks"));
  watch();
}

void ClusterBackend::ConnectSharedTierLoop() {
  kvstore::SharedTierOptions o = *options_.shared_tier;
  const absl::Duration wait = options_.shared_tier_probe_timeout;
  o.timeout = std::min(o.timeout, wait);
  o.redis.io_timeout = std::min(o.redis.io_timeout, wait);
  o.redis.connect_timeout = std::min(o.redis.connect_timeout, wait);
  bool logged = false;
  std::unique_lock<std::mutex> lock(poll_mu_);
  while (!stop_) {
    lock.unlock();
    absl::StatusOr<std::unique_ptr<kvstore::SharedTier>> tier = kvstore::SharedTier::Connect(o);
    if (tier.ok()) {
      auto probe = std::make_shared<SharedTierProbe>(*std::move(tier), layer_names_,
                                                     options_.shared_tier_probe_chunks);
      {
        std::lock_guard<std::mutex> shared_lock(shared_mu_);
        shared_probe_ = std::move(probe);
      }
      serving::Log("", "shared tier connected; routing counts the chunks it holds");
      return;
    }
    if (!logged) {
      logged = true;
      serving::Log("", absl::StrCat("shared tier: ", tier.status().message(), "; retrying every ",
                                    absl::FormatDuration(options_.store_retry_interval),
                                    " (routing counts the stores only meanwhile)"));
    }
    lock.lock();
    poll_cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.store_retry_interval),
                      [this] { return stop_; });
  }
}

std::shared_ptr<SharedTierProbe> ClusterBackend::shared_probe() const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  return shared_probe_;
}

bool ClusterBackend::shared_tier_connected() const { return shared_probe() != nullptr; }

OverlapResult ClusterBackend::CachedOverlap(absl::Span<const BlockHash> chain,
                                            absl::Time now) const {
  OverlapResult overlap = index_->Overlap(chain, now);
  const std::shared_ptr<SharedTierProbe> probe = shared_probe();
  if (probe == nullptr) return overlap;
  // Redis is asked from the first chunk (up to shared_tier_probe_chunks): what the stores hold
  // says nothing certain of the tier (a store that met the tier late never wrote its older
  // blocks through; Redis evicts on its own). A store promotes at most that many chunks past its
  // own per Lookup, so no node is credited with more from the tier than it can read.
  uint32_t held = 0;
  // After a probe the tier did not answer, requests are routed without asking it for
  // store_retry_interval: an outage must not add the probe's timeout to every request.
  if (!chain.empty() && absl::FromUnixNanos(shared_quiet_until_ns_.load()) <= now) {
    SharedTierProbeStats call;
    held = probe->LeadingChunks(chain, 0, &call);
    shared_probes_->Increment();
    shared_chunks_->Increment(static_cast<double>(call.chunks_found));
    shared_errors_->Increment(static_cast<double>(call.errors));
    shared_probe_seconds_->Observe(call.seconds);
    if (call.errors > 0) {
      shared_quiet_until_ns_.store(absl::ToUnixNanos(absl::Now() + options_.store_retry_interval));
    }
  }
  if (held > 0) {
    HolderOverlap& h = overlap.holders.emplace_back();
    h.holder_id = kSharedTierHolder;
    h.kind = HolderKind::kStore;
    h.chunks = held;
    // Behind the network: filed as the slowest tier (routing credits store chunks alike).
    h.tier_chunks[static_cast<size_t>(HolderTier::kDisk)] = held;
  }
  return overlap;
}

void ClusterBackend::MaybeWatchNodeTiers() {
  for (const NodeStatus& s : pool_->Status()) {
    if (s.spec.role != membership::Role::kPrefill || !s.healthy ||
        s.report.local_tier_bytes() == 0) {
      continue;
    }
    NodeFeed& f = node_feeds_[s.spec.id];
    if (f.feed == nullptr) {
      f.feed =
          std::make_unique<StoreFeed>(index_.get(), s.spec.id, layer_names_, HolderKind::kNode);
      if (!f.feed->status().ok()) {
        serving::Log("",
                     absl::StrCat("prefill node ", s.spec.id, ": ", f.feed->status().ToString()));
      }
    }
    if (f.client == nullptr) {
      absl::StatusOr<std::unique_ptr<kvstore::StoreClient>> c = kvstore::StoreClient::Connect(
          s.spec.grpc, options_.store_connect_timeout, {.security = options_.security});
      if (!c.ok()) continue;  // the next poll tries again
      f.client = *std::move(c);
      StoreFeed* feed = f.feed.get();
      f.watch = f.client->Watch(0, [feed](const kvstore::WatchUpdate& u) { feed->OnUpdate(u); });
      serving::Log("",
                   absl::StrCat("prefill node ", s.spec.id, " has its own tier of ",
                                s.report.local_tier_bytes() >> 20, " MiB; watching its blocks"));
    } else if (f.feed->resync_needed()) {
      f.watch.reset();
      f.feed->ClearResync();
      StoreFeed* feed = f.feed.get();
      f.watch = f.client->Watch(0, [feed](const kvstore::WatchUpdate& u) { feed->OnUpdate(u); });
    }
  }
}

std::vector<ModelCard> ClusterBackend::Models() const {
  ModelCard card;
  card.id = model_name_;
  card.created = created_;
  card.max_model_len = context_tokens_;
  return {card};
}

std::string ClusterBackend::ChatTemplateText(const std::string& model) const {
  return model == model_name_ ? chat_template_ : "";
}

absl::StatusOr<std::vector<BlockHash>> ClusterBackend::ChunkKeys(
    const std::vector<uint32_t>& tokens, const std::string& cache_salt) const {
  if (cache_salt.empty()) return hasher_->ChunkKeys(tokens);
  PrefixKeyOptions k = hasher_->options();
  k.cache_salt = cache_salt;
  absl::StatusOr<PrefixHasher> h = PrefixHasher::Create(k);
  if (!h.ok()) return FieldError("cache_salt", h.status().message());
  return h->ChunkKeys(tokens);
}

absl::StatusOr<std::vector<uint32_t>> ClusterBackend::Tokenize(
    const CompletionRequest& request) const {
  const char* field = request.chat ? "messages" : "prompt";
  std::vector<uint32_t> tokens;
  if (!request.chat && request.prompt_text.empty() && !request.prompt_tokens.empty()) {
    tokens = request.prompt_tokens;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] >= config_.vocab_size) {
        return FieldError("prompt", absl::StrCat("prompt[", i, "] = ", tokens[i],
                                                 " is not a token of this model (vocabulary "
                                                 "size ",
                                                 config_.vocab_size, ")"));
      }
    }
  } else {
    // Chat: the rendered prompt carries the template's BOS text already (parsed as a special
    // token here). Completions: as vLLM with add_special_tokens, the model's BOS goes first.
    tokens = tokenizer_->Encode(request.prompt_text, /*parse_special=*/true);
    const int64_t bos = config_.bos_token_id;
    if (!request.chat && bos >= 0 && (tokens.empty() || tokens[0] != static_cast<uint32_t>(bos))) {
      tokens.insert(tokens.begin(), static_cast<uint32_t>(bos));
    }
  }
  if (tokens.empty()) return FieldError(field, absl::StrCat(field, " has no tokens"));
  return tokens;
}

absl::Status ClusterBackend::CheckContext(const CompletionRequest& request, size_t prompt_tokens,
                                          uint32_t* max_tokens) const {
  const char* field = request.chat ? "messages" : "prompt";
  const uint64_t context = context_tokens_;
  if (prompt_tokens >= context) {
    return FieldError(field, absl::StrCat("This model's maximum context length is ", context,
                                          " tokens. However, your ", field, " has ", prompt_tokens,
                                          " tokens, which leaves none for the "
                                          "completion. Please reduce the length of the ",
                                          field, "."));
  }
  if (*max_tokens == 0) {  // unset (chat): the rest of the context
    *max_tokens = static_cast<uint32_t>(context - prompt_tokens);
    return absl::OkStatus();
  }
  if (prompt_tokens + *max_tokens > context) {
    return FieldError("max_tokens",
                      absl::StrCat("This model's maximum context length is ", context,
                                   " tokens. However, you requested ", prompt_tokens + *max_tokens,
                                   " tokens (", prompt_tokens, " in the ", field, ", ", *max_tokens,
                                   " in the completion). Please reduce the length of the ", field,
                                   " or completion."));
  }
  return absl::OkStatus();
}

absl::Status ClusterBackend::Refusal(const absl::Status& route_error,
                                     absl::Span<const NodeLoad> nodes, uint64_t prompt_tokens) {
  if (!absl::IsResourceExhausted(route_error)) return route_error;
  const bool prefill = absl::StartsWith(route_error.message(), kNoPrefillRoom);
  rejected_total_->Add({{"reason", prefill ? "prefill_queue" : "decode_queue"}}).Increment();
  // When the quickest prefill queue has drained enough for this prompt, at its measured rate. A
  // decode node's room comes as sequences finish: a second is a fair guess.
  double seconds = 1;
  if (prefill) {
    double best = -1;
    for (const NodeLoad& n : nodes) {
      if (n.role != NodeRole::kPrefill || !n.healthy || n.prefill_tokens_per_second <= 0 ||
          n.max_queued_prefill_tokens == 0) {
        continue;
      }
      const double excess = static_cast<double>(n.queued_prefill_tokens + prompt_tokens) -
                            static_cast<double>(n.max_queued_prefill_tokens);
      const double wait = std::max(0.0, excess) / n.prefill_tokens_per_second;
      if (best < 0 || wait < best) best = wait;
    }
    if (best > 0) seconds = best;
  }
  return WithRetryAfter(
      absl::ResourceExhaustedError(absl::StrCat(route_error.message(), "; retry later")),
      static_cast<int>(std::clamp(std::ceil(seconds), 1.0, 60.0)));
}

void ClusterBackend::CountOutcome(const absl::Status& status) {
  requests_total_->Add({{"status", OutcomeLabel(status)}}).Increment();
}

absl::StatusOr<std::unique_ptr<RequestHandle>> ClusterBackend::Start(
    CompletionRequest request, std::shared_ptr<CompletionStream> stream) {
  const absl::Time now = absl::Now();
  auto refuse = [&](absl::Status s) {
    CountOutcome(s);
    serving::Log(request.request_id, absl::StrCat("refused: ", s.ToString()));
    return s;
  };
  if (request.model != model_name_) {
    return refuse(absl::NotFoundError(absl::StrCat("The model '", request.model,
                                                   "' does not exist (this router serves '",
                                                   model_name_, "')")));
  }
  absl::StatusOr<std::vector<uint32_t>> tokens = Tokenize(request);
  if (!tokens.ok()) return refuse(tokens.status());
  uint32_t max_tokens = request.sampling.max_tokens;
  if (absl::Status s = CheckContext(request, tokens->size(), &max_tokens); !s.ok()) {
    return refuse(s);
  }
  absl::StatusOr<std::vector<BlockHash>> chain = ChunkKeys(*tokens, request.cache_salt);
  if (!chain.ok()) return refuse(chain.status());

  // Admission: a slot in flight, or 429.
  size_t n = in_flight_.load();
  do {
    if (n >= options_.max_in_flight) {
      rejected_total_->Add({{"reason", "router_in_flight"}}).Increment();
      return refuse(WithRetryAfter(
          absl::ResourceExhaustedError(absl::StrCat(
              "the router has ", n, " requests in flight, its limit (max_in_flight); retry later")),
          1));
    }
  } while (!in_flight_.compare_exchange_weak(n, n + 1));
  auto release = [&](absl::Status s) {
    in_flight_.fetch_sub(1);
    return refuse(std::move(s));
  };

  if (!request.sampling.seed.has_value()) {
    // The prefill node samples the first token and the decode node the rest: one seed for both
    // (and for a retry).
    std::lock_guard<std::mutex> lock(seed_mu_);
    request.sampling.seed = seed_rng_();
  }
  const uint32_t choices = std::max<uint32_t>(1, request.n);
  std::vector<std::shared_ptr<HandleCell>> cells;
  for (uint32_t i = 0; i < choices; ++i) cells.push_back(std::make_shared<HandleCell>());
  std::shared_ptr<ChoiceSet> later;
  std::shared_ptr<CompletionStream> first_stream = stream;
  if (choices > 1) {
    // Choice 0 computes the prompt; the others start once its prefill is done and adopt its
    // blocks from the store (a prefix hit), each with a seed of its own.
    later = std::make_shared<ChoiceSet>();
    first_stream = stream->Choice(0);
    for (uint32_t i = 1; i < choices; ++i) {
      std::shared_ptr<CompletionStream> s = stream->Choice(i);
      if (first_stream == nullptr || s == nullptr) {
        return release(FieldError("n", "n > 1 is not supported by this front end"));
      }
      CompletionRequest c = request;
      c.request_id = absl::StrCat(request.request_id, "-c", i);
      c.sampling.seed = *request.sampling.seed + i;
      later->requests.push_back(std::move(c));
      later->streams.push_back(std::move(s));
      later->cells.push_back(cells[i]);
    }
    later->tokens = *tokens;
    later->chain = *chain;
    later->max_tokens = max_tokens;
  }
  const uint32_t prompt_tokens = static_cast<uint32_t>(tokens->size());
  if (absl::Status s = StartChoice(std::move(request), std::move(first_stream), *std::move(tokens),
                                   *std::move(chain), max_tokens, cells[0], std::move(later), now);
      !s.ok()) {
    return release(s);
  }
  prompt_tokens_->Increment(static_cast<double>(prompt_tokens));
  retry_budget_.Deposit(now);
  return std::make_unique<Handle>(std::move(cells));
}

absl::Status ClusterBackend::StartChoice(CompletionRequest request,
                                         std::shared_ptr<CompletionStream> stream,
                                         std::vector<uint32_t> tokens, std::vector<BlockHash> chain,
                                         uint32_t max_tokens, std::shared_ptr<HandleCell> cell,
                                         std::shared_ptr<ChoiceSet> later, absl::Time now) {
  auto r = std::make_shared<Request>(this);
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    live_[r.get()] = r;
  }
  r->id = request.request_id;
  r->stream = std::move(stream);
  r->arrival = request.arrival == absl::Time() ? now : request.arrival;
  r->deadline = r->arrival + (request.timeout > absl::ZeroDuration()
                                  ? std::min(request.timeout, options_.generate_timeout)
                                  : options_.generate_timeout);
  r->prompt_tokens = static_cast<uint32_t>(tokens.size());
  r->client_prompt_tokens = r->prompt_tokens;
  r->client_max_tokens = max_tokens;
  r->chain = std::move(chain);
  r->max_tokens = max_tokens;
  r->request = std::move(request);
  r->request.prompt_tokens = std::move(tokens);
  r->later = std::move(later);
  r->cell = std::move(cell);
  {
    std::lock_guard<std::mutex> lock(r->cell->mu);
    r->cell->current = r;
  }
  in_flight_gauge_->Increment();
  if (absl::Status s = Launch(r, ""); !s.ok()) {
    r->ended.store(true);
    in_flight_gauge_->Decrement();
    return s;
  }
  return absl::OkStatus();
}

void ClusterBackend::StartLater(const std::shared_ptr<ChoiceSet>& later) {
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < later->requests.size(); ++i) {
    {
      std::lock_guard<std::mutex> lock(later->cells[i]->mu);
      if (later->cells[i]->cancelled) continue;  // the request is over: nothing to start
    }
    in_flight_.fetch_add(1);  // admitted with the request: no limit checked again
    absl::Status s = StartChoice(later->requests[i], later->streams[i], later->tokens, later->chain,
                                 later->max_tokens, later->cells[i], nullptr, now);
    if (!s.ok()) {
      in_flight_.fetch_sub(1);
      CountOutcome(s);
      serving::Log(later->requests[i].request_id,
                   absl::StrCat("choice failed to start: ", s.ToString()));
      later->streams[i]->Fail(s);  // fails the whole request; its handle cancels the others
    }
  }
}

absl::Status ClusterBackend::Launch(const std::shared_ptr<Request>& r, const std::string& avoid) {
  const absl::Time now = absl::Now();
  const OverlapResult overlap = CachedOverlap(r->chain, now);
  std::vector<NodeLoad> nodes = pool_->Loads();
  tracker_.Overlay(absl::MakeSpan(nodes));
  for (NodeLoad& n : nodes) {
    if (n.id == avoid) n.healthy = false;
  }
  RouteRequest route;
  route.prompt_tokens = r->prompt_tokens;
  route.chunk_tokens = format_.chunk_tokens;
  route.decode_kv_bytes = static_cast<uint64_t>(std::ceil(
      static_cast<double>(r->prompt_tokens + r->max_tokens) * pool_->DecodeKvBytesPerToken()));
  absl::StatusOr<RouteDecision> routed = policy_->Route(route, overlap, nodes);
  if (!routed.ok()) return Refusal(routed.status(), nodes, r->prompt_tokens);
  RouteDecision d = *std::move(routed);
  std::shared_ptr<const NodeConnection> prefill = pool_->Connection(d.prefill_id);
  std::shared_ptr<const NodeConnection> decode = pool_->Connection(d.decode_id);
  if (prefill == nullptr || prefill->prefill == nullptr || decode == nullptr ||
      decode->decode == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("nodes ", d.prefill_id, " / ", d.decode_id, " left the cluster"));
  }
  STRATA_RETURN_IF_ERROR(tracker_.Add(r->id, d, now));
  r->prefill_node = std::move(prefill);
  r->decode_node = std::move(decode);
  r->routed_at = now;
  const CompletionRequest& request = r->request;
  strata::v1::GenerateRequest& g = r->generate_req;
  // The nodes see a retry under an id of its own: the first attempt may still be ending there.
  g.set_request_id(r->node_request_id.empty() ? r->id : r->node_request_id);
  g.mutable_prompt()->Assign(request.prompt_tokens.begin(), request.prompt_tokens.end());
  g.set_cache_salt(request.cache_salt);
  strata::v1::Sampling* sampling = g.mutable_sampling();
  sampling->set_temperature(request.sampling.temperature);
  sampling->set_top_k(request.sampling.top_k);
  sampling->set_top_p(request.sampling.top_p);
  sampling->set_seed(request.sampling.seed.value_or(0));
  sampling->set_min_p(request.sampling.min_p);
  sampling->set_presence_penalty(request.sampling.presence_penalty);
  sampling->set_frequency_penalty(request.sampling.frequency_penalty);
  sampling->set_repetition_penalty(request.sampling.repetition_penalty);
  g.set_max_tokens(r->max_tokens);
  g.set_ignore_eos(request.sampling.ignore_eos);
  g.set_logprobs(request.logprobs);
  g.set_top_logprobs(request.top_logprobs);
  for (const std::string& stop : request.sampling.stop) g.add_stop(stop);
  r->generate_ctx->set_deadline(absl::ToChronoTime(r->deadline));

  routed_total_->Add({{"prefill", d.prefill_id}, {"decode", d.decode_id}}).Increment();
  serving::Log(
      r->id,
      absl::StrCat(
          r->node_request_id.empty() ? "routed " : absl::StrCat(r->node_request_id, ": routed "),
          r->prompt_tokens, " prompt tokens (max_tokens ", r->max_tokens, "): ", d.Explain()));
  (new GenerateReactor(r))->Begin();  // the reactor holds the request now
  return absl::OkStatus();
}

bool ClusterBackend::MaybeRetry(const std::shared_ptr<Request>& r, const absl::Status& error,
                                const std::string& lost) {
  // Only a lost node is retried: overload (RESOURCE_EXHAUSTED) and deadlines are not, and a
  // retry must leave time to be served.
  if (r->attempt > 0 || r->cancelled.load() || error.code() != absl::StatusCode::kUnavailable ||
      absl::Now() >= r->deadline) {
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load() || r->completion_tokens > r->tokens_at_start) return false;
  }
  if (!retry_budget_.TryWithdraw(absl::Now())) {
    retries_throttled_->Increment();
    serving::Log(r->id, absl::StrCat("lost ", lost, " before the first token (", error.ToString(),
                                     "): not retried, the retry budget is spent"));
    return false;
  }
  std::shared_ptr<CompletionStream> stream;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    // Not once this attempt streamed a token (a continuation's earlier tokens do not count).
    if (r->ended.load() || r->completion_tokens > r->tokens_at_start) return false;
    r->ended.store(true);
    stream = std::move(r->stream);
  }
  retries_->Increment();
  serving::Log(r->id, absl::StrCat("lost ", lost, " before the first token (", error.ToString(),
                                   "): retrying once on other nodes"));
  auto next = NextAttempt(r, std::move(stream));
  next->attempt = r->attempt + 1;
  next->node_request_id = absl::StrCat(r->id, "-retry", next->attempt);
  StartNext(r, next, lost, error, "the retry on other nodes failed");
  return true;
}

void ClusterBackend::OnHandedOff(const std::shared_ptr<Request>& r,
                                 const strata::v1::HandedOff& handed_off) {
  std::shared_ptr<CompletionStream> stream;
  std::vector<uint32_t> generated;
  uint32_t completion = 0;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load()) return;
    if (!handed_off.text().empty() && !r->generated.empty() && !r->cancelled.load()) {
      r->stream->Token(handed_off.text(), r->generated.back());
    }
    r->ended.store(true);
    stream = std::move(r->stream);
    generated = r->generated;
    completion = r->completion_tokens;
  }
  handoffs_->Increment();
  const std::string& from = r->decode_node->spec.id;
  const uint32_t left = r->client_max_tokens > static_cast<uint32_t>(generated.size())
                            ? r->client_max_tokens - static_cast<uint32_t>(generated.size())
                            : 0;
  if (generated.empty() && !r->cancelled.load()) {  // nothing to continue from: routed again
    auto next = NextAttempt(r, std::move(stream));
    next->hop = r->hop + 1;
    next->node_request_id = absl::StrCat(r->id, "-resume", next->hop);
    StartNext(r, next, from,
              absl::UnavailableError(absl::StrCat(from, " is draining and handed the request off")),
              "it could not start on another node");
    return;
  }
  if (left == 0 || r->cancelled.load()) {
    // Nothing to continue (or nobody to continue for): the request ends here.
    r->generate_ctx->TryCancel();
    r->prefill_ctx->TryCancel();
    tracker_.Complete(r->id);
    in_flight_.fetch_sub(1);
    in_flight_gauge_->Decrement();
    const absl::Status outcome =
        r->cancelled.load() ? absl::CancelledError("cancelled by the client") : absl::OkStatus();
    if (outcome.ok()) {
      stream->Finish(FinishReason::kLength, Usage{.prompt_tokens = r->client_prompt_tokens,
                                                  .completion_tokens = completion});
    }
    CountOutcome(outcome);
    serving::Log(r->id, absl::StrCat(from, " handed the request off with nothing left to do"));
    return;
  }
  serving::Log(r->id, absl::StrCat(from, " is draining and handed the request off after ",
                                   generated.size(), " tokens: continuing on another node"));
  auto next = NextAttempt(r, std::move(stream));
  next->hop = r->hop + 1;  // a hand-off is no failure: the retry stays available
  next->node_request_id = absl::StrCat(r->id, "-resume", next->hop);
  // The client's prompt, then every token streamed so far (however many hops they took).
  next->request.prompt_tokens.resize(r->client_prompt_tokens);
  next->request.prompt_tokens.insert(next->request.prompt_tokens.end(), generated.begin(),
                                     generated.end());
  next->prompt_tokens = static_cast<uint32_t>(next->request.prompt_tokens.size());
  next->max_tokens = left;
  next->continued = true;
  // For routing by overlap only (the prefill node keys the prompt itself).
  absl::StatusOr<std::vector<BlockHash>> chain =
      ChunkKeys(next->request.prompt_tokens, next->request.cache_salt);
  next->chain = chain.ok() ? *std::move(chain) : std::vector<BlockHash>{};
  StartNext(r, next, from,
            absl::UnavailableError(absl::StrCat(from, " is draining and handed the request off")),
            "it could not continue on another node");
}

std::shared_ptr<ClusterBackend::Request> ClusterBackend::NextAttempt(
    const std::shared_ptr<Request>& r, std::shared_ptr<CompletionStream> stream) {
  auto next = std::make_shared<Request>(this);
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    live_[next.get()] = next;
  }
  next->id = r->id;
  next->cell = r->cell;
  next->request = r->request;
  next->chain = r->chain;
  next->max_tokens = r->max_tokens;
  next->attempt = r->attempt;
  next->hop = r->hop;
  next->arrival = r->arrival;
  next->deadline = r->deadline;
  next->later = std::move(r->later);  // choices not yet started wait for this attempt's prefill
  next->prompt_tokens = r->prompt_tokens;
  next->client_prompt_tokens = r->client_prompt_tokens;
  next->client_max_tokens = r->client_max_tokens;
  next->continued = r->continued;
  {
    std::lock_guard<std::mutex> lock(r->mu);  // `r` has ended: nothing changes these any more
    next->generated = r->generated;
    next->completion_tokens = r->completion_tokens;
    next->tokens_at_start = r->completion_tokens;
    next->first_token_at = r->first_token_at;
    next->last_token_at = r->last_token_at;
  }
  next->stream = std::move(stream);
  return next;
}

void ClusterBackend::StartNext(const std::shared_ptr<Request>& r,
                               const std::shared_ptr<Request>& next, const std::string& avoid,
                               const absl::Status& error, const std::string& failed_how) {
  // The first attempt is over on both nodes (the decode node frees its sequence).
  r->generate_ctx->TryCancel();
  r->prefill_ctx->TryCancel();
  tracker_.Complete(r->id);
  bool cancelled = false;
  {
    std::lock_guard<std::mutex> lock(next->cell->mu);
    cancelled = next->cell->cancelled;
    if (!cancelled) next->cell->current = next;
  }
  absl::Status launched =
      cancelled ? absl::CancelledError("cancelled by the client") : Launch(next, avoid);
  if (launched.ok()) return;
  next->ended.store(true);
  const absl::Status outcome =
      cancelled ? launched
                : absl::Status(error.code(), absl::StrCat(error.message(), "; ", failed_how, ": ",
                                                          launched.message()));
  if (!cancelled) next->stream->Fail(outcome);
  next->stream.reset();
  in_flight_.fetch_sub(1);
  in_flight_gauge_->Decrement();
  CountOutcome(outcome);
  serving::Log(r->id, absl::StrCat("failed: ", outcome.ToString()));
}

void ClusterBackend::OnRegistered(const std::shared_ptr<Request>& r,
                                  const strata::v1::Registered& registered) {
  bool duplicate = false;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load() || r->cancelled.load()) return;  // the Generate call ends the request
    if (r->registered) {
      duplicate = true;
    } else {
      r->registered = true;
      r->prefill_started = true;
    }
  }
  if (duplicate) {
    End(r, absl::InternalError(
               absl::StrCat(r->decode_node->description, ": a second `registered` message")));
    return;
  }
  strata::v1::PrefillRequest& p = r->prefill_req;
  p.set_request_id(r->generate_req.request_id());
  *p.mutable_tokens() = r->generate_req.prompt();
  p.set_cache_salt(r->generate_req.cache_salt());
  p.set_decode_address(registered.transport_address());
  *p.mutable_sampling() = r->generate_req.sampling();
  p.set_logprobs(r->request.logprobs);
  p.set_top_logprobs(r->request.top_logprobs);
  // The prompt's logprobs, for an echo that has not been sent (a continuation sends none).
  p.set_prompt_logprobs(r->request.echo && r->request.logprobs && !r->continued);
  r->prefill_ctx->set_deadline(
      absl::ToChronoTime(std::min(r->deadline, absl::Now() + options_.prefill_timeout)));
  r->prefill_node->prefill->async()->Prefill(
      r->prefill_ctx.get(), &r->prefill_req, &r->prefill_resp,
      [this, r](grpc::Status status) { OnPrefillDone(r, status); });
}

void ClusterBackend::OnToken(const std::shared_ptr<Request>& r,
                             const strata::v1::TokenEvent& token) {
  const absl::Time now = absl::Now();
  bool registered = false, first = false, attempts_first = false;
  absl::Duration gap;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load()) return;
    registered = r->registered;
    if (registered) {
      first = r->completion_tokens == 0;
      attempts_first = r->completion_tokens == r->tokens_at_start;
      gap = now - r->last_token_at;
      ++r->completion_tokens;
      r->generated.push_back(token.token());
      if (first) r->first_token_at = now;
      r->last_token_at = now;
      const bool needs_prefill = r->request.logprobs || (r->request.echo && !r->continued);
      if (!r->held.empty() || (attempts_first && needs_prefill && !r->prefill_done)) {
        r->held.push_back(token);  // sent with the prefill node's answer (OnPrefillDone)
      } else if (!r->cancelled.load()) {
        DeliverLocked(*r, token,
                      attempts_first ? r->prefill_resp.first_token_logprobs() : token.logprobs());
      }
    }
  }
  if (!registered) {
    End(r, absl::InternalError(
               absl::StrCat(r->decode_node->description, ": a token before `registered`")));
    return;
  }
  completion_tokens_->Increment();
  if (attempts_first) tracker_.MarkPrefillDone(r->id);
  if (first) {
    ttft_->Observe(absl::ToDoubleSeconds(now - r->arrival));
  } else {
    inter_token_->Observe(absl::ToDoubleSeconds(gap));
  }
}

std::string ClusterBackend::TokenBytes(uint32_t token) const {
  absl::StatusOr<std::string> text = tokenizer_->Decode({token});
  return text.ok() ? *std::move(text) : std::string();
}

TokenLogprobs ClusterBackend::LogprobsOf(uint32_t token,
                                         const strata::v1::TokenLogprobs& lp) const {
  TokenLogprobs out;
  out.chosen = {TokenBytes(token), lp.logprob()};
  out.top.reserve(lp.top_size());
  for (const strata::v1::TopLogprob& t : lp.top())
    out.top.push_back({TokenBytes(t.token()), t.logprob()});
  return out;
}

void ClusterBackend::DeliverLocked(Request& r, const strata::v1::TokenEvent& token,
                                   const strata::v1::TokenLogprobs& logprobs) {
  if (r.request.echo && !r.continued && !r.echoed) {
    r.echoed = true;
    // The client's prompt as it sent it (token ids: their text), with its tokens' logprobs.
    std::string text = r.request.prompt_text;
    if (text.empty()) {
      absl::StatusOr<std::string> t = tokenizer_->Decode(r.request.prompt_tokens);
      if (t.ok()) text = *std::move(t);
    }
    std::vector<TokenLogprobs> prompt;
    if (r.request.logprobs) {
      const std::vector<uint32_t>& ids = r.request.prompt_tokens;
      const auto& lps = r.prefill_resp.prompt_logprobs();
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i == 0 || static_cast<int>(i - 1) >= lps.size()) {
          TokenLogprobs first;
          first.chosen.token = TokenBytes(ids[i]);
          first.known = false;
          prompt.push_back(std::move(first));
        } else {
          prompt.push_back(LogprobsOf(ids[i], lps[static_cast<int>(i - 1)]));
        }
      }
    }
    r.stream->Echo(text, std::move(prompt));
  }
  if (r.request.logprobs) {
    r.stream->TokenWithLogprobs(token.text(), token.token(), LogprobsOf(token.token(), logprobs));
  } else {
    r.stream->Token(token.text(), token.token());
  }
}

void ClusterBackend::OnFinished(const std::shared_ptr<Request>& r,
                                const strata::v1::Finished& finished) {
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load()) return;
    r->finished = true;
    r->reason = finished.reason() == strata::v1::FINISH_LENGTH ? FinishReason::kLength
                                                               : FinishReason::kStop;
    r->usage.prompt_tokens =
        finished.prompt_tokens() != 0 ? finished.prompt_tokens() : r->prompt_tokens;
    r->usage.completion_tokens =
        finished.completion_tokens() != 0 ? finished.completion_tokens() : r->completion_tokens;
    r->usage.cached_tokens = finished.cached_tokens();
    if (r->continued) {  // the client's counts, across the hand-offs
      r->usage.prompt_tokens = r->client_prompt_tokens;
      r->usage.completion_tokens = r->completion_tokens;
      r->usage.cached_tokens = std::min(r->usage.cached_tokens, r->client_prompt_tokens);
    }
    if (!r->held.empty()) {
      r->finish_pending = true;  // ends once the held tokens went (OnPrefillDone)
      return;
    }
  }
  End(r, absl::OkStatus());
}

void ClusterBackend::OnGenerateDone(const std::shared_ptr<Request>& r, const grpc::Status& status) {
  if (status.ok()) {
    bool finished;
    {
      std::lock_guard<std::mutex> lock(r->mu);
      finished = r->finished;
    }
    if (!finished) {
      End(r, absl::InternalError(absl::StrCat(r->decode_node->description,
                                              ": the stream ended without `finished`")));
    }
    return;
  }
  if (r->cancelled.load()) {
    End(r, absl::CancelledError("cancelled by the client"));
    return;
  }
  absl::Status error = rpc::FromGrpc(status, r->decode_node->description);
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load()) return;
    // The decode node drops a request whose prefill failed (the prefill node tells it to); the
    // Prefill's own error, due any moment, is the one worth reporting. A decode node that is
    // gone or too slow is its own story.
    if (r->prefill_started && !r->prefill_done && error.code() != absl::StatusCode::kUnavailable &&
        error.code() != absl::StatusCode::kDeadlineExceeded) {
      r->generate_error = error;
      return;
    }
  }
  if (MaybeRetry(r, error, r->decode_node->spec.id)) return;
  End(r, error);
}

void ClusterBackend::OnPrefillDone(const std::shared_ptr<Request>& r, const grpc::Status& status) {
  absl::Status held;
  bool finish = false;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    r->prefill_done = true;
    finish = r->finish_pending;
    held = r->generate_error;
    if (!r->held.empty()) {
      // The first token waited for this answer (its logprobs, the prompt's), and the tokens
      // after it for the first: they go now, or never, if the prefill failed (the request
      // fails below).
      if (status.ok() && !r->ended.load() && !r->cancelled.load()) {
        for (size_t i = 0; i < r->held.size(); ++i) {
          DeliverLocked(*r, r->held[i],
                        i == 0 ? r->prefill_resp.first_token_logprobs() : r->held[i].logprobs());
        }
      }
      r->held.clear();
    }
    if (status.ok()) {
      const strata::v1::PrefillResponse& p = r->prefill_resp;
      r->prefill_summary = absl::StrFormat(
          "prefill %u cached + %u computed tokens in %.1f ms (queue %.1f ms), %u blocks / %u "
          "bytes shipped",
          p.cached_tokens(), p.computed_tokens(), p.total_seconds() * 1e3, p.queue_seconds() * 1e3,
          p.blocks_shipped(), p.bytes_shipped());
    }
  }
  if (status.ok()) {
    // n > 1: the prompt's blocks are in the store now; the other choices start from them.
    if (std::shared_ptr<ChoiceSet> later = std::move(r->later); later != nullptr && held.ok()) {
      StartLater(later);
    }
    if (!held.ok()) {
      End(r, held);  // the decode node failed on its own
    } else if (finish) {
      End(r, absl::OkStatus());
    }
    return;
  }
  if (r->cancelled.load()) {
    End(r, absl::CancelledError("cancelled by the client"));
    return;
  }
  const absl::Status error = rpc::FromGrpc(status, r->prefill_node->description);
  if (MaybeRetry(r, error, r->prefill_node->spec.id)) return;
  End(r, error);
}

void ClusterBackend::End(const std::shared_ptr<Request>& r, const absl::Status& status) {
  absl::Status outcome = status;
  uint32_t completion = 0;
  absl::Time first_token;
  Usage usage;
  std::string prefill_summary;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->ended.load()) return;
    r->ended.store(true);
    std::shared_ptr<CompletionStream> stream = std::move(r->stream);
    const bool cancelled = r->cancelled.load();
    if (cancelled && !outcome.ok()) outcome = absl::CancelledError("cancelled by the client");
    if (absl::IsResourceExhausted(outcome) && r->completion_tokens == 0) {
      // A node refused what the router admitted (its view was a poll behind): still a 429.
      rejected_total_->Add({{"reason", "node"}}).Increment();
      outcome = WithRetryAfter(outcome, 1);
    }
    if (!cancelled) {
      if (outcome.ok()) {
        stream->Finish(r->reason, r->usage);
      } else {
        stream->Fail(outcome);
      }
    }
    completion = r->completion_tokens;
    first_token = r->first_token_at;
    usage = r->usage;
    prefill_summary = r->prefill_summary;
  }
  if (!outcome.ok()) {
    // Both nodes free the request. Outside r->mu: a cancellation may run callbacks inline.
    r->generate_ctx->TryCancel();
    r->prefill_ctx->TryCancel();
  }
  tracker_.Complete(r->id);
  in_flight_.fetch_sub(1);
  in_flight_gauge_->Decrement();
  CountOutcome(outcome);
  if (outcome.ok()) cached_tokens_->Increment(usage.cached_tokens);
  const absl::Time now = absl::Now();
  std::string line = outcome.ok() ? "finished" : absl::StrCat("failed: ", outcome.ToString());
  absl::StrAppend(&line, "; ", r->prompt_tokens, " prompt tokens");
  if (outcome.ok()) absl::StrAppend(&line, " (", usage.cached_tokens, " cached)");
  absl::StrAppend(&line, ", ", completion, " generated");
  if (first_token != absl::InfinitePast()) {
    absl::StrAppend(&line, ", TTFT ", Millis(first_token - r->arrival));
  }
  absl::StrAppend(&line, ", ", Millis(now - r->arrival), " total; prefill ",
                  r->prefill_node->spec.id, ", decode ", r->decode_node->spec.id);
  if (!prefill_summary.empty()) absl::StrAppend(&line, "; ", prefill_summary);
  serving::Log(r->id, line);
}

void ClusterBackend::RequestGone(Request* r, std::shared_ptr<const NodeConnection> prefill,
                                 std::shared_ptr<const NodeConnection> decode) {
  std::lock_guard<std::mutex> lock(calls_mu_);
  live_.erase(r);
  retired_.push_back(std::move(prefill));
  retired_.push_back(std::move(decode));
  calls_cv_.notify_all();  // the last use of the backend by this request
}

void ClusterBackend::RecordTokenWritten(absl::Duration since_arrival) {
  token_relay_->Observe(absl::ToDoubleSeconds(since_arrival));
}

bool ClusterBackend::Healthy(std::string* detail) const {
  int prefill = 0, decode = 0;
  std::vector<std::string> unhealthy;
  for (const NodeStatus& s : pool_->Status()) {
    if (s.healthy) {
      ++(s.spec.role == membership::Role::kPrefill ? prefill : decode);
    } else {
      unhealthy.push_back(absl::StrCat(s.spec.id, " (", s.problem, ")"));
    }
  }
  std::vector<std::string> parts;
  if (prefill == 0) parts.push_back("no healthy prefill node");
  if (decode == 0) parts.push_back("no healthy decode node");
  if (!unhealthy.empty()) parts.push_back("unhealthy: " + absl::StrJoin(unhealthy, ", "));
  if (detail != nullptr) *detail = absl::StrJoin(parts, "; ");
  return prefill > 0 && decode > 0;
}

std::string ClusterBackend::RenderMetrics() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace strata::router
