#include "serving/node_process.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <random>

#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "kernels/codec.h"
#include "model/config.h"
#include "model/llama.h"
#include "rpc/grpc_keepalive.h"

namespace strata::serving {

void ConfigureFlagsUsage() {
  absl::FlagsUsageConfig config;
  auto ours = [](absl::string_view file) {
    // Mains, serving/, and the flag sets shared by several processes (rpc/, kvstore/ *_flags.cc).
    return absl::EndsWith(file, "_main.cc") || absl::StrContains(file, "/serving/") ||
           absl::EndsWith(file, "_flags.cc");
  };
  config.contains_help_flags = ours;
  config.contains_helpshort_flags = ours;
  absl::SetFlagsUsageConfig(config);
}

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetrics(
    const std::string& address, const std::shared_ptr<prometheus::Collectable>& registry) {
  if (absl::Status s = membership::ValidateHostPort(address, "metrics address"); !s.ok()) return s;
  try {
    auto exposer = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1);
    exposer->RegisterCollectable(registry);
    return exposer;
  } catch (const std::exception& e) {
    // civetweb (under prometheus-cpp) reports a port it cannot bind by throwing.
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
}

model::ServedFormat FormatOf(const membership::ClusterSpec& spec, const ServedModel& served,
                             const PrefixKeyOptions& keys) {
  model::ServedFormat f{.codec = spec.codec,
                        .chunk_tokens = spec.chunk_tokens,
                        .calibration = served.calibration,
                        .keys = keys};
  f.keys.chunk_tokens = spec.chunk_tokens;
  f.keys.cache_salt.clear();
  return f;
}

double KvBytesPerToken(const membership::ClusterSpec& spec, const ServedModel& served) {
  const model::ModelConfig& config = served.config;
  double bits = 16;
  if (absl::StatusOr<std::unique_ptr<kernels::Codec>> codec =
          kernels::Codec::Create(spec.codec, served.calibration);
      codec.ok()) {
    if (absl::StatusOr<double> b =
            (*codec)->BitsPerElement(spec.chunk_tokens, config.num_kv_heads, config.head_dim);
        b.ok()) {
      bits = *b;
    }
  }
  return bits / 8.0 * 2.0 * config.num_layers * config.num_kv_heads * config.head_dim;
}

absl::StatusOr<ServedModel> LoadServedModelIdentity(const std::string& model_dir,
                                                    const std::string& calibration_path) {
  ServedModel m;
  m.name = std::filesystem::path(model_dir).lexically_normal().filename().string();
  if (m.name.empty()) m.name = std::filesystem::path(model_dir).parent_path().filename().string();
  STRATA_ASSIGN_OR_RETURN(m.config, model::LoadModelConfig(model_dir));
  STRATA_ASSIGN_OR_RETURN(m.fingerprint, model::ModelFingerprint(model_dir));
  absl::StatusOr<std::unique_ptr<model::Tokenizer>> tok = model::Tokenizer::Load(model_dir);
  if (!tok.ok()) return tok.status();
  m.tokenizer = *std::move(tok);
  if (!calibration_path.empty()) {
    absl::StatusOr<kernels::Calibration> c = kernels::Calibration::Load(calibration_path);
    if (!c.ok()) return c.status();
    m.calibration = std::make_shared<kernels::Calibration>(*std::move(c));
  }
  return m;
}

absl::StatusOr<ServedModel> LoadServedModel(const std::string& model_dir,
                                            const std::string& calibration_path,
                                            const model::Device& device) {
  STRATA_ASSIGN_OR_RETURN(ServedModel m, LoadServedModelIdentity(model_dir, calibration_path));
  absl::StatusOr<std::unique_ptr<model::ComputeBackend>> model =
      model::LoadComputeBackend(model_dir, device);
  if (!model.ok()) return model.status();
  m.model = *std::move(model);
  return m;
}

absl::StatusOr<StoreConnection> ConnectStore(
    const membership::ClusterSpec& spec, std::shared_ptr<const rpc::GrpcSecurity> security,
    uint64_t local_ram_bytes, const std::optional<kvstore::SharedTierOptions>& shared_tier) {
  StoreConnection c;
  if (!spec.store.empty()) {
    absl::StatusOr<std::unique_ptr<kvstore::StoreClient>> client =
        kvstore::StoreClient::Connect(spec.store, absl::Seconds(5), {.security = security});
    if (absl::IsUnavailable(client.status())) {
      // Not up yet (or away): start without it; its calls are misses until it answers.
      Log("", absl::StrCat(client.status().message(),
                           "; starting without it (misses until it answers)"));
      client = kvstore::StoreClient::Connect(spec.store, absl::ZeroDuration(),
                                             {.security = std::move(security)});
    }
    if (!client.ok()) return client.status();
    c.client = *std::move(client);
    c.source = std::make_unique<kvstore::StoreClientBlockSource>(c.client.get());
    if (shared_tier.has_value()) {
      c.shared = std::make_unique<kvstore::SharedTierBlockSource>(*shared_tier);
      c.failover = std::make_unique<kvstore::FailoverBlockSource>(c.source.get(), c.shared.get());
      Log("",
          absl::StrCat("store ", spec.store, "; while it cannot answer, ", c.shared->Describe()));
    }
  }
  if (local_ram_bytes > 0) {
    absl::StatusOr<std::unique_ptr<kvstore::BlockStore>> local =
        kvstore::BlockStore::Open({.ram_bytes = local_ram_bytes});
    if (!local.ok()) return local.status();
    c.local = *std::move(local);
    c.tiered = std::make_unique<kvstore::TieredBlockSource>(c.local.get(), c.remote());
  }
  return c;
}

absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> RegisterWithEtcd(
    const std::string& etcd, const std::string& prefix, const membership::NodeSpec& self,
    absl::Duration ttl) {
  if (etcd.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> r =
      membership::EtcdRegistration::Start(membership::NewHttpEtcdClient(etcd), prefix, self, ttl);
  if (r.ok()) {
    Log("", absl::StrCat("registered in etcd ", etcd, " as ", prefix, "nodes/", self.id, " (lease ",
                         absl::FormatDuration(ttl), ")"));
  }
  return r;
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 1e-4; s < 120; s *= 2) b.push_back(s);
  return b;
}

absl::StatusOr<membership::NodeSpec> FindNode(const membership::ClusterSpec& spec,
                                              const std::string& id, membership::Role role) {
  const membership::NodeSpec* node = spec.Find(id);
  if (node == nullptr || node->role != role) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--node: '", id, "' is not a ", membership::RoleName(role), " node of ", spec.path));
  }
  return *node;
}

absl::StatusOr<membership::NodeSpec> SelfNode(const membership::ClusterSpec& spec,
                                              const std::string& id, membership::Role role,
                                              bool etcd, const std::string& listen,
                                              const std::string& transport) {
  absl::StatusOr<membership::NodeSpec> listed = FindNode(spec, id, role);
  if (listed.ok() || !etcd || spec.Find(id) != nullptr) return listed;
  if (!membership::ValidNodeId(id)) {
    return absl::InvalidArgumentError(absl::StrCat("--node: '", id, "' ", membership::kNodeIdRule));
  }
  if (listen.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--node: '", id, "' is not in ", spec.path,
        "; to join through etcd alone, give its gRPC address with --listen HOST:PORT"));
  }
  STRATA_RETURN_IF_ERROR(membership::ValidateHostPort(listen, "--listen"));
  membership::NodeSpec n;
  n.id = id;
  n.role = role;
  n.grpc = listen;
  if (role == membership::Role::kDecode) {
    n.transport = transport.empty() ? JoinHostPort(ParseHostPort(listen)->host, 0) : transport;
  }
  return n;
}

absl::StatusOr<std::shared_ptr<const rpc::GrpcSecurity>> LoadGrpcSecurity(
    const rpc::GrpcSecurityOptions& options) {
  absl::StatusOr<std::shared_ptr<const rpc::GrpcSecurity>> s = rpc::GrpcSecurity::Load(options);
  if (s.ok()) Log("", (*s)->insecure() ? (*s)->Describe() : "security: " + (*s)->Describe());
  return s;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(grpc::Service* service,
                                                              const std::string& address,
                                                              const rpc::GrpcSecurity& security,
                                                              int* port) {
  return StartGrpcServer(std::vector<grpc::Service*>{service}, address, security, port);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::vector<grpc::Service*>& services, const std::string& address,
    const rpc::GrpcSecurity& security, int* port) {
  if (security.insecure()) Log("", absl::StrCat(security.Describe(), " (gRPC on ", address, ")"));
  grpc::ServerBuilder b;
  rpc::AcceptClientKeepalive(&b);
  b.AddListeningPort(address, security.ServerCredentials(), port);
  for (grpc::Service* service : services) {
    if (service != nullptr) b.RegisterService(service);
  }
  b.SetMaxReceiveMessageSize(64 << 20);  // a prompt of a few million tokens at most
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  return server;
}

model::SamplingOptions SamplingFromProto(const strata::v1::Sampling& sampling) {
  model::SamplingOptions o;
  o.temperature = sampling.temperature();
  o.top_k = sampling.top_k();
  o.top_p = sampling.top_p() == 0.0f ? 1.0f : sampling.top_p();
  o.seed = sampling.seed();
  o.min_p = sampling.min_p();
  o.presence_penalty = sampling.presence_penalty();
  o.frequency_penalty = sampling.frequency_penalty();
  o.repetition_penalty =
      sampling.repetition_penalty() == 0.0f ? 1.0f : sampling.repetition_penalty();
  return o;
}

void LogprobsToProto(const model::TokenLogprobs& lp, strata::v1::TokenLogprobs* out) {
  out->set_logprob(lp.logprob);
  for (const auto& [token, logprob] : lp.top) {
    strata::v1::TopLogprob* t = out->add_top();
    t->set_token(token);
    t->set_logprob(logprob);
  }
}

absl::Time CallDeadline(const grpc::ServerContext& context) {
  const std::chrono::system_clock::time_point d = context.deadline();
  // gRPC reports "no deadline" as the clock's far end (or near it, after conversions).
  if (d >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(d);
}

const char* ResultLabel(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return "ok";
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kAlreadyExists:
      return "invalid";
    case absl::StatusCode::kResourceExhausted:
      return "exhausted";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    default:
      return "error";
  }
}

prometheus::Counter& AddCounter(prometheus::Registry* registry, const std::string& name,
                                const std::string& help, const prometheus::Labels& labels) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(*registry).Add(labels);
}

prometheus::Gauge& AddGauge(prometheus::Registry* registry, const std::string& name,
                            const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(*registry).Add({});
}

prometheus::Histogram& AddHistogram(prometheus::Registry* registry, const std::string& name,
                                    const std::string& help,
                                    prometheus::Histogram::BucketBoundaries buckets,
                                    const prometheus::Labels& labels) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(*registry).Add(labels,
                                                                                    buckets);
}

uint64_t NewIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  return v;
}

}  // namespace strata::serving
