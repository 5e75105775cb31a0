#include "kvstore/store_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/block_reader.h"
#include "grpcpp/server_builder.h"
#include "prometheus/family.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "rpc/grpc_keepalive.h"

namespace strata::kvstore {
namespace {

grpc::Status Invalid(const std::string& what) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what);
}

absl::StatusOr<BlockName> ParseName(const std::string& bytes, const char* field) {
  absl::StatusOr<BlockName> n = BlockName::Decode(bytes);
  if (!n.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", bytes.size(),
                                                   " bytes, not an encoded block name (",
                                                   BlockName::kEncodedBytes, " bytes)"));
  }
  return n;
}

bool ToKey(const std::string& bytes, BlockHash* key) {
  if (bytes.size() != key->size()) return false;
  std::copy(bytes.begin(), bytes.end(), key->begin());
  return true;
}

strata::v1::Tier ToProto(Tier t) {
  switch (t) {
    case Tier::kRam:
      return strata::v1::TIER_RAM;
    case Tier::kDisk:
      return strata::v1::TIER_DISK;
    default:
      return strata::v1::TIER_NONE;
  }
}

}  // namespace

namespace {

// Records the time from construction to destruction into a histogram.
class Timer {
 public:
  explicit Timer(prometheus::Histogram* h) : h_(h), t0_(std::chrono::steady_clock::now()) {}
  ~Timer() {
    h_->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
  }

 private:
  prometheus::Histogram* h_;
  std::chrono::steady_clock::time_point t0_;
};

prometheus::MetricFamily Family(const std::string& name, const std::string& help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

}  // namespace

// The store's counters and gauges, read at each scrape, and the RPC latency histograms.
class StoreService::Metrics final : public prometheus::Collectable {
 public:
  Metrics(BlockStore* store, SharedTier* shared) : shared(shared), store_(store) {
    prometheus::Family<prometheus::Histogram>& rpc = prometheus::BuildHistogram()
                                                         .Name("strata_store_rpc_seconds")
                                                         .Help("Store RPC latency")
                                                         .Register(registry_);
    prometheus::Histogram::BucketBoundaries b;
    for (double s = 25e-6; s < 4; s *= 2) b.push_back(s);
    for (const char* op : {"lookup", "put", "get", "delete"}) {
      latency.push_back(&rpc.Add({{"rpc", op}}, b));
    }
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    const StoreStats s = store_->Stats();
    std::vector<prometheus::MetricFamily> out = registry_.Collect();
    const std::pair<const char*, uint64_t> counters[] = {
        {"puts", s.puts},
        {"duplicate_puts", s.duplicate_puts},
        {"refused_puts", s.refused_puts},
        {"ram_hits", s.ram_hits},
        {"disk_hits", s.disk_hits},
        {"misses", s.misses},
        {"ram_evictions", s.ram_evictions},
        {"disk_evictions", s.disk_evictions},
        {"spills", s.spills},
        {"promotions", s.promotions},
        {"orphans_dropped", s.orphans_dropped},
        {"corruptions", s.corruptions},
        {"deletes", s.deletes},
        {"put_conflicts", s.put_conflicts},
        {"index_lost_blocks", s.index_lost_blocks},
        {"index_recovered_blocks", s.index_recovered_blocks},
        {"index_errors", s.index_errors}};
    for (const auto& [name, v] : counters) {
      out.push_back(Family(absl::StrCat("strata_store_", name, "_total"),
                           absl::StrCat("store ", name), prometheus::MetricType::Counter,
                           static_cast<double>(v)));
    }
    const std::pair<const char*, uint64_t> gauges[] = {
        {"ram_blocks", s.ram_blocks}, {"ram_bytes", s.ram_bytes},
        {"disk_blocks", s.disk_blocks}, {"disk_bytes", s.disk_bytes},
        {"spill_queue_bytes", s.spill_queue_bytes}};
    for (const auto& [name, v] : gauges) {
      out.push_back(Family(absl::StrCat("strata_store_", name), absl::StrCat("store ", name),
                           prometheus::MetricType::Gauge, static_cast<double>(v)));
    }
    if (const SharedTier* tier = shared.load(std::memory_order_acquire); tier != nullptr) {
      const SharedTierStats t = tier->Stats();
      const std::pair<const char*, double> shared[] = {
          {"hits", t.hits},
          {"misses", t.misses},
          {"damaged", t.damaged},
          {"puts", t.puts},
          {"put_errors", t.put_errors},
          {"get_errors", t.get_errors},
          {"read_bytes", t.bytes_read},
          {"written_bytes", t.bytes_written},
          {"get_seconds", t.get_seconds},
          {"put_seconds", t.put_seconds},
          {"redirections", t.redis.moved + t.redis.ask},
          {"retries", t.redis.retries},
          {"io_errors", t.redis.io_errors},
          {"connects", t.redis.connects},
          {"stale_connections", t.redis.stale},
          {"promoted_blocks", promoted_blocks.load()}};
      for (const auto& [name, v] : shared) {
        out.push_back(Family(absl::StrCat("strata_store_shared_", name, "_total"),
                             absl::StrCat("shared tier ", name), prometheus::MetricType::Counter,
                             v));
      }
    }
    return out;
  }

  std::vector<prometheus::Histogram*> latency;  // by Op
  std::atomic<uint64_t> promoted_blocks{0};     // from the shared tier into this store
  std::atomic<SharedTier*> shared;              // as StoreService::shared_

 private:
  BlockStore* const store_;
  prometheus::Registry registry_;
};

StoreService::StoreService(BlockStore* store, size_t max_block_bytes, SharedTier* shared)
    : metrics_(std::make_shared<Metrics>(store, shared)),
      store_(store),
      max_block_bytes_(max_block_bytes),
      shared_(shared) {
  for (int i = 0; i < kOps; ++i) latency_[i] = metrics_->latency[i];
}

void StoreService::SetSharedTier(SharedTier* shared) {
  metrics_->shared.store(shared, std::memory_order_release);
  shared_.store(shared, std::memory_order_release);
}

std::shared_ptr<prometheus::Collectable> StoreService::metrics() const { return metrics_; }

std::string StoreService::RenderMetrics() const {
  return prometheus::TextSerializer().Serialize(metrics_->Collect());
}

grpc::Status StoreService::Lookup(grpc::ServerContext*, const strata::v1::LookupRequest* req,
                                  strata::v1::LookupResponse* resp) {
  Timer timer(latency_[kLookup]);
  constexpr int kMaxLayers = 4096;
  const int per_layer = req->layer_codec_fingerprints_size();
  if (per_layer > kMaxLayers) {
    return Invalid(absl::StrCat("lookup: layer_codec_fingerprints has ", per_layer,
                                " entries, more than ", kMaxLayers, " layers"));
  }
  if (per_layer > 0 && req->layers() != 0 && req->layers() != static_cast<uint32_t>(per_layer)) {
    return Invalid(absl::StrCat("lookup: layers ", req->layers(),
                                " disagrees with the ", per_layer,
                                " entries of layer_codec_fingerprints"));
  }
  if (per_layer == 0 && (req->layers() < 1 || req->layers() > kMaxLayers)) {
    return Invalid(absl::StrCat("lookup: layers ", req->layers(), " not in [1, ", kMaxLayers,
                                "] (and no layer_codec_fingerprints)"));
  }
  if (req->chain_size() > 1 << 20) return Invalid("lookup: chain longer than 2^20 chunks");
  std::vector<BlockHash> chain(req->chain_size());
  for (int i = 0; i < req->chain_size(); ++i) {
    if (!ToKey(req->chain(i), &chain[i])) {
      return Invalid(absl::StrCat("lookup: chain[", i, "] is ", req->chain(i).size(),
                                  " bytes, not a 32-byte prefix key"));
    }
  }
  BlockName prefix;
  prefix.model_fingerprint = req->model_fingerprint();
  prefix.codec_fingerprint = req->codec_fingerprint();
  prefix.calibration_fingerprint = req->calibration_fingerprint();
  const std::vector<uint64_t> fps =
      per_layer > 0 ? std::vector<uint64_t>(req->layer_codec_fingerprints().begin(),
                                            req->layer_codec_fingerprints().end())
                    : std::vector<uint64_t>(req->layers(), req->codec_fingerprint());
  LookupResult r = store_->Lookup(prefix, chain, fps);
  if (shared_.load(std::memory_order_acquire) != nullptr && r.chunks < chain.size() &&
      Promote(prefix, chain, fps, r.chunks) > 0) {
    r = store_->Lookup(prefix, chain, fps);  // now with the promoted chunks
  }
  resp->set_chunks(r.chunks);
  for (Tier t : r.tiers) resp->add_tiers(ToProto(t));
  return grpc::Status::OK;
}

absl::Status StoreService::PutOne(const strata::v1::PutRequest& req) {
  absl::StatusOr<BlockName> name = ParseName(req.name(), "put: name");
  if (!name.ok()) return name.status();
  BlockHash parent;
  const bool has_parent = !req.parent_key().empty();
  if (has_parent && !ToKey(req.parent_key(), &parent)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "put: parent_key is ", req.parent_key().size(), " bytes, not a 32-byte prefix key"));
  }
  if (req.block().size() > max_block_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("put: block of ", req.block().size(),
                                                   " bytes exceeds ", max_block_bytes_));
  }
  const absl::Status s = store_->Put(
      *name, has_parent ? &parent : nullptr,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(req.block().data()),
                          req.block().size()));
  // A corrupt block is a bad argument of this call (the store's kDataLoss is about its own
  // bytes).
  if (s.code() == absl::StatusCode::kDataLoss) return absl::InvalidArgumentError(s.message());
  SharedTier* const shared = shared_.load(std::memory_order_acquire);
  if (shared != nullptr && s.ok()) {
    // Written through to the cluster's tier; its failure is counted there, not this call's. Only
    // bytes the store took (and verified): a conflicting block (kAlreadyExists) would replace the
    // first writer's in Redis. The request's bytes, borrowed: Put reads them during the call.
    const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(req.block().data()),
                                          req.block().size());
    absl::StatusOr<BlockView> view = BlockView::Parse(bytes, {.verify_checksum = false});
    if (view.ok()) {
      (void)shared->Put({{.name = *name,
                          .chunk_index = view->header().chunk_index,
                          .block = SharedBytes(bytes, nullptr),
                          .checksum_verified = true}});
    }
  }
  return s;
}

size_t StoreService::Promote(const BlockName& prefix, absl::Span<const BlockHash> chain,
                             absl::Span<const uint64_t> fps, size_t first) {
  const size_t end = std::min(chain.size(), first + kMaxPromotedChunks);
  std::vector<SharedTier::Key> keys;
  for (size_t c = first; c < end; ++c) {
    for (size_t l = 0; l < fps.size(); ++l) {
      BlockName n = prefix;
      n.codec_fingerprint = fps[l];
      n.key = chain[c];
      n.layer = static_cast<uint32_t>(l);
      keys.push_back({n, static_cast<uint32_t>(c)});
    }
  }
  std::vector<absl::StatusOr<SharedBytes>> got = shared_.load(std::memory_order_acquire)->Get(keys);
  size_t promoted = 0;
  for (size_t c = first; c < end; ++c) {
    const size_t base = (c - first) * fps.size();
    bool whole = true;
    for (size_t l = 0; l < fps.size() && whole; ++l) whole = got[base + l].ok();
    if (!whole) break;  // a chunk is only useful after its whole prefix
    const BlockHash* parent = c > 0 ? &chain[c - 1] : nullptr;
    bool stored = true;
    for (size_t l = 0; l < fps.size() && stored; ++l) {
      const absl::Status s = store_->Put(keys[base + l].name, parent, *got[base + l]);
      stored = s.ok() || s.code() == absl::StatusCode::kAlreadyExists;
      if (s.ok()) metrics_->promoted_blocks.fetch_add(1);
    }
    if (!stored) break;
    ++promoted;
  }
  return promoted;
}

grpc::Status StoreService::Put(grpc::ServerContext*, const strata::v1::PutRequest* req,
                               strata::v1::PutResponse*) {
  Timer timer(latency_[kPut]);
  return rpc::ToGrpc(PutOne(*req));
}

grpc::Status StoreService::PutStream(grpc::ServerContext*,
                                     grpc::ServerReader<strata::v1::PutRequest>* reader,
                                     strata::v1::PutStreamResponse* resp) {
  strata::v1::PutRequest req;
  uint32_t stored = 0;
  while (reader->Read(&req)) {
    Timer timer(latency_[kPut]);
    const absl::Status s = PutOne(req);
    strata::v1::PutResult* r = resp->add_results();
    r->set_code(static_cast<int32_t>(s.code()));
    if (!s.ok()) r->set_message(std::string(s.message()));
    stored += s.ok();
  }
  resp->set_stored(stored);
  return grpc::Status::OK;
}

grpc::Status StoreService::Get(grpc::ServerContext* ctx, const strata::v1::GetRequest* req,
                               grpc::ServerWriter<strata::v1::GetResponse>* writer) {
  Timer timer(latency_[kGet]);
  absl::StatusOr<BlockName> name = ParseName(req->name(), "get: name");
  if (!name.ok()) return Invalid(std::string(name.status().message()));
  absl::StatusOr<Lease> lease = store_->Get(*name);
  if (!lease.ok()) return rpc::ToGrpc(lease.status());
  const size_t piece = req->max_chunk_bytes() == 0 ? size_t{1} << 20
                                                   : std::max<size_t>(4096, req->max_chunk_bytes());
  const absl::Span<const uint8_t> bytes = lease->bytes();
  for (size_t off = 0; off < bytes.size() || off == 0; off += piece) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "get: cancelled");
    strata::v1::GetResponse r;
    const size_t n = std::min(piece, bytes.size() - off);
    r.set_data(reinterpret_cast<const char*>(bytes.data() + off), n);
    if (off == 0) {
      r.set_total_bytes(bytes.size());
      r.set_tier(ToProto(lease->served_from()));
    }
    if (!writer->Write(r)) return grpc::Status(grpc::StatusCode::CANCELLED, "get: client gone");
    if (bytes.empty()) break;
  }
  return grpc::Status::OK;
}

grpc::Status StoreService::Delete(grpc::ServerContext*, const strata::v1::DeleteRequest* req,
                                  strata::v1::DeleteResponse* resp) {
  Timer timer(latency_[kDelete]);
  absl::StatusOr<BlockName> name = ParseName(req->name(), "delete: name");
  if (!name.ok()) return Invalid(std::string(name.status().message()));
  resp->set_deleted(store_->Delete(*name));
  return grpc::Status::OK;
}

grpc::Status StoreService::Stats(grpc::ServerContext*, const strata::v1::StatsRequest*,
                                 strata::v1::StatsResponse* resp) {
  const StoreStats s = store_->Stats();
  auto& m = *resp->mutable_counters();
  m["puts"] = s.puts;
  m["duplicate_puts"] = s.duplicate_puts;
  m["refused_puts"] = s.refused_puts;
  m["ram_hits"] = s.ram_hits;
  m["disk_hits"] = s.disk_hits;
  m["misses"] = s.misses;
  m["ram_evictions"] = s.ram_evictions;
  m["disk_evictions"] = s.disk_evictions;
  m["spills"] = s.spills;
  m["promotions"] = s.promotions;
  m["orphans_dropped"] = s.orphans_dropped;
  m["corruptions"] = s.corruptions;
  m["deletes"] = s.deletes;
  m["put_conflicts"] = s.put_conflicts;
  m["index_lost_blocks"] = s.index_lost_blocks;
  m["index_recovered_blocks"] = s.index_recovered_blocks;
  m["index_errors"] = s.index_errors;
  m["ram_blocks"] = s.ram_blocks;
  m["ram_bytes"] = s.ram_bytes;
  m["disk_blocks"] = s.disk_blocks;
  m["disk_bytes"] = s.disk_bytes;
  m["spill_queue_bytes"] = s.spill_queue_bytes;
  m["pool_idle_bytes"] = s.pool_idle_bytes;
  m["pool_reuses"] = s.pool_reuses;
  return grpc::Status::OK;
}

grpc::Status StoreService::Watch(grpc::ServerContext* ctx, const strata::v1::WatchRequest* req,
                                 grpc::ServerWriter<strata::v1::BlockEvent>* writer) {
  const uint64_t store_id = store_->store_id();
  uint64_t after = req->after_event_id();
  bool need_snapshot = after == 0 || (req->store_id() != 0 && req->store_id() != store_id);
  const grpc::Status gone(grpc::StatusCode::CANCELLED, "watch: client gone");
  strata::v1::BlockEvent msg;
  while (!stopping_.load() && !ctx->IsCancelled()) {
    if (!need_snapshot) {
      // Waits at most kWatchPoll, so cancellation and Stop() are noticed that soon.
      const EventRead r = store_->ReadEvents(after, 1024, kWatchPoll);
      need_snapshot = r.gap;
      for (const BlockEvent& e : r.events) {
        msg.Clear();
        msg.set_store_id(store_id);
        msg.set_event_id(e.id);
        msg.set_kind(e.kind == BlockEventKind::kStored ? strata::v1::BLOCK_STORED
                                                       : strata::v1::BLOCK_REMOVED);
        msg.set_name(e.name.Encode());
        msg.set_tier(ToProto(e.tier));
        if (!writer->Write(msg)) return gone;
        after = e.id;
      }
    }
    if (need_snapshot) {
      const StoreSnapshot snap = store_->Snapshot();
      for (const StoredBlock& b : snap.blocks) {
        msg.Clear();
        msg.set_store_id(store_id);
        msg.set_event_id(snap.event_id);
        msg.set_kind(strata::v1::BLOCK_STORED);
        msg.set_name(b.name.Encode());
        msg.set_tier(ToProto(b.tier));
        msg.set_snapshot(true);
        if (!writer->Write(msg)) return gone;
      }
      msg.Clear();
      msg.set_store_id(store_id);
      msg.set_event_id(snap.event_id);
      msg.set_snapshot(true);
      msg.set_snapshot_end(true);
      if (!writer->Write(msg)) return gone;
      after = snap.event_id;
      need_snapshot = false;
    }
  }
  if (stopping_.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch: the store is shutting down");
  }
  return gone;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartStoreServer(StoreService* service,
                                                               const std::string& address,
                                                               size_t max_block_bytes, int* port,
                                                               const rpc::GrpcSecurity* security) {
  grpc::ServerBuilder b;
  rpc::AcceptClientKeepalive(&b);
  b.AddListeningPort(address,
                     security != nullptr ? security->ServerCredentials()
                                         : grpc::InsecureServerCredentials(),
                     port);
  b.RegisterService(service);
  const int limit = static_cast<int>(std::min<size_t>(max_block_bytes + (1 << 20), INT32_MAX));
  b.SetMaxReceiveMessageSize(limit);
  b.SetMaxSendMessageSize(limit);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("strata-store: cannot listen on ", address));
  }
  return server;
}

void StopStoreServer(grpc::Server* server, StoreService* service, absl::Duration grace) {
  service->Stop();
  server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
}

}  // namespace strata::kvstore
