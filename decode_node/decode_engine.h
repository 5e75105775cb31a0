// DecodeEngine: a decode node's work, with a Status API (decode_service.h is the thin gRPC
// adapter; tests run it in one process over the in-process transport).
//
// A request is registered first (Start), then its KV arrives from a prefill node over the
// transport (transport/shipment.h): every layer's blocks, every layer's window, and the end
// shipment with the first token. The engine adopts the blocks as they are (verified once, by the
// receiver; never copied or re-packed), installs the windows, and the sequence joins the running
// batch. Continuous batching: one scheduler thread steps every running sequence together
// (ComputeBackend::StepBatch); sequences join and leave at every step, each pass of the loop a
// named step (expire, admit, step, preempt, retire) whose two decisions, admission and preemption,
// are plain functions of byte counts (batch_planner.h). Admission is by max_batch and by KV bytes
// in use (compressed blocks plus full-precision windows); a sequence whose KV has arrived waits
// while either is full. Blocks that sequences share (one cached prefix, interned by BlockInterner)
// count once, also for a sequence about to join whose blocks a running one holds. When the running
// sequences outgrow the KV budget, the newest is preempted: its blocks go to the store, its window
// stays here, and it resumes from the store when there is room — never recomputed.
//
// Tokens stream to the request's TokenSink from the scheduler thread (the sink must not block).
// When a sequence ends, its full chunks that the prefill node did not store (generated text) are
// Put in the store, so the conversation's next turn is a prefix hit.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/prefix_key.h"
#include "decode_node/block_interner.h"
#include "kernels/calibration.h"
#include "kvstore/block_source.h"
#include "model/compute_backend.h"
#include "model/kv_cache.h"
#include "model/logprobs.h"
#include "model/sampler.h"
#include "model/served_format.h"
#include "model/tokenizer.h"
#include "transport/block_protocol.h"

namespace strata::decode {

struct DecodeEngineOptions {
  model::ServedFormat format = {};  // the prefill nodes' (codec, chunks, calibration, keys)
  uint32_t max_batch = 32;     // sequences stepped together
  uint64_t kv_budget_bytes = uint64_t{1} << 30;  // compressed blocks + windows of admitted ones
  // Registered requests not yet running (waiting for their KV or for a place in the batch); more
  // are refused with kResourceExhausted. 0: 4 x max_batch (MaxWaiting).
  uint32_t max_waiting = 0;
  // From Start to the end shipment, for a request that carries no deadline of its own. A request
  // with a deadline waits for its KV until then: however long the prefill node queues it (the
  // router cancels the request when its prefill fails).
  absl::Duration kv_timeout = absl::Seconds(60);
  bool put_to_store = true;  // Put generated chunks (and preempted sequences) in the store
  absl::Status Validate() const;
  uint32_t MaxWaiting() const { return max_waiting != 0 ? max_waiting : 4 * max_batch; }
};

enum class FinishReason { kStop, kLength };

struct DecodeRequest {
  std::string request_id = "";
  std::vector<uint32_t> prompt = {};  // the prompt as the prefill node got it
  std::string cache_salt = "";
  model::SamplingOptions sampling = {};
  uint32_t max_tokens = 16;  // generated tokens at most (the first included)
  std::vector<std::string> stop = {};
  bool ignore_eos = false;
  // When the caller gives up (InfiniteFuture: none; then kv_timeout bounds the wait for KV).
  absl::Time deadline = absl::InfiniteFuture();
  // Each token this node samples (all but the first) goes with its logprobs and those of the
  // top_logprobs (<= 20) most likely tokens (TokenSink::TokenWithLogprobs).
  bool logprobs = false;
  uint32_t top_logprobs = 0;
};

struct DecodeUsage {
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

// Where a request's output goes. Called from the scheduler thread, in order: Token* then one of
// Finish or Fail. Must not block.
class TokenSink {
 public:
  virtual ~TokenSink() = default;
  virtual void Token(uint32_t token, const std::string& text) = 0;
  // A token of a request that asked for logprobs (DecodeRequest::logprobs); the default drops
  // them.
  virtual void TokenWithLogprobs(uint32_t token, const std::string& text,
                                 const model::TokenLogprobs& logprobs) {
    (void)logprobs;
    Token(token, text);
  }
  virtual void Finish(FinishReason reason, const DecodeUsage& usage) = 0;
  virtual void Fail(const absl::Status& status) = 0;
  // Instead of Finish / Fail, from a draining engine (Drain): the sequence's full chunks are in
  // the store and another node may continue it from its prompt and the tokens streamed so far;
  // `text` is what the sequence held back (an unfinished stop string). The default fails.
  virtual void HandOff(uint32_t completion_tokens, const std::string& text) {
    (void)completion_tokens;
    (void)text;
    Fail(absl::UnavailableError("decode: the node is draining"));
  }
};

struct DecodeLoad {
  uint32_t running = 0, waiting = 0;  // in the batch / registered, not yet running
  uint64_t kv_bytes_in_use = 0;       // of running sequences (compressed blocks + windows)
  uint64_t kv_bytes_arrived = 0;      // of waiting sequences, held since arrival
};

struct DecodeStats {
  uint64_t requests = 0, finished = 0, failed = 0, cancelled = 0, preemptions = 0, resumed = 0;
  uint64_t handed_off = 0;                                // sequences handed off by Drain
  uint64_t tokens = 0, steps = 0, batched_sequences = 0;  // batched_sequences / steps = batch size
  uint64_t peak_batch = 0;                                // the most sequences one step took
  uint64_t blocks_received = 0, bytes_received = 0;
  uint64_t blocks_stored = 0, store_put_errors = 0;
  // Adopted blocks whose bytes another sequence here already held (BlockInterner): the new
  // copy was released, and the attention kernels read them once for all of their sequences.
  uint64_t blocks_shared = 0;
};

class DecodeEngine {
 public:
  // `model`, `tokenizer` and `transport` must outlive the engine; `store` may be null (no Put,
  // no preemption). Installs a BlockReceiver on `transport`.
  static absl::StatusOr<std::unique_ptr<DecodeEngine>> Create(DecodeEngineOptions options,
                                                              const model::ComputeBackend* model,
                                                              const model::Tokenizer* tokenizer,
                                                              transport::Transport* transport,
                                                              kvstore::BlockSource* store);
  // Fails what is still registered (UNAVAILABLE) and stops the scheduler.
  ~DecodeEngine();

  // Registers a request; its KV is then expected. kInvalidArgument (bad request),
  // kAlreadyExists (the id is registered), kResourceExhausted (too many waiting).
  absl::Status Start(DecodeRequest request, std::shared_ptr<TokenSink> sink);
  // Leaving the cluster: refuses new requests (UNAVAILABLE), lets what is registered finish until
  // `deadline`, then hands off what still runs (its full chunks Put in the store, the sink's
  // HandOff; a sequence that has generated nothing fails with UNAVAILABLE instead, to be routed
  // again). Returns once no request is left: how many were handed off.
  uint64_t Drain(absl::Time deadline);
  bool draining() const { return draining_.load(); }

  // Drops a request wherever it is (waiting for KV, waiting for room, running): its KV is freed
  // and its sink gets no further call. Unknown ids are ignored.
  void Cancel(const std::string& request_id);

  DecodeLoad load() const;
  DecodeStats stats() const;
  std::string transport_address() const { return transport_->address(); }
  const DecodeEngineOptions& options() const { return options_; }
  const model::ComputeBackend& model() const { return *model_; }
  const transport::BlockReceiver& receiver() const { return *receiver_; }

 private:
  struct Sequence;
  DecodeEngine(DecodeEngineOptions options, const model::ComputeBackend* model,
               const model::Tokenizer* tokenizer, transport::Transport* transport,
               kvstore::BlockSource* store)
      : options_(std::move(options)),
        model_(model),
        tokenizer_(tokenizer),
        transport_(transport),
        store_(store) {}
  absl::Status Consume(transport::ReceivedBlock block);
  // The scheduler thread: each pass expires, admits, steps, preempts and retires (below).
  void Loop();
  // Under mu_: registered sequences whose KV did not arrive by their deadline, taken out.
  std::vector<std::shared_ptr<Sequence>> TakeExpired(absl::Time now);
  // Under mu_: the waiting sequences that join the batch now (PlanAdmission), taken out of
  // ready_.
  std::vector<std::shared_ptr<Sequence>> TakeAdmitted();
  void FailExpired(const std::vector<std::shared_ptr<Sequence>>& expired);
  // Activates (or resumes) the admitted sequences; a new one emits its first token. Those that
  // failed or finished go to *done.
  void StartAdmitted(const std::vector<std::shared_ptr<Sequence>>& admitted,
                     std::vector<std::shared_ptr<Sequence>>* done);
  // One step of every running sequence not in *done; those that finish go to *done.
  void StepBatch(std::vector<std::shared_ptr<Sequence>>* done);
  // The newest running sequences to the store while the others outgrow the budget
  // (PlanPreemption); returns them.
  std::vector<std::shared_ptr<Sequence>> PreemptOverBudget(
      const std::vector<std::shared_ptr<Sequence>>& done);
  // Drops the finished and cancelled sequences; the preempted wait first in line again.
  void Retire(std::vector<std::shared_ptr<Sequence>> done,
              const std::vector<std::shared_ptr<Sequence>>& preempted);
  // Adopts an arrived sequence's KV into its cache; emits its first token. Holds no lock.
  absl::Status Activate(Sequence& s);
  absl::Status Preempt(Sequence& s);
  absl::Status Resume(Sequence& s);
  // Emits `token` for `s`; true when the sequence is done (finished now).
  // `logprobs`: the token's, when the request asked for them (null otherwise, and for the first
  // token, which the prefill node sampled).
  bool Emit(Sequence& s, uint32_t token, const model::TokenLogprobs* logprobs = nullptr);
  // The sink's Token, or TokenWithLogprobs when `logprobs` is set.
  void SendToken(Sequence& s, uint32_t token, const std::string& text,
                 const model::TokenLogprobs* logprobs);
  void PutGenerated(Sequence& s);
  // The scheduler's part of Drain: every registered sequence handed off (or failed), the engine
  // left empty.
  void HandOffAll();
  // The blocks of chunks [from, to) of every layer, parents first, for one PutMany.
  std::vector<kvstore::PutItem> PutItems(const Sequence& s, const std::vector<BlockHash>& keys,
                                         uint32_t from, uint32_t to) const;
  // The prefix keys of the full chunks among the first `tokens` of s's prompt and output.
  absl::StatusOr<std::vector<BlockHash>> ChunkKeys(const Sequence& s, size_t tokens) const;
  // Bytes of s's compressed blocks and window (arrived, held, or saved when preempted).
  uint64_t KvBytes(const Sequence& s) const;
  uint64_t WindowBytes(const Sequence& s) const;  // s has a cache
  // Bytes the sequences hold together: a block several of them hold counts once.
  uint64_t KvBytesInUse(absl::Span<const std::shared_ptr<Sequence>> seqs) const;
  // Fills s.block_names (the store names of s's arrived blocks, once); kInvalidArgument when
  // the prompt has fewer full chunks than were shipped.
  absl::Status NameArrivedBlocks(Sequence& s) const;
  // Bytes of an arrived (not yet running) sequence's blocks whose names a live sequence holds:
  // Activate adopts those from the held bytes, so they cost nothing more. Under mu_.
  uint64_t SharedArrivedBytes(Sequence& s);

  const DecodeEngineOptions options_;
  const model::ComputeBackend* model_;
  const model::Tokenizer* tokenizer_;
  transport::Transport* transport_;
  kvstore::BlockSource* store_;
  std::unique_ptr<transport::BlockReceiver> receiver_;
  BlockInterner interner_;
  std::unique_ptr<model::KvCache> namer_;  // names blocks before a sequence has a cache

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool hand_off_ = false;  // Drain's deadline passed: the scheduler hands off what is left
  std::atomic<bool> draining_{false};
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> by_id_;  // every registered one
  std::deque<std::shared_ptr<Sequence>> ready_;     // KV arrived (or preempted), waiting for room
  std::vector<std::shared_ptr<Sequence>> running_;  // only the scheduler thread changes it
  DecodeLoad load_;
  DecodeStats stats_;
  std::thread thread_;
};

}  // namespace strata::decode
