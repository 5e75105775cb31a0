#include "decode_node/decode_service.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/grpc_status.h"
#include "serving/node_process.h"

namespace strata::decode {
namespace {

using Clock = std::chrono::steady_clock;

// The engine's sink for one request: queues events for the gRPC thread that writes them. Called
// from the engine's scheduler thread; never blocks beyond a short lock.
class QueueSink final : public TokenSink {
 public:
  QueueSink(prometheus::Histogram* first_token, prometheus::Histogram* inter_token)
      : first_token_(first_token), inter_token_(inter_token), start_(Clock::now()) {}

  void Token(uint32_t token, const std::string& text) override {
    strata::v1::GenerateEvent e;
    e.mutable_token()->set_token(token);
    e.mutable_token()->set_text(text);
    PushToken(std::move(e));
  }
  void TokenWithLogprobs(uint32_t token, const std::string& text,
                         const model::TokenLogprobs& logprobs) override {
    strata::v1::GenerateEvent e;
    e.mutable_token()->set_token(token);
    e.mutable_token()->set_text(text);
    serving::LogprobsToProto(logprobs, e.mutable_token()->mutable_logprobs());
    PushToken(std::move(e));
  }
  void PushToken(strata::v1::GenerateEvent e) {
    const Clock::time_point now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (tokens_ == 0) {
      first_token_->Observe(std::chrono::duration<double>(now - start_).count());
    } else {
      inter_token_->Observe(since);
    }
    last_ = now;
    ++tokens_;
    Push(std::move(e), false, absl::OkStatus());
  }
  void Finish(FinishReason reason, const DecodeUsage& usage) override {
    strata::v1::GenerateEvent e;
    strata::v1::Finished* f = e.mutable_finished();
    f->set_reason(reason == FinishReason::kStop ? strata::v1::FINISH_STOP
                                                : strata::v1::FINISH_LENGTH);
    f->set_prompt_tokens(usage.prompt_tokens);
    f->set_completion_tokens(usage.completion_tokens);
    f->set_cached_tokens(usage.cached_tokens);
    Push(std::move(e), true, absl::OkStatus());
  }
  void Fail(const absl::Status& status) override { Push(std::nullopt, true, status); }
  void HandOff(uint32_t completion_tokens, const std::string& text) override {
    strata::v1::GenerateEvent e;
    e.mutable_handed_off()->set_completion_tokens(completion_tokens);
    e.mutable_handed_off()->set_text(text);
    Push(std::move(e), true, absl::OkStatus());
  }

  // Waits up to `timeout` for events; moves them into *out. Returns true once the request ended
  // (then *status is its outcome) and every event was handed out.
  bool Take(std::chrono::milliseconds timeout, std::deque<strata::v1::GenerateEvent>* out,
            absl::Status* status) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return !events_.empty() || done_; });
    out->swap(events_);
    events_.clear();
    *status = status_;
    return done_;
  }

 private:
  void Push(std::optional<strata::v1::GenerateEvent> e, bool done, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (e.has_value()) events_.push_back(*std::move(e));
    if (done) {
      done_ = true;
      status_ = std::move(status);
    }
    cv_.notify_one();
  }

  prometheus::Histogram* first_token_;
  prometheus::Histogram* inter_token_;
  const Clock::time_point start_;
  Clock::time_point last_ = {};  // scheduler thread only
  uint64_t tokens_ = 0;          // scheduler thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<strata::v1::GenerateEvent> events_;  // guarded by mu_
  bool done_ = false;                             // guarded by mu_
  absl::Status status_;                           // guarded by mu_
};

using serving::AddCounter;
using serving::AddGauge;
using serving::AddHistogram;

}  // namespace

DecodeService::DecodeService(DecodeEngine* engine, DecodeServiceOptions options,
                             prometheus::Registry* registry)
    : engine_(engine),
      options_(std::move(options)),
      requests_(prometheus::BuildCounter()
                    .Name("strata_decode_requests_total")
                    .Help("Generate requests by result")
                    .Register(*registry)),
      tokens_(AddCounter(registry, "strata_decode_tokens_total", "Tokens generated")),
      cached_tokens_(AddCounter(registry, "strata_decode_cached_tokens_total",
                                "Prompt tokens of finished requests adopted from the store")),
      first_token_seconds_(AddHistogram(registry, "strata_decode_first_token_seconds",
                                        "Registration to first token (KV transfer, admission)",
                                        serving::LatencyBuckets())),
      inter_token_seconds_(AddHistogram(registry, "strata_decode_inter_token_seconds",
                                        "Time between a sequence's tokens",
                                        serving::LatencyBuckets())),
      batch_size_(AddHistogram(registry, "strata_decode_batch_size",
                               "Mean sequences per step over each refresh interval",
                               {1, 2, 4, 8, 16, 32, 64, 128, 256})),
      running_(AddGauge(registry, "strata_decode_running", "Sequences in the running batch")),
      waiting_(AddGauge(registry, "strata_decode_waiting", "Registered sequences not yet running")),
      kv_in_use_(AddGauge(registry, "strata_decode_kv_bytes_in_use",
                          "KV bytes of running sequences (compressed blocks + windows)")),
      kv_arrived_(AddGauge(registry, "strata_decode_kv_bytes_arrived",
                           "KV bytes held for sequences waiting to run")),
      preemptions_(AddCounter(registry, "strata_decode_preemptions_total",
                              "Sequences preempted to the store")),
      resumed_(AddCounter(registry, "strata_decode_resumed_total",
                          "Preempted sequences resumed from the store")),
      bytes_received_(AddCounter(registry, "strata_decode_bytes_received_total",
                                 "Block bytes received from prefill nodes",
                                 {{"codec", engine->options().format.codec}})),
      blocks_stored_(AddCounter(registry, "strata_decode_blocks_stored_total",
                                "Blocks of generated text Put in the store")),
      blocks_damaged_(AddCounter(registry, "strata_decode_blocks_damaged_total",
                                 "Blocks refused because their bytes arrived damaged (CRC-32C); "
                                 "the prefill node sends them again")),
      blocks_shared_(AddCounter(registry, "strata_decode_blocks_shared_total",
                                "Adopted blocks whose bytes another sequence here already held "
                                "(one copy kept; read once per step for all of them)")) {}

void DecodeService::Refresh() {
  const DecodeLoad load = engine_->load();
  running_.Set(load.running);
  waiting_.Set(load.waiting);
  kv_in_use_.Set(static_cast<double>(load.kv_bytes_in_use));
  kv_arrived_.Set(static_cast<double>(load.kv_bytes_arrived));
  const DecodeStats now = engine_->stats();
  std::lock_guard<std::mutex> lock(refresh_mu_);
  const uint64_t steps = now.steps - last_.steps;
  if (steps > 0) {
    batch_size_.Observe(static_cast<double>(now.batched_sequences - last_.batched_sequences) /
                        static_cast<double>(steps));
  }
  preemptions_.Increment(static_cast<double>(now.preemptions - last_.preemptions));
  resumed_.Increment(static_cast<double>(now.resumed - last_.resumed));
  bytes_received_.Increment(static_cast<double>(now.bytes_received - last_.bytes_received));
  blocks_stored_.Increment(static_cast<double>(now.blocks_stored - last_.blocks_stored));
  blocks_shared_.Increment(static_cast<double>(now.blocks_shared - last_.blocks_shared));
  const uint64_t damaged = engine_->receiver().stats().checksum_failures;
  blocks_damaged_.Increment(static_cast<double>(damaged - last_damaged_));
  last_damaged_ = damaged;
  last_ = now;
}

grpc::Status DecodeService::Generate(grpc::ServerContext* context,
                                     const strata::v1::GenerateRequest* request,
                                     grpc::ServerWriter<strata::v1::GenerateEvent>* writer) {
  DecodeRequest r;
  r.request_id = request->request_id();
  r.prompt.assign(request->prompt().begin(), request->prompt().end());
  r.cache_salt = request->cache_salt();
  r.sampling = serving::SamplingFromProto(request->sampling());
  r.max_tokens = request->max_tokens();
  r.stop.assign(request->stop().begin(), request->stop().end());
  r.ignore_eos = request->ignore_eos();
  r.deadline = serving::CallDeadline(*context);
  r.logprobs = request->logprobs();
  r.top_logprobs = request->top_logprobs();
  if (r.top_logprobs > model::kMaxTopLogprobs) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("decode: top_logprobs ", r.top_logprobs, " is over ", model::kMaxTopLogprobs));
  }
  if (stopping_) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode node is shutting down");
  }
  auto sink = std::make_shared<QueueSink>(&first_token_seconds_, &inter_token_seconds_);
  if (absl::Status s = engine_->Start(r, sink); !s.ok()) {
    requests_.Add({{"result", serving::ResultLabel(s.code())}}).Increment();
    serving::Log(r.request_id, absl::StrCat("refused: ", s.ToString()));
    return rpc::ToGrpc(s);
  }
  strata::v1::GenerateEvent registered;
  registered.mutable_registered()->set_transport_address(engine_->transport_address());
  registered.mutable_registered()->set_node_id(options_.node_id);
  const Clock::time_point start = Clock::now();
  auto cancel = [&](const char* why) {
    engine_->Cancel(r.request_id);
    requests_.Add({{"result", "cancelled"}}).Increment();
    serving::Log(r.request_id, absl::StrCat("cancelled: ", why));
    return grpc::Status(grpc::StatusCode::CANCELLED, why);
  };
  if (!writer->Write(registered)) return cancel("the caller went away");
  std::deque<strata::v1::GenerateEvent> events;
  absl::Status outcome;
  uint32_t completion = 0, cached = 0;
  bool handed_off = false;
  for (;;) {
    const bool done = sink->Take(std::chrono::milliseconds(50), &events, &outcome);
    for (strata::v1::GenerateEvent& e : events) {
      if (e.has_finished()) {
        completion = e.finished().completion_tokens();
        cached = e.finished().cached_tokens();
      }
      if (e.has_handed_off()) {
        completion = e.handed_off().completion_tokens();
        handed_off = true;
      }
      if (!writer->Write(e)) return cancel("the caller went away");
    }
    events.clear();
    if (done) break;
    if (context->IsCancelled()) return cancel("the caller cancelled");
    if (stopping_) {
      engine_->Cancel(r.request_id);
      requests_.Add({{"result", "error"}}).Increment();
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode node is shutting down");
    }
  }
  requests_.Add({{"result", handed_off ? "handed_off" : serving::ResultLabel(outcome.code())}})
      .Increment();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!outcome.ok()) {
    serving::Log(r.request_id, absl::StrCat("failed: ", outcome.ToString()));
    return rpc::ToGrpc(outcome);
  }
  tokens_.Increment(completion);
  cached_tokens_.Increment(cached);
  if (handed_off) {
    serving::Log(r.request_id, absl::StrFormat("handed off after %u tokens (draining) in %.1f ms",
                                               completion, seconds * 1e3));
    return grpc::Status::OK;
  }
  serving::Log(r.request_id, absl::StrFormat("generated %u tokens (%u prompt tokens cached) in "
                                             "%.1f ms",
                                             completion, cached, seconds * 1e3));
  return grpc::Status::OK;
}

grpc::Status DecodeService::Load(grpc::ServerContext*, const strata::v1::LoadRequest*,
                                 strata::v1::NodeLoad* response) {
  Refresh();
  const DecodeLoad load = engine_->load();
  response->set_node_id(options_.node_id);
  response->set_role("decode");
  response->set_model(options_.model_name);
  response->set_codec(engine_->options().format.codec);
  response->set_chunk_tokens(engine_->options().format.chunk_tokens);
  response->set_context_tokens(engine_->model().config().max_position_embeddings);
  response->set_active_requests(load.running + load.waiting);
  response->set_kv_bytes_in_use(load.kv_bytes_in_use);
  response->set_kv_bytes_reserved(load.kv_bytes_arrived);
  response->set_kv_bytes_capacity(engine_->options().kv_budget_bytes);
  response->set_max_batch(engine_->options().max_batch);
  response->set_max_waiting(engine_->options().MaxWaiting());
  response->set_kv_bytes_per_token(options_.kv_bytes_per_token);
  response->set_incarnation(options_.incarnation);
  response->set_draining(engine_->draining());
  return grpc::Status::OK;
}

}  // namespace strata::decode
