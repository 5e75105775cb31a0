// PrefillEngine: a prefill node's work, with a Status API (the gRPC adapter, prefill_service.h,
// is a thin layer over it; tests run it in one process over the in-process transport).
//
// For a request it keys the prompt's full chunks (vLLM's chained hash with the request's cache
// salt), takes the longest prefix the store holds for every layer (capped so that at least the
// last prompt token is computed: its logits give the first token), adopts those blocks, and
// runs the model over the rest chunk-aligned (ComputeBackend::Prefill). Every block — adopted ones
// first, then each computed layer as soon as it is done, while later layers still compute — is
// shipped to the request's decode node (BlockSender, transport/shipment.h names each), then each
// layer's window (the partial last chunk at full precision), then the end shipment with the
// first token. New full chunks are Put in the store after the decode node has acknowledged
// everything. Blocks are never re-packed: the codec's bytes are what moves and what is stored.
//
// Admission (docs/cluster.md, "Overload"): the queue holds at most the prompt tokens the node
// computes within max_queue_time at its measured rate (a moving average of its requests' prompt
// tokens per second of service, seeded by MeasureThroughput at start), and never more than
// max_queued_tokens; a request beyond that, or one whose deadline its place in the queue would
// miss, is refused at once with kResourceExhausted, before any KV is computed or moved. A queued
// request whose caller gave up (`cancelled`, which a gRPC deadline also sets) or whose deadline
// passed leaves the queue without computing.
//
// Errors: kInvalidArgument (bad request: empty prompt, token beyond the vocabulary, prompt over
// the context, bad request id), kResourceExhausted (queue full, or the deadline out of reach),
// kCancelled (the caller's `cancelled` said so; the decode node is told to drop the request),
// kDeadlineExceeded (the deadline passed in the queue), kUnavailable / kDeadlineExceeded (decode
// node unreachable or too slow; it is told to drop the request).
// A store that fails is only a miss (lookup) or a lost Put, logged and counted, never an error.
//
// Thread-safe: Prefill may be called from many threads; at most `max_concurrent` compute at once,
// the rest wait their turn in arrival order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/prefix_key.h"
#include "kernels/calibration.h"
#include "kvstore/block_source.h"
#include "model/compute_backend.h"
#include "model/kv_cache.h"
#include "model/logprobs.h"
#include "model/sampler.h"
#include "model/served_format.h"
#include "transport/block_protocol.h"

namespace strata::prefill {

struct PrefillEngineOptions {
  model::ServedFormat format = {};                    // the decode nodes must serve the same
  absl::Duration ship_timeout = absl::Seconds(30);    // per block, send to acknowledgement
  absl::Duration connect_timeout = absl::Seconds(5);  // to a decode node
  int max_concurrent = 1;                    // prompts computed at once
  uint64_t max_queued_tokens = 1u << 20;     // prompt tokens waiting or computing; more: refused
  // The work queued ahead of a new request, at the measured rate, at most; more: refused. Zero:
  // only max_queued_tokens bounds the queue. A request always gets in when the queue is empty.
  absl::Duration max_queue_time = absl::Seconds(10);
  bool put_to_store = true;                  // Put newly computed chunks in the store
  absl::Status Validate() const;
};

struct PrefillRequest {
  std::string request_id = "";  // transport::ValidateRequestId
  std::vector<uint32_t> tokens = {};  // the prompt, BOS included when the model wants one
  std::string cache_salt = "";  // tenants with different salts never share blocks
  std::string decode_address = "";  // the decode node's transport address
  model::SamplingOptions sampling = {};  // for the first token
  // When the caller gives up on the request (InfiniteFuture: never): see "Admission" above.
  absl::Time deadline = absl::InfiniteFuture();
  // Logprobs of the first token (with top_logprobs of the most likely, <= 20), and with
  // prompt_logprobs of every prompt token after the first: the whole prompt is then computed
  // (adopted tokens have no logits here), though still shipped and stored as usual.
  bool logprobs = false;
  uint32_t top_logprobs = 0;
  bool prompt_logprobs = false;
};

struct PrefillResult {
  uint32_t first_token = 0;
  uint32_t prompt_tokens = 0;
  uint32_t cached_tokens = 0;    // adopted from the store
  uint32_t computed_tokens = 0;
  uint32_t blocks_shipped = 0;
  uint64_t bytes_shipped = 0;    // payload and shipment ids of everything sent to the decode node
  uint64_t block_bytes = 0;      // of which compressed blocks
  uint64_t fp16_bytes = 0;       // what the shipped chunks' K and V would be at fp16
  uint32_t blocks_stored = 0;    // new chunks' blocks Put in the store
  // Computed layer-0 blocks the decode node had acknowledged before the last layer was
  // compressed: > 0 shows layers streaming while later layers compute.
  uint32_t layer0_acked_early = 0;
  double queue_seconds = 0, compute_seconds = 0, total_seconds = 0;
  model::TokenLogprobs first_token_logprobs;          // with PrefillRequest::logprobs
  std::vector<model::TokenLogprobs> prompt_logprobs;  // tokens[1..], with prompt_logprobs
};

struct PrefillLoad {
  uint64_t queued_tokens = 0;  // prompt tokens waiting or computing
  uint32_t active = 0;         // requests waiting or computing
  // The queue's bound now (max_queue_time at the measured rate, capped by max_queued_tokens).
  uint64_t max_queued_tokens = 0;
  double tokens_per_second = 0;  // the measured rate; 0 before any measurement
};

struct PrefillStats {
  uint64_t requests = 0, failed = 0, cancelled = 0;
  uint64_t prompt_tokens = 0, cached_tokens = 0, computed_tokens = 0;
  uint64_t blocks_shipped = 0, bytes_shipped = 0, block_bytes = 0, fp16_bytes = 0;
  uint64_t store_lookup_errors = 0, store_put_errors = 0, blocks_stored = 0;
  uint64_t streamed_early = 0;  // requests with layer0_acked_early > 0
  uint64_t refused = 0;         // kResourceExhausted at admission
  uint64_t expired = 0;         // left the queue at their deadline without computing
};

class PrefillEngine {
 public:
  // `model` and `transport` must outlive the engine; `store` may be null (no prefix reuse).
  // The engine installs a BlockSender on `transport` (one per transport).
  static absl::StatusOr<std::unique_ptr<PrefillEngine>> Create(PrefillEngineOptions options,
                                                               const model::ComputeBackend* model,
                                                               transport::Transport* transport,
                                                               kvstore::BlockSource* store);
  ~PrefillEngine();

  // `cancelled` (optional) is polled between layers; when it returns true the request stops.
  absl::StatusOr<PrefillResult> Prefill(const PrefillRequest& request,
                                        const std::function<bool()>& cancelled = nullptr);

  // Seeds the rate estimate admission uses: computes a prompt of `tokens` synthetic tokens
  // (nothing shipped or stored) and times it. Called once at start by strata-prefill.
  absl::Status MeasureThroughput(uint32_t tokens);

  PrefillLoad load() const;
  PrefillStats stats() const;
  const PrefillEngineOptions& options() const { return options_; }
  const model::ComputeBackend& model() const { return *model_; }
  transport::BlockSender& sender() { return *sender_; }

 private:
  PrefillEngine(PrefillEngineOptions options, const model::ComputeBackend* model,
                transport::Transport* transport, kvstore::BlockSource* store)
      : options_(std::move(options)), model_(model), transport_(transport), store_(store) {}
  absl::StatusOr<std::shared_ptr<transport::Endpoint>> Peer(const std::string& address);
  absl::StatusOr<PrefillResult> Run(const PrefillRequest& request,
                                    const std::function<bool()>& cancelled);
  // Under mu_: the queue's bound in prompt tokens, and how long `tokens` take at the measured
  // rate (zero before any measurement).
  uint64_t QueueLimit() const;
  absl::Duration TimeFor(uint64_t tokens) const;
  void RecordRate(uint64_t tokens, double seconds);  // under mu_

  const PrefillEngineOptions options_;
  const model::ComputeBackend* model_;
  transport::Transport* transport_;
  kvstore::BlockSource* store_;
  std::unique_ptr<transport::BlockSender> sender_;

  mutable std::mutex mu_;
  std::condition_variable turn_cv_;
  uint64_t next_ticket_ = 0, serving_ticket_ = 0;  // arrival order for the compute slots
  int computing_ = 0;
  double tokens_per_second_ = 0;  // moving average of prompt tokens per second of service
  PrefillLoad load_;
  PrefillStats stats_;
  absl::flat_hash_map<std::string, std::shared_ptr<transport::Endpoint>> peers_;
};

}  // namespace strata::prefill
