// The Store gRPC service (proto/store.proto) over a BlockStore, and the pieces strata-store
// needs to serve it. Every request is validated before it reaches the store: names of the wrong
// size, keys that are not 32 bytes, oversized blocks, corrupt blocks and empty chains get
// INVALID_ARGUMENT with a message that says which field; misses are NOT_FOUND; a block whose
// parent is not stored is FAILED_PRECONDITION.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "kvstore/block_store.h"
#include "grpcpp/server.h"
#include "proto/store.grpc.pb.h"

namespace strata::kvstore {

class StoreService final : public strata::v1::Store::Service {
 public:
  explicit StoreService(BlockStore* store, size_t max_block_bytes)
      : store_(store), max_block_bytes_(max_block_bytes) {}

  grpc::Status Lookup(grpc::ServerContext*, const strata::v1::LookupRequest* req,
                      strata::v1::LookupResponse* resp) override;
  grpc::Status Put(grpc::ServerContext*, const strata::v1::PutRequest* req,
                   strata::v1::PutResponse* resp) override;
  grpc::Status Get(grpc::ServerContext*, const strata::v1::GetRequest* req,
                   grpc::ServerWriter<strata::v1::GetResponse>* writer) override;
  grpc::Status Delete(grpc::ServerContext*, const strata::v1::DeleteRequest* req,
                      strata::v1::DeleteResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext*, const strata::v1::StatsRequest* req,
                     strata::v1::StatsResponse* resp) override;

  // Prometheus text: the store's counters and gauges, and per-RPC latency histograms.
  std::string RenderMetrics() const;

 private:
  enum Op { kLookup, kPut, kGet, kDelete, kOps };
  LatencyHistogram latency_[kOps];
  BlockStore* store_;
  size_t max_block_bytes_;
};

grpc::Status ToGrpc(const absl::Status& s);

// Starts a gRPC server for `service` on `address` ("host:port"; port 0 picks one). The bound
// port is written to *port. Message size limits follow max_block_bytes.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartStoreServer(StoreService* service,
                                                               const std::string& address,
                                                               size_t max_block_bytes, int* port);

}  // namespace strata::kvstore
