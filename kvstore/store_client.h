// StoreClient: the Store service (proto/store.proto) with a Status API, for nodes and the router.
//
//   STRATA_ASSIGN_OR_RETURN(auto store, StoreClient::Connect("10.0.0.7:7070", absl::Seconds(2)));
//   STRATA_RETURN_IF_ERROR(store->Put(name, &parent_key, block));
//   STRATA_ASSIGN_OR_RETURN(LookupResult hit, store->Lookup(prefix, chain, layer_codecs));
//   STRATA_ASSIGN_OR_RETURN(SharedBytes bytes, store->Get(name));
//   auto watch = store->Watch(0, [&](const WatchUpdate& u) { index.Apply(u); });
//
// Errors are the service's codes (store_service.h) with messages "store ADDR: CODE: message".
// Every call has a deadline (StoreClientOptions::timeout: DEADLINE_EXCEEDED past it) and fails
// fast with UNAVAILABLE when the store cannot be reached (also when the TLS handshake fails: a
// certificate the other side does not accept); a store that refuses the cluster token answers
// UNAUTHENTICATED. The channel reconnects on its own
// (within max_reconnect_backoff) when the store comes back. Thread-safe: calls may run from
// many threads at once over the one channel.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kvstore/block_source.h"
#include "kvstore/block_store.h"
#include "proto/store.grpc.pb.h"
#include "rpc/grpc_security.h"

namespace strata::kvstore {

struct StoreClientOptions {
  // Deadline of every unary call, and of a Get or PutStream as a whole.
  absl::Duration timeout = absl::Seconds(5);
  // The largest block Put sends and Get accepts (a Get announcing more is refused).
  size_t max_block_bytes = size_t{64} << 20;
  // Bytes per streamed Get message asked of the server (0: the server's default, 1 MiB).
  uint32_t get_piece_bytes = 0;
  // Reconnection backoff bounds of the channel (gRPC's default maximum is two minutes).
  absl::Duration min_reconnect_backoff = absl::Milliseconds(100);
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // A Watch whose stream broke retries after this (doubling up to 8x).
  absl::Duration watch_retry = absl::Milliseconds(200);
  // TLS and the cluster token (grpc_security.h); null: insecure (plaintext, no token).
  std::shared_ptr<const rpc::GrpcSecurity> security = nullptr;

  absl::Status Validate() const;
};

// One thing a Watch reports, on the watch's own thread, in order. A consumer collects a
// snapshot's blocks and applies them at kSnapshotEnd (replacing what it knew of the store); a
// kDisconnected before the end voids the partial snapshot (the reconnection sends what is
// needed: live events after the last one delivered, or a new snapshot).
struct WatchUpdate {
  enum class Kind {
    kEvent,          // a live event: `event`, its id in event_id
    kSnapshotBlock,  // one present block of a snapshot (`event`, kind kStored)
    kSnapshotEnd,    // the snapshot is complete: it replaces all known of store_id
    kDisconnected,   // the stream broke (`status`); the watch reconnects on its own
  };
  Kind kind = Kind::kEvent;
  uint64_t store_id = 0;  // the store's incarnation; a new one means a restarted store
  uint64_t event_id = 0;  // kEvent: the event's id; kSnapshot*: the id the snapshot is as of
  BlockEvent event;       // kEvent and kSnapshotBlock
  absl::Status status;    // kDisconnected
};
using WatchCallback = std::function<void(const WatchUpdate&)>;

class StoreClient;

// A running Watch. Destroying it cancels the stream and joins its thread; the callback is not
// called after the destructor returns. Must not be destroyed from inside its own callback.
class StoreWatch {
 public:
  ~StoreWatch();
  StoreWatch(const StoreWatch&) = delete;
  StoreWatch& operator=(const StoreWatch&) = delete;

 private:
  friend class StoreClient;
  StoreWatch(StoreClient* client, uint64_t after_event_id, WatchCallback callback);
  void Run();
  // Waits `d` unless stopped first; false when stopped.
  bool SleepUnlessStopped(absl::Duration d);

  StoreClient* const client_;
  const WatchCallback callback_;
  uint64_t after_ = 0;     // the watch thread's
  uint64_t store_id_ = 0;  // the watch thread's
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;                   // guarded by mu_
  grpc::ClientContext* active_ = nullptr;  // guarded by mu_: the stream to cancel
  std::thread thread_;
};

class StoreClient {
 public:
  // Waits up to `timeout` for the store at `address` ("host:port") to accept a connection:
  // UNAVAILABLE when it does not. A zero `timeout` waits for nothing: the channel connects when
  // the store answers, and calls until then fail with UNAVAILABLE. The options are validated
  // (INVALID_ARGUMENT).
  static absl::StatusOr<std::unique_ptr<StoreClient>> Connect(const std::string& address,
                                                              absl::Duration timeout,
                                                              StoreClientOptions options = {});
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  const std::string& address() const { return address_; }

  // BlockStore::Lookup: layer l under layer_codec_fingerprints[l]; `prefix` gives the model and
  // calibration fingerprints.
  absl::StatusOr<LookupResult> Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                      absl::Span<const uint64_t> layer_codec_fingerprints);
  absl::Status Put(const BlockName& name, const BlockHash* parent, absl::Span<const uint8_t> block);
  absl::Status Put(const BlockName& name, const BlockHash* parent, const SharedBytes& block) {
    return Put(name, parent, block.span());
  }
  using PutItem = kvstore::PutItem;
  // Many Puts over one stream, in order: one status per item (what Put would have returned).
  // The call's own failure (the stream broke, the deadline) is the returned status.
  absl::StatusOr<std::vector<absl::Status>> PutMany(absl::Span<const PutItem> items);
  // The block's bytes, reassembled into one 64-byte-aligned buffer. NOT_FOUND on a miss;
  // DATA_LOSS when the stream is shorter or longer than it announced; RESOURCE_EXHAUSTED when it
  // announces more than max_block_bytes.
  absl::StatusOr<SharedBytes> Get(const BlockName& name);
  // Whether the block was stored (it and its descendants are gone now).
  absl::StatusOr<bool> Delete(const BlockName& name);
  absl::StatusOr<StoreStats> Stats();

  // Streams the store's events to `callback` on a thread of its own, from `after_event_id` (0:
  // a snapshot first), reconnecting (with after_event_id = the last id seen, so a gap or a
  // restarted store brings a snapshot) until the handle is destroyed. The client must outlive
  // the handle.
  std::unique_ptr<StoreWatch> Watch(uint64_t after_event_id, WatchCallback callback);

 private:
  friend class StoreWatch;
  StoreClient(std::string address, StoreClientOptions options,
              std::shared_ptr<grpc::Channel> channel);
  absl::Status Error(const grpc::Status& s) const;
  void SetDeadline(grpc::ClientContext* ctx) const;

  const std::string address_;
  const StoreClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<strata::v1::Store::Stub> stub_;
};

// A strata-store reached over gRPC as a BlockSource (`client` must outlive it). Blocks from Get
// crossed the network: they are verified once by whoever adopts them (verified_on_get false).
class StoreClientBlockSource final : public BlockSource {
 public:
  explicit StoreClientBlockSource(StoreClient* client) : client_(client) {}
  absl::StatusOr<uint32_t> Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                  absl::Span<const uint64_t> layer_codec_fingerprints) override {
    absl::StatusOr<LookupResult> r = client_->Lookup(prefix, chain, layer_codec_fingerprints);
    if (!r.ok()) return r.status();
    return r->chunks;
  }
  absl::StatusOr<SharedBytes> Get(const BlockName& name) override { return client_->Get(name); }
  absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block) override {
    return client_->Put(name, parent, block);
  }
  absl::StatusOr<std::vector<absl::Status>> PutMany(absl::Span<const PutItem> items) override {
    return client_->PutMany(items);
  }
  bool verified_on_get() const override { return false; }
  std::string Describe() const override { return "store " + client_->address(); }

 private:
  StoreClient* client_;
};

}  // namespace strata::kvstore
