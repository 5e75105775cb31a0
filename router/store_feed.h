// StoreFeed: turns a block store's Watch stream (kvstore/store_client.h) into PrefixIndex
// events for the holder that stands for it: the shared store (HolderKind::kStore), or a prefill
// node's own RAM tier (HolderKind::kNode, the holder id being the node's id).
//
//   StoreFeed feed(&index, "store", layer_names);
//   auto watch = client->Watch(0, [&](const kvstore::WatchUpdate& u) { feed.OnUpdate(u); });
//
// The store keeps blocks by (chunk key, layer) and reports each block; the index keeps chunk
// keys. A prefill node Puts a chunk's blocks layer by layer, parents first, so:
// - a live Stored event counts as the chunk being stored when it is the block of the LAST layer;
// - a live Removed event of ANY layer removes the chunk (a chunk missing one layer is useless);
// - a snapshot lists a chunk only when the blocks of all its layers are present.
// Blocks of other models, codecs or calibrations (another BlockName namespace than
// `layer_names`) do not count. Every store event still advances the holder's cursor (as an
// event with no keys), since the index expects the store's consecutive event ids.
//
// Tiers: the store reports no moves between its tiers, and the routing policy credits every
// store chunk alike, so the feed files every chunk under HolderTier::kRam.
//
// Incarnations: the store's store_id is random per start; the index wants a growing number, so
// each new store_id seen becomes the next incarnation (1, 2, ...; the holder is registered at 0).
//
// Resync: if the index answers kGap (events were lost, which the watch's own reconnection should
// prevent), resync_needed() turns true: the owner restarts the watch from event 0 (a snapshot).
//
// Thread safety: OnUpdate is called from one thread at a time (the watch's); the accessors may
// be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/prefix_key.h"
#include "kvstore/store_client.h"
#include "router/prefix_index.h"

namespace strata::router {

struct StoreFeedStats {
  uint64_t events = 0;           // live events applied (any namespace)
  uint64_t chunks_stored = 0;    // live Stored events of a last layer, ours
  uint64_t chunks_removed = 0;   // live Removed events, ours
  uint64_t snapshots = 0;        // snapshots applied
  uint64_t snapshot_chunks = 0;  // chunks in the last snapshot
  uint64_t disconnects = 0;
  uint64_t gaps = 0;
};

class StoreFeed {
 public:
  // `index` must outlive the feed. `layer_names[l]` is the name of this model's layer-l blocks
  // (its key is ignored): model, codec and calibration fingerprints. Registers `holder_id` as a
  // kStore holder at incarnation 0 (an error from RegisterHolder is returned by status()).
  StoreFeed(PrefixIndex* index, std::string holder_id, std::vector<BlockName> layer_names,
            HolderKind kind = HolderKind::kStore);
  StoreFeed(const StoreFeed&) = delete;
  StoreFeed& operator=(const StoreFeed&) = delete;

  void OnUpdate(const kvstore::WatchUpdate& update);

  // The registration's outcome.
  const absl::Status& status() const { return status_; }
  // True from a kGap until ClearResync (the owner restarts the watch from 0, then clears it).
  bool resync_needed() const { return resync_.load(); }
  void ClearResync() { resync_.store(false); }
  // True between a delivered snapshot or event and a kDisconnected.
  bool connected() const { return connected_.load(); }
  StoreFeedStats stats() const;
  const std::string& holder_id() const { return holder_id_; }

 private:
  struct KeyHash {
    size_t operator()(const BlockHash& key) const;
  };
  // Whether `name` is a block of this model (any layer).
  bool Ours(const BlockName& name) const;
  uint64_t IncarnationOf(uint64_t store_id);
  void Check(const absl::StatusOr<EventOutcome>& outcome);

  PrefixIndex* const index_;
  const std::string holder_id_;
  const std::vector<BlockName> layer_names_;
  absl::Status status_;

  // The watch thread's.
  uint64_t store_id_ = 0;
  uint64_t incarnation_ = 0;
  bool in_snapshot_ = false;
  uint64_t snapshot_store_id_ = 0;
  absl::flat_hash_map<BlockHash, uint32_t, KeyHash> snapshot_layers_;  // layers seen per key

  std::atomic<bool> resync_{false};
  std::atomic<bool> connected_{false};
  std::atomic<uint64_t> events_{0}, chunks_stored_{0}, chunks_removed_{0}, snapshots_{0},
      snapshot_chunks_{0}, disconnects_{0}, gaps_{0};
};

}  // namespace strata::router
