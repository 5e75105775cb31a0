// What every Strata serving process (strata-prefill, strata-decode, strata-router) does the same
// way: log lines that carry request ids, a Prometheus /metrics endpoint (prometheus-cpp), the
// model a cluster serves, and shutdown on SIGTERM / SIGINT.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/signals.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/server.h"
#include "grpcpp/server_context.h"
#include "kernels/calibration.h"
#include "kvstore/shared_tier_source.h"
#include "kvstore/store_client.h"
#include "membership/cluster_file.h"
#include "membership/etcd_membership.h"
#include "model/compute_backend.h"
#include "model/logprobs.h"
#include "model/sampler.h"
#include "model/served_format.h"
#include "model/tokenizer.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "proto/serving.pb.h"
#include "rpc/grpc_security.h"

namespace strata::serving {

// The process's logger (common/log.h), which the services' code calls as serving::Log.
using ::strata::Log;
using ::strata::SetLogIdentity;

// Makes --help list the flags defined in the binary's *_main.cc (absl matches the program's
// name otherwise, and strata-prefill's flags live in prefill_main.cc). Call before parsing.
void ConfigureFlagsUsage();

// How the processes stop (common/signals.h), which the mains call as serving::.
using ::strata::BlockTerminationSignals;
using ::strata::WaitForTermination;
using ::strata::WaitForTerminationFor;

// Serves `registry` at http://`address`/metrics. kInvalidArgument for a bad address,
// kUnavailable when the port cannot be bound.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetrics(
    const std::string& address, const std::shared_ptr<prometheus::Collectable>& registry);

// What a node serves, as the cluster file names it.
struct ServedModel {
  std::string name;  // the model folder's name
  model::ModelConfig config;
  uint64_t fingerprint = 0;                      // names its blocks (model::ModelFingerprint)
  std::unique_ptr<model::ComputeBackend> model;  // on the node's device; null from
                                                 // LoadServedModelIdentity
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::shared_ptr<const kernels::Calibration> calibration;  // null when the spec names none
};
// The format the cluster file names (codec, chunk, the served model's calibration) with the
// prefix keys `keys` (its chunk_tokens and cache salt ignored): what every node and the router
// of the cluster serve.
model::ServedFormat FormatOf(const membership::ClusterSpec& spec, const ServedModel& served,
                             const PrefixKeyOptions& keys = {});

// The KV bytes one token takes in the cluster's codec (every layer, K and V, metadata included):
// what a decode node announces and the router reserves by. fp16's when the codec cannot say.
double KvBytesPerToken(const membership::ClusterSpec& spec, const ServedModel& served);

absl::StatusOr<ServedModel> LoadServedModel(const std::string& model_dir,
                                            const std::string& calibration_path,
                                            const model::Device& device = {});
// The same without the weights (no backend: `model` null): what a router needs to name blocks
// and tokenize, read from the checkpoint's config, headers and tokenizer.
absl::StatusOr<ServedModel> LoadServedModelIdentity(const std::string& model_dir,
                                                    const std::string& calibration_path);

// The store the cluster file names, and with `local_ram_bytes` > 0 the node's own RAM tier in
// front of it (kvstore::TieredBlockSource); blocks() is what the engines take (null with
// neither). The store may start after the node: the client reconnects on its own, and a store
// that is down is only a miss.
struct StoreConnection {
  std::unique_ptr<kvstore::StoreClient> client;             // null when the file names no store
  std::unique_ptr<kvstore::StoreClientBlockSource> source;  // over `client`
  // With a shared tier: the tier, and `source` failing over to it while the store cannot answer.
  std::unique_ptr<kvstore::SharedTierBlockSource> shared;
  std::unique_ptr<kvstore::FailoverBlockSource> failover;
  std::unique_ptr<kvstore::BlockStore> local;          // the node's own tier, or null
  std::unique_ptr<kvstore::TieredBlockSource> tiered;  // `local` in front of the remote
  // What the store is to the node's engines: the local tier in front of the remote (the store,
  // failing over to the shared tier), whichever of these the node has.
  kvstore::BlockSource* remote() const {
    return failover != nullptr ? static_cast<kvstore::BlockSource*>(failover.get())
                               : static_cast<kvstore::BlockSource*>(source.get());
  }
  kvstore::BlockSource* blocks() const {
    return tiered != nullptr ? static_cast<kvstore::BlockSource*>(tiered.get()) : remote();
  }
};
// Connects to the cluster's store (spec.store; see UseNodeStoreFromFlags) with the node's own RAM
// tier of `local_ram_bytes` in front (0: none). With `shared_tier` (the --shared_tier flags), the
// store fails over to the shared tier while it cannot answer: a node whose host store is lost
// still finds what any host put in the shared tier, and recomputes only what nobody has. The tier
// is connected on first need (its Redis may come later).
absl::StatusOr<StoreConnection> ConnectStore(
    const membership::ClusterSpec& spec, std::shared_ptr<const rpc::GrpcSecurity> security,
    uint64_t local_ram_bytes = 0,
    const std::optional<kvstore::SharedTierOptions>& shared_tier = std::nullopt);

// GrpcSecurity::Load, and one log line saying what it is (with --insecure, the warning).
absl::StatusOr<std::shared_ptr<const rpc::GrpcSecurity>> LoadGrpcSecurity(
    const rpc::GrpcSecurityOptions& options);

// With `etcd` (host:port of its client URL) set, registers `self` under `prefix` with a lease of
// `ttl` renewed at half of it, and logs it; destroying the result deregisters. Null when `etcd`
// is empty (the cluster file is the membership).
absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> RegisterWithEtcd(
    const std::string& etcd, const std::string& prefix, const membership::NodeSpec& self,
    absl::Duration ttl);

// Exponential histogram buckets in seconds, 100 us .. ~100 s (for TTFT, inter-token, prefill).
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// This process's entry in the cluster file: kInvalidArgument naming --node when `id` is not a
// node of `role` there.
absl::StatusOr<membership::NodeSpec> FindNode(const membership::ClusterSpec& spec,
                                              const std::string& id, membership::Role role);
// This node's entry: the cluster file's (FindNode). With etcd (`etcd` true), a node the file
// does not list joins from its flags: `listen` (required then) is its gRPC address, and a decode
// node's transport is `transport`, or the listen host on any port.
absl::StatusOr<membership::NodeSpec> SelfNode(const membership::ClusterSpec& spec,
                                              const std::string& id, membership::Role role,
                                              bool etcd, const std::string& listen,
                                              const std::string& transport);

// Builds and starts a gRPC server for `service` on `address` ("host:port", port 0: any), secured
// by `security` (mutual TLS and the cluster token on every call, or with --insecure plaintext:
// then the warning is logged for this port); *port gets the port taken. kUnavailable when it
// cannot listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(grpc::Service* service,
                                                              const std::string& address,
                                                              const rpc::GrpcSecurity& security,
                                                              int* port);
// The same with several services on one port (null entries skipped).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::vector<grpc::Service*>& services, const std::string& address,
    const rpc::GrpcSecurity& security, int* port);

// The sampling options of a serving request (top_p 0, proto3's unset, reads as 1).
model::SamplingOptions SamplingFromProto(const strata::v1::Sampling& sampling);

// A token's logprobs on the wire (serving.proto's TokenLogprobs).
void LogprobsToProto(const model::TokenLogprobs& lp, strata::v1::TokenLogprobs* out);

// The deadline of the call `context` serves, as the request's deadline (InfiniteFuture when the
// caller set none).
absl::Time CallDeadline(const grpc::ServerContext& context);

// The `result` label of a request counter: ok, invalid, exhausted, cancelled or error.
const char* ResultLabel(absl::StatusCode code);

// One metric of a node's registry: a family registered under `name` and its series `labels`.
prometheus::Counter& AddCounter(prometheus::Registry* registry, const std::string& name,
                                const std::string& help, const prometheus::Labels& labels = {});
prometheus::Gauge& AddGauge(prometheus::Registry* registry, const std::string& name,
                            const std::string& help);
prometheus::Histogram& AddHistogram(prometheus::Registry* registry, const std::string& name,
                                    const std::string& help,
                                    prometheus::Histogram::BucketBoundaries buckets,
                                    const prometheus::Labels& labels = {});

// A random nonzero number identifying this process's life (NodeLoad.incarnation).
uint64_t NewIncarnation();

}  // namespace strata::serving
