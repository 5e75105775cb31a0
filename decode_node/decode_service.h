// The DecodeNode gRPC service (proto/serving.proto): a thin adapter over DecodeEngine. Generate
// registers the request with the engine, answers `registered` with the node's transport address
// (where the prefill node ships the KV), then streams the tokens the engine emits and ends with
// `finished`, or with the engine's error as the call's status. A caller that goes away (its
// context cancelled, or a write fails) cancels the request in the engine, which frees its KV.
//
// Metrics (registry given at construction):
//   strata_decode_requests_total{result="ok|invalid|exhausted|cancelled|error|handed_off"}
//   strata_decode_tokens_total (generated), strata_decode_cached_tokens_total (prompt tokens the
//   prefill node adopted from the store: prefix hits)
//   strata_decode_first_token_seconds (registration to first token: KV transfer and admission)
//   strata_decode_inter_token_seconds (between a sequence's tokens)
//   strata_decode_batch_size (histogram: sequences per step, sampled by Refresh)
//   strata_decode_running, strata_decode_waiting, strata_decode_kv_bytes_in_use,
//   strata_decode_kv_bytes_arrived (gauges)
//   strata_decode_preemptions_total, strata_decode_resumed_total,
//   strata_decode_bytes_received_total{codec}, strata_decode_blocks_stored_total
//   strata_decode_blocks_damaged_total (blocks refused because their bytes arrived damaged)
//   strata_decode_blocks_shared_total (adopted blocks another sequence here already held: one
//   copy kept, read once per step for all of them)
//
// Thread-safe. Each open Generate holds one gRPC server thread while it streams.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "decode_node/decode_engine.h"
#include "grpcpp/server.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "proto/serving.grpc.pb.h"

namespace strata::decode {

struct DecodeServiceOptions {
  std::string node_id = "";
  std::string model_name = "";
  uint64_t incarnation = 0;
  // KV bytes one token takes at this node's codec (the router's reservation estimate).
  double kv_bytes_per_token = 0;
};

class DecodeService final : public strata::v1::DecodeNode::Service {
 public:
  // `engine` and `registry` must outlive the service.
  DecodeService(DecodeEngine* engine, DecodeServiceOptions options, prometheus::Registry* registry);

  grpc::Status Generate(grpc::ServerContext* context, const strata::v1::GenerateRequest* request,
                        grpc::ServerWriter<strata::v1::GenerateEvent>* writer) override;
  grpc::Status Load(grpc::ServerContext* context, const strata::v1::LoadRequest* request,
                    strata::v1::NodeLoad* response) override;

  // Brings the gauges and the engine-counted counters up to date (call it periodically; Load
  // calls it too).
  void Refresh();
  // Ends every open Generate with UNAVAILABLE (before the server shuts down).
  void Stop() { stopping_ = true; }

 private:
  DecodeEngine* const engine_;
  const DecodeServiceOptions options_;
  std::atomic<bool> stopping_{false};
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& tokens_;
  prometheus::Counter& cached_tokens_;
  prometheus::Histogram& first_token_seconds_;
  prometheus::Histogram& inter_token_seconds_;
  prometheus::Histogram& batch_size_;
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Gauge& kv_in_use_;
  prometheus::Gauge& kv_arrived_;
  prometheus::Counter& preemptions_;
  prometheus::Counter& resumed_;
  prometheus::Counter& bytes_received_;
  prometheus::Counter& blocks_stored_;
  prometheus::Counter& blocks_damaged_;
  prometheus::Counter& blocks_shared_;
  std::mutex refresh_mu_;
  DecodeStats last_ = {};      // guarded by refresh_mu_: what the counters already hold
  uint64_t last_damaged_ = 0;  // guarded by refresh_mu_: the receiver's checksum failures counted
};

}  // namespace strata::decode
