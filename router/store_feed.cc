#include "router/store_feed.h"

#include <cstring>
#include <utility>

#include "absl/hash/hash.h"
#include "serving/node_process.h"

namespace strata::router {

size_t StoreFeed::KeyHash::operator()(const BlockHash& key) const {
  uint64_t v;
  std::memcpy(&v, key.data(), sizeof(v));
  return absl::Hash<uint64_t>{}(v);
}

StoreFeed::StoreFeed(PrefixIndex* index, std::string holder_id, std::vector<BlockName> layer_names,
                     HolderKind kind)
    : index_(index), holder_id_(std::move(holder_id)), layer_names_(std::move(layer_names)) {
  status_ = index_->RegisterHolder({.id = holder_id_, .kind = kind}, 0);
}

bool StoreFeed::Ours(const BlockName& name) const {
  if (name.layer >= layer_names_.size()) return false;
  const BlockName& ns = layer_names_[name.layer];
  return name.model_fingerprint == ns.model_fingerprint &&
         name.codec_fingerprint == ns.codec_fingerprint &&
         name.calibration_fingerprint == ns.calibration_fingerprint;
}

uint64_t StoreFeed::IncarnationOf(uint64_t store_id) {
  if (store_id != store_id_) {
    store_id_ = store_id;
    ++incarnation_;
  }
  return incarnation_;
}

void StoreFeed::Check(const absl::StatusOr<EventOutcome>& outcome) {
  if (!outcome.ok()) {
    serving::Log("", absl::StrCat("store feed: ", outcome.status().ToString()));
    return;
  }
  if (*outcome == EventOutcome::kGap) {
    gaps_.fetch_add(1);
    if (!resync_.exchange(true)) {
      serving::Log("", "store feed: events were lost; asking the store for a snapshot");
    }
  }
}

void StoreFeed::OnUpdate(const kvstore::WatchUpdate& u) {
  using Kind = kvstore::WatchUpdate::Kind;
  switch (u.kind) {
    case Kind::kEvent: {
      HolderEvent e;
      e.incarnation = IncarnationOf(u.store_id);
      e.event_id = u.event_id;
      e.tier = HolderTier::kRam;
      const BlockName& name = u.event.name;
      if (u.event.kind == kvstore::BlockEventKind::kStored) {
        e.type = EventType::kStored;
        if (Ours(name) && name.layer + 1 == layer_names_.size()) {
          e.keys.push_back(name.key);
          chunks_stored_.fetch_add(1);
        }
      } else {
        e.type = EventType::kRemoved;
        if (Ours(name)) {
          e.keys.push_back(name.key);
          chunks_removed_.fetch_add(1);
        }
      }
      events_.fetch_add(1);
      connected_.store(true);
      Check(index_->Apply(holder_id_, e));
      return;
    }
    case Kind::kSnapshotBlock:
      if (!in_snapshot_ || snapshot_store_id_ != u.store_id) {
        snapshot_layers_.clear();
        in_snapshot_ = true;
        snapshot_store_id_ = u.store_id;
      }
      if (Ours(u.event.name)) ++snapshot_layers_[u.event.name.key];
      return;
    case Kind::kSnapshotEnd: {
      std::vector<SnapshotBlock> blocks;
      if (in_snapshot_ && snapshot_store_id_ == u.store_id) {
        for (const auto& [key, layers] : snapshot_layers_) {
          if (layers == layer_names_.size()) {
            blocks.push_back({.key = key, .tier = HolderTier::kRam});
          }
        }
      }
      snapshot_layers_.clear();
      in_snapshot_ = false;
      const uint64_t incarnation = IncarnationOf(u.store_id);
      snapshots_.fetch_add(1);
      snapshot_chunks_.store(blocks.size());
      connected_.store(true);
      Check(index_->ApplySnapshot(holder_id_, incarnation, u.event_id, blocks));
      return;
    }
    case Kind::kDisconnected:
      // A partial snapshot is void; the reconnection sends what is needed.
      snapshot_layers_.clear();
      in_snapshot_ = false;
      disconnects_.fetch_add(1);
      if (connected_.exchange(false)) {
        serving::Log("", absl::StrCat("store feed: disconnected: ", u.status.ToString()));
      }
      return;
  }
}

StoreFeedStats StoreFeed::stats() const {
  return {.events = events_.load(),
          .chunks_stored = chunks_stored_.load(),
          .chunks_removed = chunks_removed_.load(),
          .snapshots = snapshots_.load(),
          .snapshot_chunks = snapshot_chunks_.load(),
          .disconnects = disconnects_.load(),
          .gaps = gaps_.load()};
}

}  // namespace strata::router
