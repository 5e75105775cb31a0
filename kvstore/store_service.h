// The Store gRPC service (proto/store.proto) over a BlockStore, and the pieces strata-store
// needs to serve it. Every request is validated before it reaches the store: names of the wrong
// size, keys that are not 32 bytes, oversized blocks, corrupt blocks, empty chains and
// layer_codec_fingerprints that disagree with `layers` get INVALID_ARGUMENT with a message that
// says which field; misses are NOT_FOUND; a block whose parent is not stored is
// FAILED_PRECONDITION; another block under a name already stored is ALREADY_EXISTS (the first
// writer's stays); a chunk's block without its parent key, or a first chunk's with one, is
// INVALID_ARGUMENT. PutStream answers each block with what Put would have (in order), and
// fails as a whole only when the stream breaks. Watch streams the store's block events (a
// snapshot first when the client has none or fell behind, see BlockEvent in store.proto) until
// the client cancels (CANCELLED) or Stop() (UNAVAILABLE).
//
// Thread-safe; the store must outlive the service, and the service the server.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "kvstore/block_store.h"
#include "kvstore/shared_tier.h"
#include "prometheus/collectable.h"
#include "prometheus/histogram.h"
#include "proto/store.grpc.pb.h"
#include "rpc/grpc_security.h"
#include "rpc/grpc_status.h"

namespace strata::kvstore {

class StoreService final : public strata::v1::Store::Service {
 public:
  // `shared` (optional; must outlive the service): the cluster-wide tier behind this store
  // (shared_tier.h). Every block put here is written through to it (its failure counted, not the
  // caller's); a Lookup whose chain runs past what this store holds reads the next chunks from it
  // — every layer of a chunk, in one pipelined call, up to kMaxPromotedChunks — and promotes the
  // whole chunks it finds into this store, so the Gets that follow are local.
  StoreService(BlockStore* store, size_t max_block_bytes, SharedTier* shared = nullptr);
  static constexpr size_t kMaxPromotedChunks = 64;

  // Installs the shared tier once it answers (a store started while Redis was away serves alone
  // until then): from the next call on, Puts write through and Lookups read it. `shared` must
  // outlive the service; once installed it stays. Thread-safe.
  void SetSharedTier(SharedTier* shared);

  grpc::Status Lookup(grpc::ServerContext*, const strata::v1::LookupRequest* req,
                      strata::v1::LookupResponse* resp) override;
  grpc::Status Put(grpc::ServerContext*, const strata::v1::PutRequest* req,
                   strata::v1::PutResponse* resp) override;
  grpc::Status PutStream(grpc::ServerContext*, grpc::ServerReader<strata::v1::PutRequest>* reader,
                         strata::v1::PutStreamResponse* resp) override;
  grpc::Status Get(grpc::ServerContext*, const strata::v1::GetRequest* req,
                   grpc::ServerWriter<strata::v1::GetResponse>* writer) override;
  grpc::Status Delete(grpc::ServerContext*, const strata::v1::DeleteRequest* req,
                      strata::v1::DeleteResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext*, const strata::v1::StatsRequest* req,
                     strata::v1::StatsResponse* resp) override;
  grpc::Status Watch(grpc::ServerContext*, const strata::v1::WatchRequest* req,
                     grpc::ServerWriter<strata::v1::BlockEvent>* writer) override;

  // Ends open Watch streams (UNAVAILABLE) within kWatchPoll and refuses new ones, so that a
  // server shutdown does not wait on them. Irreversible.
  void Stop() { stopping_.store(true); }

  // The service's metrics (prometheus-cpp): the store's counters and gauges, read from
  // BlockStore::Stats at each scrape, and per-RPC latency histograms. Register it with an
  // Exposer (strata-store does); it must outlive its registration there.
  std::shared_ptr<prometheus::Collectable> metrics() const;
  // The same as Prometheus text (tests).
  std::string RenderMetrics() const;

  // How often a Watch stream with nothing to send checks for cancellation and Stop().
  static constexpr absl::Duration kWatchPoll = absl::Milliseconds(100);

 private:
  enum Op { kLookup, kPut, kGet, kDelete, kOps };
  absl::Status PutOne(const strata::v1::PutRequest& req);
  // Promotes chunks [first, ...) of `chain` from the shared tier; the chunks promoted.
  size_t Promote(const BlockName& prefix, absl::Span<const BlockHash> chain,
                 absl::Span<const uint64_t> layer_codec_fingerprints, size_t first);
  class Metrics;
  std::shared_ptr<Metrics> metrics_;
  prometheus::Histogram* latency_[kOps] = {};
  BlockStore* store_;
  size_t max_block_bytes_;
  std::atomic<SharedTier*> shared_;
  std::atomic<bool> stopping_{false};
};

// Starts a gRPC server for `service` on `address` ("host:port"; port 0 picks one). The bound
// port is written to *port. Message size limits follow max_block_bytes. `security` (null:
// insecure) secures the port: with TLS every call needs a client certificate from the CA and
// the cluster token (UNAUTHENTICATED without), Puts and Gets as every other RPC.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartStoreServer(
    StoreService* service, const std::string& address, size_t max_block_bytes, int* port,
    const rpc::GrpcSecurity* security = nullptr);

// Stops `service`'s Watch streams and shuts `server` down, cancelling calls still running after
// `grace`. Returns once every handler has returned.
void StopStoreServer(grpc::Server* server, StoreService* service,
                     absl::Duration grace = absl::Seconds(1));

}  // namespace strata::kvstore
