// The PrefillNode gRPC service (proto/serving.proto): a thin adapter over PrefillEngine. It
// converts messages, turns the caller's cancellation (ServerContext) into the engine's
// `cancelled`, maps Status codes one to one (rpc/grpc_status.h), and keeps the node's
// Prometheus metrics.
//
// Metrics (registry given at construction):
//   strata_prefill_requests_total{result="ok|invalid|exhausted|cancelled|error"}
//   strata_prefill_prompt_tokens_total, strata_prefill_cached_tokens_total (prefix hits),
//   strata_prefill_computed_tokens_total
//   strata_prefill_bytes_shipped_total{codec}, strata_prefill_block_bytes_total{codec},
//   strata_prefill_fp16_bytes_total{codec} (the same chunks at fp16: the compression ratio)
//   strata_prefill_blocks_stored_total
//   strata_prefill_streamed_early_total (requests whose decode node held layer-0 blocks before the
//   last layer was computed: layer streaming, observed)
//   strata_prefill_block_resends_total (blocks sent again: the decode node refused them damaged)
//   strata_prefill_seconds{phase="queue|compute|total"} histograms
//   strata_prefill_queued_tokens, strata_prefill_active_requests (gauges)
//
// Thread-safe (gRPC calls it from its threads).
#pragma once

#include <atomic>
#include <mutex>

#include <cstdint>
#include <memory>
#include <string>

#include "prefill_node/prefill_engine.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "proto/serving.grpc.pb.h"

namespace strata::prefill {

struct PrefillServiceOptions {
  std::string node_id = "";
  std::string model_name = "";
  uint64_t incarnation = 0;
  uint64_t local_tier_bytes = 0;  // the node's own RAM tier (0: none); reported by Load
};

class PrefillService final : public strata::v1::PrefillNode::Service {
 public:
  // `engine` and `registry` must outlive the service.
  PrefillService(PrefillEngine* engine, PrefillServiceOptions options,
                 prometheus::Registry* registry);

  grpc::Status Prefill(grpc::ServerContext* context, const strata::v1::PrefillRequest* request,
                       strata::v1::PrefillResponse* response) override;
  grpc::Status Load(grpc::ServerContext* context, const strata::v1::LoadRequest* request,
                    strata::v1::NodeLoad* response) override;

  // Leaving the cluster: Load reports `draining` (routers send nothing new) and new Prefill calls
  // get UNAVAILABLE (routed again elsewhere); what runs goes on.
  void StartDraining() { draining_.store(true); }
  // Requests being prefilled or queued.
  uint32_t active() const { return engine_->load().active; }

 private:
  void UpdateGauges();
  std::atomic<bool> draining_{false};

  PrefillEngine* const engine_;
  const PrefillServiceOptions options_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& cached_tokens_;
  prometheus::Counter& computed_tokens_;
  prometheus::Counter& bytes_shipped_;
  prometheus::Counter& block_bytes_;
  prometheus::Counter& fp16_bytes_;
  prometheus::Counter& blocks_stored_;
  prometheus::Counter& streamed_early_;
  prometheus::Counter& resends_;
  std::mutex resends_mu_;
  uint64_t resends_seen_ = 0;  // the sender's retries already counted; guarded by resends_mu_
  prometheus::Histogram& queue_seconds_;
  prometheus::Histogram& compute_seconds_;
  prometheus::Histogram& total_seconds_;
  prometheus::Gauge& queued_tokens_;
  prometheus::Gauge& active_requests_;
};

}  // namespace strata::prefill
