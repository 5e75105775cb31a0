#include "prefill_node/prefill_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/grpc_status.h"
#include "serving/node_process.h"

namespace strata::prefill {
namespace {

using serving::AddCounter;
using serving::AddGauge;

prometheus::Histogram& PhaseHistogram(prometheus::Registry* registry, const char* phase) {
  return serving::AddHistogram(registry, "strata_prefill_seconds", "Prefill time by phase",
                               serving::LatencyBuckets(), {{"phase", phase}});
}

}  // namespace

PrefillService::PrefillService(PrefillEngine* engine, PrefillServiceOptions options,
                               prometheus::Registry* registry)
    : engine_(engine),
      options_(std::move(options)),
      requests_(prometheus::BuildCounter()
                    .Name("strata_prefill_requests_total")
                    .Help("Prefill requests by result")
                    .Register(*registry)),
      prompt_tokens_(AddCounter(registry, "strata_prefill_prompt_tokens_total",
                                "Prompt tokens of finished prefills")),
      cached_tokens_(AddCounter(registry, "strata_prefill_cached_tokens_total",
                                "Prompt tokens adopted from the store (prefix hits)")),
      computed_tokens_(AddCounter(registry, "strata_prefill_computed_tokens_total",
                                  "Prompt tokens the model computed")),
      bytes_shipped_(AddCounter(registry, "strata_prefill_bytes_shipped_total",
                                "Bytes sent to decode nodes, shipment headers included",
                                {{"codec", engine->options().format.codec}})),
      block_bytes_(AddCounter(registry, "strata_prefill_block_bytes_total",
                              "Compressed block bytes sent to decode nodes",
                              {{"codec", engine->options().format.codec}})),
      fp16_bytes_(AddCounter(registry, "strata_prefill_fp16_bytes_total",
                             "What the shipped chunks' K and V would be at fp16",
                             {{"codec", engine->options().format.codec}})),
      blocks_stored_(AddCounter(registry, "strata_prefill_blocks_stored_total",
                                "New blocks Put in the store")),
      streamed_early_(AddCounter(registry, "strata_prefill_streamed_early_total",
                                 "Requests whose decode node acknowledged layer-0 blocks before "
                                 "the last layer was computed (layer streaming, observed)")),
      resends_(AddCounter(registry, "strata_prefill_block_resends_total",
                          "Blocks sent again because the decode node refused them damaged "
                          "(CRC-32C) or for want of room")),
      queue_seconds_(PhaseHistogram(registry, "queue")),
      compute_seconds_(PhaseHistogram(registry, "compute")),
      total_seconds_(PhaseHistogram(registry, "total")),
      queued_tokens_(
          AddGauge(registry, "strata_prefill_queued_tokens", "Prompt tokens waiting or computing")),
      active_requests_(
          AddGauge(registry, "strata_prefill_active_requests", "Requests waiting or computing")) {}

void PrefillService::UpdateGauges() {
  {
    std::lock_guard<std::mutex> lock(resends_mu_);
    const uint64_t retries = engine_->sender().stats().retries;
    if (retries > resends_seen_) resends_.Increment(static_cast<double>(retries - resends_seen_));
    resends_seen_ = std::max(resends_seen_, retries);
  }
  const PrefillLoad load = engine_->load();
  queued_tokens_.Set(static_cast<double>(load.queued_tokens));
  active_requests_.Set(load.active);
}

grpc::Status PrefillService::Prefill(grpc::ServerContext* context,
                                     const strata::v1::PrefillRequest* request,
                                     strata::v1::PrefillResponse* response) {
  PrefillRequest r;
  r.request_id = request->request_id();
  r.tokens.assign(request->tokens().begin(), request->tokens().end());
  r.cache_salt = request->cache_salt();
  r.decode_address = request->decode_address();
  r.sampling = serving::SamplingFromProto(request->sampling());
  r.deadline = serving::CallDeadline(*context);
  r.logprobs = request->logprobs();
  r.top_logprobs = request->top_logprobs();
  r.prompt_logprobs = request->prompt_logprobs();
  if (draining_.load()) {
    requests_.Add({{"result", "error"}}).Increment();
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "prefill node is draining (leaving the cluster)");
  }
  if (absl::Status s = r.sampling.Validate(); !s.ok()) {
    requests_.Add({{"result", "invalid"}}).Increment();
    return rpc::ToGrpc(s);
  }
  UpdateGauges();
  absl::StatusOr<PrefillResult> result =
      engine_->Prefill(r, [context] { return context->IsCancelled(); });
  UpdateGauges();
  requests_.Add({{"result", serving::ResultLabel(result.status().code())}}).Increment();
  if (!result.ok()) {
    serving::Log(r.request_id, absl::StrCat("prefill failed: ", result.status().ToString()));
    return rpc::ToGrpc(result.status());
  }
  prompt_tokens_.Increment(result->prompt_tokens);
  cached_tokens_.Increment(result->cached_tokens);
  computed_tokens_.Increment(result->computed_tokens);
  bytes_shipped_.Increment(static_cast<double>(result->bytes_shipped));
  block_bytes_.Increment(static_cast<double>(result->block_bytes));
  fp16_bytes_.Increment(static_cast<double>(result->fp16_bytes));
  blocks_stored_.Increment(result->blocks_stored);
  if (result->layer0_acked_early > 0) streamed_early_.Increment();
  queue_seconds_.Observe(result->queue_seconds);
  compute_seconds_.Observe(result->compute_seconds);
  total_seconds_.Observe(result->total_seconds);
  serving::Log(
      r.request_id,
      absl::StrCat("prefilled ", result->prompt_tokens, " tokens (", result->cached_tokens,
                   " cached) in ", absl::StrFormat("%.1f", result->total_seconds * 1e3),
                   " ms; shipped ", result->bytes_shipped, " bytes to ", r.decode_address));
  response->set_first_token(result->first_token);
  response->set_prompt_tokens(result->prompt_tokens);
  response->set_cached_tokens(result->cached_tokens);
  response->set_computed_tokens(result->computed_tokens);
  response->set_blocks_shipped(result->blocks_shipped);
  response->set_bytes_shipped(result->bytes_shipped);
  response->set_block_bytes(result->block_bytes);
  response->set_fp16_bytes(result->fp16_bytes);
  response->set_blocks_stored(result->blocks_stored);
  response->set_queue_seconds(result->queue_seconds);
  response->set_compute_seconds(result->compute_seconds);
  response->set_total_seconds(result->total_seconds);
  response->set_node_id(options_.node_id);
  response->set_layer0_acked_early(result->layer0_acked_early);
  if (r.logprobs) {
    serving::LogprobsToProto(result->first_token_logprobs,
                             response->mutable_first_token_logprobs());
  }
  for (const model::TokenLogprobs& lp : result->prompt_logprobs) {
    serving::LogprobsToProto(lp, response->add_prompt_logprobs());
  }
  return grpc::Status::OK;
}

grpc::Status PrefillService::Load(grpc::ServerContext*, const strata::v1::LoadRequest*,
                                  strata::v1::NodeLoad* response) {
  const PrefillLoad load = engine_->load();
  const model::ModelConfig& config = engine_->model().config();
  response->set_node_id(options_.node_id);
  response->set_role("prefill");
  response->set_model(options_.model_name);
  response->set_codec(engine_->options().format.codec);
  response->set_chunk_tokens(engine_->options().format.chunk_tokens);
  response->set_context_tokens(config.max_position_embeddings);
  response->set_queued_prefill_tokens(load.queued_tokens);
  response->set_active_requests(load.active);
  response->set_incarnation(options_.incarnation);
  response->set_local_tier_bytes(options_.local_tier_bytes);
  response->set_draining(draining_.load());
  response->set_max_queued_prefill_tokens(load.max_queued_tokens);
  response->set_prefill_tokens_per_second(load.tokens_per_second);
  return grpc::Status::OK;
}


}  // namespace strata::prefill
