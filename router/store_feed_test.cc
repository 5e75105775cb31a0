// StoreFeed on its own: WatchUpdates in, PrefixIndex state out (no store, no gRPC calls).
#include "router/store_feed.h"

#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace strata::router {
namespace {

constexpr uint32_t kLayers = 3;
constexpr uint64_t kStoreA = 0xA11CE, kStoreB = 0xB0B;

BlockHash Key(uint8_t i) {
  BlockHash h{};
  h[0] = i;
  h[31] = 0x5a;
  return h;
}

std::vector<BlockName> LayerNames() {
  std::vector<BlockName> names;
  for (uint32_t l = 0; l < kLayers; ++l) {
    names.push_back({.model_fingerprint = 11,
                     .codec_fingerprint = 20 + l,  // per-layer codecs differ
                     .calibration_fingerprint = 0,
                     .key = {},
                     .layer = l});
  }
  return names;
}

BlockName Name(uint8_t key, uint32_t layer, uint64_t model = 11) {
  return {.model_fingerprint = model,
          .codec_fingerprint = 20 + layer,
          .calibration_fingerprint = 0,
          .key = Key(key),
          .layer = layer};
}

kvstore::WatchUpdate Event(uint64_t store_id, uint64_t id, kvstore::BlockEventKind kind,
                           const BlockName& name) {
  kvstore::WatchUpdate u;
  u.kind = kvstore::WatchUpdate::Kind::kEvent;
  u.store_id = store_id;
  u.event_id = id;
  u.event = {.id = id, .kind = kind, .name = name, .tier = kvstore::Tier::kRam};
  return u;
}

kvstore::WatchUpdate SnapshotBlock(uint64_t store_id, uint64_t as_of, const BlockName& name) {
  kvstore::WatchUpdate u;
  u.kind = kvstore::WatchUpdate::Kind::kSnapshotBlock;
  u.store_id = store_id;
  u.event_id = as_of;
  u.event = {.id = 0,
             .kind = kvstore::BlockEventKind::kStored,
             .name = name,
             .tier = kvstore::Tier::kDisk};
  return u;
}

kvstore::WatchUpdate SnapshotEnd(uint64_t store_id, uint64_t as_of) {
  kvstore::WatchUpdate u;
  u.kind = kvstore::WatchUpdate::Kind::kSnapshotEnd;
  u.store_id = store_id;
  u.event_id = as_of;
  return u;
}

class StoreFeedTest : public testing::Test {
 protected:
  uint32_t StoreChunks(std::vector<BlockHash> chain) {
    return index_.Overlap(chain, absl::Now()).StoreChunks();
  }
  uint64_t Cursor() { return index_.GetHolderState("store")->cursor; }

  PrefixIndex index_{PrefixIndexOptions{}};
  StoreFeed feed_{&index_, "store", LayerNames()};
};

TEST_F(StoreFeedTest, ChunkCountsOnceItsLastLayerIsStored) {
  ASSERT_TRUE(feed_.status().ok()) << feed_.status();
  EXPECT_EQ(index_.GetHolderState("store")->info.kind, HolderKind::kStore);
  using K = kvstore::BlockEventKind;
  feed_.OnUpdate(Event(kStoreA, 1, K::kStored, Name(1, 0)));
  feed_.OnUpdate(Event(kStoreA, 2, K::kStored, Name(1, 1)));
  EXPECT_EQ(StoreChunks({Key(1)}), 0u);
  feed_.OnUpdate(Event(kStoreA, 3, K::kStored, Name(1, 2)));
  EXPECT_EQ(StoreChunks({Key(1)}), 1u);
  EXPECT_TRUE(feed_.connected());
  EXPECT_EQ(feed_.stats().chunks_stored, 1u);
  EXPECT_EQ(Cursor(), 3u);
}

TEST_F(StoreFeedTest, OtherNamespacesOnlyAdvanceTheCursor) {
  using K = kvstore::BlockEventKind;
  for (uint32_t l = 0; l < kLayers; ++l) {
    feed_.OnUpdate(Event(kStoreA, 1 + l, K::kStored, Name(2, l, /*model=*/99)));
  }
  EXPECT_EQ(StoreChunks({Key(2)}), 0u);
  EXPECT_EQ(Cursor(), 3u);
  EXPECT_FALSE(feed_.resync_needed());
}

TEST_F(StoreFeedTest, RemovingAnyLayerRemovesTheChunk) {
  using K = kvstore::BlockEventKind;
  uint64_t id = 0;
  for (uint8_t k : {1, 2}) {
    for (uint32_t l = 0; l < kLayers; ++l)
      feed_.OnUpdate(Event(kStoreA, ++id, K::kStored, Name(k, l)));
  }
  EXPECT_EQ(StoreChunks({Key(1), Key(2)}), 2u);
  feed_.OnUpdate(Event(kStoreA, ++id, K::kRemoved, Name(2, 0)));
  EXPECT_EQ(StoreChunks({Key(1), Key(2)}), 1u);
  EXPECT_EQ(feed_.stats().chunks_removed, 1u);
}

TEST_F(StoreFeedTest, SnapshotListsChunksWithEveryLayer) {
  using K = kvstore::BlockEventKind;
  feed_.OnUpdate(Event(kStoreA, 1, K::kStored, Name(9, 2)));  // replaced by the snapshot
  for (uint32_t l = 0; l < kLayers; ++l) feed_.OnUpdate(SnapshotBlock(kStoreA, 40, Name(1, l)));
  for (uint32_t l = 0; l + 1 < kLayers; ++l) feed_.OnUpdate(SnapshotBlock(kStoreA, 40, Name(2, l)));
  feed_.OnUpdate(SnapshotEnd(kStoreA, 40));
  EXPECT_EQ(StoreChunks({Key(1)}), 1u);
  EXPECT_EQ(StoreChunks({Key(2)}), 0u);  // its last layer is missing
  EXPECT_EQ(StoreChunks({Key(9)}), 0u);
  EXPECT_EQ(Cursor(), 40u);
  EXPECT_EQ(feed_.stats().snapshot_chunks, 1u);
  // Live events carry on from the snapshot.
  for (uint32_t l = 0; l < kLayers; ++l)
    feed_.OnUpdate(Event(kStoreA, 41 + l, K::kStored, Name(3, l)));
  EXPECT_EQ(StoreChunks({Key(3)}), 1u);
}

TEST_F(StoreFeedTest, ADisconnectVoidsAPartialSnapshot) {
  for (uint32_t l = 0; l < kLayers; ++l) feed_.OnUpdate(SnapshotBlock(kStoreA, 5, Name(1, l)));
  kvstore::WatchUpdate down;
  down.kind = kvstore::WatchUpdate::Kind::kDisconnected;
  down.status = absl::UnavailableError("store down");
  feed_.OnUpdate(down);
  EXPECT_FALSE(feed_.connected());
  feed_.OnUpdate(SnapshotEnd(kStoreA, 5));  // a new snapshot with nothing in it
  EXPECT_EQ(StoreChunks({Key(1)}), 0u);
  EXPECT_TRUE(feed_.connected());
}

TEST_F(StoreFeedTest, ARestartedStoreReplacesEverything) {
  using K = kvstore::BlockEventKind;
  for (uint32_t l = 0; l < kLayers; ++l)
    feed_.OnUpdate(Event(kStoreA, 1 + l, K::kStored, Name(1, l)));
  EXPECT_EQ(StoreChunks({Key(1)}), 1u);
  // The new store's ids start again at 1; its snapshot holds what its disk kept.
  for (uint32_t l = 0; l < kLayers; ++l) feed_.OnUpdate(SnapshotBlock(kStoreB, 0, Name(2, l)));
  feed_.OnUpdate(SnapshotEnd(kStoreB, 0));
  EXPECT_EQ(StoreChunks({Key(1)}), 0u);
  EXPECT_EQ(StoreChunks({Key(2)}), 1u);
  for (uint32_t l = 0; l < kLayers; ++l)
    feed_.OnUpdate(Event(kStoreB, 1 + l, K::kStored, Name(3, l)));
  EXPECT_EQ(StoreChunks({Key(3)}), 1u);
  EXPECT_EQ(index_.GetHolderState("store")->incarnation, 2u);
}

TEST_F(StoreFeedTest, AGapAsksForAResync) {
  using K = kvstore::BlockEventKind;
  feed_.OnUpdate(Event(kStoreA, 1, K::kStored, Name(1, 0)));
  feed_.OnUpdate(Event(kStoreA, 5, K::kStored, Name(1, 1)));
  EXPECT_TRUE(feed_.resync_needed());
  EXPECT_EQ(feed_.stats().gaps, 1u);
  feed_.ClearResync();
  for (uint32_t l = 0; l < kLayers; ++l) feed_.OnUpdate(SnapshotBlock(kStoreA, 5, Name(1, l)));
  feed_.OnUpdate(SnapshotEnd(kStoreA, 5));
  EXPECT_FALSE(feed_.resync_needed());
  EXPECT_EQ(StoreChunks({Key(1)}), 1u);
  EXPECT_FALSE(index_.GetHolderState("store")->awaiting_snapshot);
}

}  // namespace
}  // namespace strata::router
