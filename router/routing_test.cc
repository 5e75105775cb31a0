#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router/prefix_index.h"
#include "router/routing_policy.h"

namespace strata::router {
namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

BlockHash Key(absl::string_view conversation, int chunk) {
  return Sha256::Hash(absl::StrCat(conversation, "/", chunk));
}

std::vector<BlockHash> Chain(absl::string_view conversation, int chunks) {
  std::vector<BlockHash> keys;
  for (int i = 0; i < chunks; ++i) keys.push_back(Key(conversation, i));
  return keys;
}

HolderEvent Stored(uint64_t id, std::vector<BlockHash> keys, HolderTier tier = HolderTier::kDevice,
                   uint64_t incarnation = 1) {
  return HolderEvent{incarnation, id, EventType::kStored, tier, std::move(keys)};
}

HolderEvent Removed(uint64_t id, std::vector<BlockHash> keys,
                    HolderTier tier = HolderTier::kDevice) {
  return HolderEvent{1, id, EventType::kRemoved, tier, std::move(keys)};
}

uint32_t ChunksAt(const OverlapResult& o, absl::string_view holder) {
  const HolderOverlap* h = o.Find(holder);
  return h == nullptr ? 0 : h->chunks;
}

class PrefixIndexTest : public ::testing::Test {
 protected:
  explicit PrefixIndexTest(PrefixIndexOptions options = {}) : index_(std::move(options)) {
    EXPECT_TRUE(index_.RegisterHolder({"p0", HolderKind::kNode}, 1).ok());
    EXPECT_TRUE(index_.RegisterHolder({"p1", HolderKind::kNode}, 1).ok());
  }
  EventOutcome MustApply(absl::string_view holder, const HolderEvent& e) {
    absl::StatusOr<EventOutcome> r = index_.Apply(holder, e);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : EventOutcome::kStale;
  }
  PrefixIndex index_;
};

TEST_F(PrefixIndexTest, OverlapCountsLeadingChunksOnly) {
  const std::vector<BlockHash> chain = Chain("a", 4);
  EXPECT_EQ(MustApply("p0", Stored(1, {chain[0], chain[1], chain[3]})), EventOutcome::kContiguous);
  EXPECT_EQ(MustApply("p1", Stored(1, {chain[1], chain[2], chain[3]})), EventOutcome::kContiguous);
  OverlapResult o = index_.Overlap(chain, kT0);
  EXPECT_EQ(o.chain_chunks, 4u);
  EXPECT_EQ(ChunksAt(o, "p0"), 2u);  // chunk 3 is there, but not chunk 2
  EXPECT_EQ(o.Find("p1"), nullptr);  // no chunk 0: nothing usable
  EXPECT_EQ(index_.Overlap(Chain("b", 4), kT0).holders.size(), 0u);
  EXPECT_EQ(index_.Overlap({}, kT0).holders.size(), 0u);
}

TEST_F(PrefixIndexTest, OverlapSplitsByFastestTier) {
  const std::vector<BlockHash> chain = Chain("a", 5);
  MustApply("p0", Stored(1, {chain[0], chain[1]}, HolderTier::kDevice));
  MustApply("p0", Stored(2, {chain[1], chain[2]}, HolderTier::kRam));
  MustApply("p0", Stored(3, {chain[3]}, HolderTier::kDisk));
  OverlapResult o = index_.Overlap(chain, kT0);
  const HolderOverlap* h = o.Find("p0");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->chunks, 4u);
  EXPECT_EQ(h->device_chunks(), 2u);
  EXPECT_EQ(h->ram_chunks(), 1u);
  EXPECT_EQ(h->disk_chunks(), 1u);
  // Leaving the device tier, chunk 1 is still in RAM.
  MustApply("p0", Removed(4, {chain[1]}, HolderTier::kDevice));
  h = (o = index_.Overlap(chain, kT0)).Find("p0");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->chunks, 4u);
  EXPECT_EQ(h->device_chunks(), 1u);
  EXPECT_EQ(h->ram_chunks(), 2u);
  MustApply("p0", Removed(5, {chain[1]}, HolderTier::kRam));
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 1u);
}

TEST_F(PrefixIndexTest, StaleEventsAreDropped) {
  const std::vector<BlockHash> chain = Chain("a", 2);
  EXPECT_EQ(MustApply("p0", Stored(1, {chain[0]})), EventOutcome::kContiguous);
  EXPECT_EQ(MustApply("p0", Removed(1, {chain[0]})), EventOutcome::kStale);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 1u);
  EXPECT_EQ(index_.Apply("p0", Stored(0, {})).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_.Apply("nobody", Stored(1, {})).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(index_.Stats().events_stale, 1u);
}

TEST_F(PrefixIndexTest, GapDiscardsEntriesUntilSnapshotThenReplaysBuffered) {
  const std::vector<BlockHash> chain = Chain("a", 4);
  MustApply("p0", Stored(1, {chain[0], chain[1]}));
  MustApply("p1", Stored(1, {chain[0]}));
  EXPECT_EQ(MustApply("p0", Stored(3, {chain[2]})), EventOutcome::kGap);
  EXPECT_EQ(index_.Overlap(chain, kT0).Find("p0"), nullptr);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p1"), 1u);  // other holders untouched
  EXPECT_EQ(MustApply("p0", Stored(4, {chain[3]})), EventOutcome::kAwaitingSnapshot);
  EXPECT_TRUE(index_.GetHolderState("p0")->awaiting_snapshot);

  // The snapshot reflects events up to 3; event 4 is replayed on top of it.
  std::vector<SnapshotBlock> blocks = {{chain[0]}, {chain[1]}, {chain[2]}};
  absl::StatusOr<EventOutcome> r = index_.ApplySnapshot("p0", 1, 3, blocks);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, EventOutcome::kContiguous);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 4u);
  absl::StatusOr<HolderState> state = index_.GetHolderState("p0");
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->cursor, 4u);
  EXPECT_FALSE(state->awaiting_snapshot);
  EXPECT_EQ(state->buffered_events, 0u);
  EXPECT_EQ(MustApply("p0", Removed(5, {chain[0]})), EventOutcome::kContiguous);
  EXPECT_EQ(index_.Stats().gaps, 1u);
}

TEST_F(PrefixIndexTest, HoleAmongBufferedEventsIsANewGap) {
  const std::vector<BlockHash> chain = Chain("a", 3);
  EXPECT_EQ(MustApply("p0", Stored(5, {chain[0]})), EventOutcome::kGap);
  EXPECT_EQ(MustApply("p0", Stored(8, {chain[1]})), EventOutcome::kAwaitingSnapshot);
  std::vector<SnapshotBlock> blocks = {{chain[0]}};
  // Covers event 5; 6 and 7 were never seen, so replaying 8 finds a hole.
  EXPECT_EQ(*index_.ApplySnapshot("p0", 1, 5, blocks), EventOutcome::kGap);
  EXPECT_TRUE(index_.GetHolderState("p0")->awaiting_snapshot);
  blocks = {{chain[0]}, {chain[1]}};
  EXPECT_EQ(*index_.ApplySnapshot("p0", 1, 8, blocks), EventOutcome::kContiguous);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 2u);
}

TEST_F(PrefixIndexTest, SnapshotReplacesHolderEntries) {
  const std::vector<BlockHash> chain = Chain("a", 4);
  MustApply("p0", Stored(1, chain));
  MustApply("p0", Stored(2, Chain("b", 2)));
  std::vector<SnapshotBlock> blocks = {{chain[0]}, {chain[1], HolderTier::kDisk}};
  EXPECT_EQ(*index_.ApplySnapshot("p0", 1, 2, blocks), EventOutcome::kContiguous);
  OverlapResult o = index_.Overlap(chain, kT0);
  ASSERT_NE(o.Find("p0"), nullptr);
  EXPECT_EQ(o.Find("p0")->chunks, 2u);
  EXPECT_EQ(o.Find("p0")->disk_chunks(), 1u);
  EXPECT_EQ(index_.Overlap(Chain("b", 2), kT0).holders.size(), 0u);
  // A snapshot older than what was applied changes nothing.
  MustApply("p0", Stored(3, {chain[2]}));
  EXPECT_EQ(*index_.ApplySnapshot("p0", 1, 2, {}), EventOutcome::kStale);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 3u);
}

TEST_F(PrefixIndexTest, NewIncarnationDropsOldEntries) {
  const std::vector<BlockHash> chain = Chain("a", 3);
  MustApply("p0", Stored(1, chain));
  MustApply("p0", Stored(2, Chain("b", 1)));
  // The holder restarted: its ids start over, and what it held before is gone.
  EXPECT_EQ(MustApply("p0", Stored(1, {chain[0]}, HolderTier::kDevice, /*incarnation=*/2)),
            EventOutcome::kContiguous);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 1u);
  EXPECT_EQ(index_.Overlap(Chain("b", 1), kT0).holders.size(), 0u);
  // Late events of the old life are stale.
  EXPECT_EQ(MustApply("p0", Stored(3, chain, HolderTier::kDevice, 1)), EventOutcome::kStale);
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 1u);
  EXPECT_EQ(index_.RegisterHolder({"p0", HolderKind::kNode}, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  // Re-registration with a newer incarnation also resets.
  ASSERT_TRUE(index_.RegisterHolder({"p0", HolderKind::kNode}, 3).ok());
  EXPECT_EQ(index_.Overlap(chain, kT0).holders.size(), 0u);
  EXPECT_EQ(index_.GetHolderState("p0")->cursor, 0u);
  EXPECT_EQ(index_.Stats().restarts, 2u);
}

TEST_F(PrefixIndexTest, ClearedAndRemoveHolderDropEverything) {
  const std::vector<BlockHash> chain = Chain("a", 3);
  MustApply("p0", Stored(1, chain));
  MustApply("p1", Stored(1, chain));
  ASSERT_TRUE(index_.Predict("p0", Chain("c", 2), kT0).ok());
  EXPECT_EQ(MustApply("p0", HolderEvent{1, 2, EventType::kCleared, HolderTier::kDevice, {}}),
            EventOutcome::kContiguous);
  EXPECT_EQ(index_.Overlap(chain, kT0).Find("p0"), nullptr);
  EXPECT_EQ(index_.Overlap(Chain("c", 2), kT0).holders.size(), 0u);
  ASSERT_TRUE(index_.RemoveHolder("p1").ok());
  EXPECT_EQ(index_.Overlap(chain, kT0).holders.size(), 0u);
  EXPECT_EQ(index_.Stats().entries, 0u);
  EXPECT_EQ(index_.Stats().keys, 0u);
  EXPECT_EQ(index_.RemoveHolder("p1").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(index_.Predict("p1", chain, kT0).code(), absl::StatusCode::kNotFound);
  // The freed slot is reused by a new holder that inherits nothing.
  ASSERT_TRUE(index_.RegisterHolder({"p2", HolderKind::kNode}, 1).ok());
  EXPECT_EQ(index_.Overlap(chain, kT0).holders.size(), 0u);
}

TEST_F(PrefixIndexTest, PredictionsCountUntilTheyExpire) {
  const std::vector<BlockHash> chain = Chain("a", 4);
  ASSERT_TRUE(index_.Predict("p1", chain, kT0).ok());
  OverlapResult o = index_.Overlap(chain, kT0 + absl::Seconds(119));
  ASSERT_NE(o.Find("p1"), nullptr);
  EXPECT_EQ(o.Find("p1")->chunks, 4u);
  EXPECT_EQ(o.Find("p1")->device_chunks(), 4u);
  EXPECT_EQ(o.Find("p1")->predicted_chunks, 4u);
  EXPECT_EQ(index_.Overlap(chain, kT0 + absl::Seconds(120)).holders.size(), 0u);
  EXPECT_EQ(index_.Stats().predicted_entries, 4u);
  EXPECT_EQ(index_.Sweep(kT0 + absl::Seconds(60)), 0u);
  EXPECT_EQ(index_.Sweep(kT0 + absl::Seconds(121)), 4u);
  EXPECT_EQ(index_.Stats().entries, 0u);
  // A refreshed prediction lives a TTL from its refresh.
  ASSERT_TRUE(index_.Predict("p1", chain, kT0).ok());
  ASSERT_TRUE(index_.Predict("p1", chain, kT0 + absl::Seconds(100)).ok());
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0 + absl::Seconds(200)), "p1"), 4u);
  EXPECT_EQ(index_.Sweep(kT0 + absl::Seconds(150)), 0u);
  EXPECT_EQ(index_.Stats().entries, 4u);
}

TEST_F(PrefixIndexTest, EventsSupersedePredictions) {
  const std::vector<BlockHash> chain = Chain("a", 4);
  ASSERT_TRUE(index_.Predict("p0", chain, kT0).ok());
  MustApply("p0", Stored(1, {chain[0], chain[1]}, HolderTier::kRam));
  OverlapResult o = index_.Overlap(chain, kT0);
  ASSERT_NE(o.Find("p0"), nullptr);
  EXPECT_EQ(o.Find("p0")->chunks, 4u);
  EXPECT_EQ(o.Find("p0")->predicted_chunks, 2u);
  EXPECT_EQ(o.Find("p0")->ram_chunks(), 2u);
  // The node says it dropped chunk 2: the prediction for it goes.
  MustApply("p0", Removed(2, {chain[2]}));
  EXPECT_EQ(ChunksAt(index_.Overlap(chain, kT0), "p0"), 2u);
  // Event-fed chunks outlive the TTL; predicting them again changes nothing.
  ASSERT_TRUE(index_.Predict("p0", chain, kT0).ok());
  o = index_.Overlap(chain, kT0 + absl::Hours(1));
  EXPECT_EQ(ChunksAt(o, "p0"), 2u);
  EXPECT_EQ(o.Find("p0")->predicted_chunks, 0u);
}

class PrefixIndexCapTest : public PrefixIndexTest {
 protected:
  PrefixIndexCapTest() : PrefixIndexTest(PrefixIndexOptions{.max_entries = 6}) {}
};

TEST_F(PrefixIndexCapTest, EvictsOldestPredictionsFirstThenRefusesStores) {
  ASSERT_TRUE(index_.Predict("p1", Chain("old", 3), kT0).ok());
  ASSERT_TRUE(index_.Predict("p1", Chain("new", 3), kT0 + absl::Seconds(1)).ok());
  EXPECT_EQ(index_.Stats().entries, 6u);
  // Event-fed entries push out the least recently predicted ones.
  MustApply("p0", Stored(1, Chain("real", 2)));
  EXPECT_EQ(index_.Stats().entries, 6u);
  EXPECT_EQ(index_.Stats().predictions_evicted, 2u);
  const absl::Time t = kT0 + absl::Seconds(2);
  EXPECT_EQ(index_.Overlap(Chain("old", 3), t).holders.size(), 0u);  // chunk 0 went first
  EXPECT_EQ(ChunksAt(index_.Overlap(Chain("new", 3), t), "p1"), 3u);
  EXPECT_EQ(ChunksAt(index_.Overlap(Chain("real", 2), t), "p0"), 2u);
  // Once only event-fed entries are left, new Stored keys are refused, never old ones dropped.
  MustApply("p0", Stored(2, Chain("more", 6)));
  EXPECT_EQ(index_.Stats().entries, 6u);
  EXPECT_EQ(index_.Stats().refused_entries, 2u);
  EXPECT_EQ(ChunksAt(index_.Overlap(Chain("real", 2), t), "p0"), 2u);
  EXPECT_EQ(ChunksAt(index_.Overlap(Chain("more", 6), t), "p0"), 4u);
  // The holder's evictions free room again.
  MustApply("p0", Removed(3, Chain("real", 2)));
  MustApply("p0", Stored(4, {Key("more", 4), Key("more", 5)}));
  EXPECT_EQ(ChunksAt(index_.Overlap(Chain("more", 6), t), "p0"), 6u);
}

TEST_F(PrefixIndexTest, StoreHolderGivesStoreChunks) {
  ASSERT_TRUE(index_.RegisterHolder({"store", HolderKind::kStore}, 1).ok());
  const std::vector<BlockHash> chain = Chain("a", 5);
  MustApply("store", Stored(1, Chain("a", 3), HolderTier::kDisk));
  MustApply("p0", Stored(1, Chain("a", 1)));
  OverlapResult o = index_.Overlap(chain, kT0);
  EXPECT_EQ(o.StoreChunks(), 3u);
  EXPECT_EQ(ChunksAt(o, "p0"), 1u);
  EXPECT_EQ(o.Find("store")->kind, HolderKind::kStore);
}

TEST_F(PrefixIndexTest, ConcurrentEventsAndQueries) {
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([this, w] {
      const std::string holder = w == 0 ? "p0" : "p1";
      for (int i = 1; i <= 300; ++i) {
        ASSERT_TRUE(index_.Apply(holder, Stored(i, {Key("c", i)})).ok());
        ASSERT_TRUE(index_.Predict(holder, Chain("d", 8), kT0 + absl::Seconds(i)).ok());
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([this] {
      for (int i = 0; i < 300; ++i) {
        OverlapResult o = index_.Overlap(Chain("d", 8), kT0);
        for (const HolderOverlap& h : o.holders) ASSERT_LE(h.chunks, 8u);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(index_.GetHolderState("p0")->cursor, 300u);
  EXPECT_EQ(ChunksAt(index_.Overlap(Chain("d", 8), kT0), "p1"), 8u);
}

TEST(PrefixIndexOptionsTest, Validate) {
  EXPECT_TRUE(PrefixIndexOptions{}.Validate().ok());
  EXPECT_EQ(PrefixIndexOptions{.max_entries = 0}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrefixIndexOptions{.prediction_ttl = absl::Seconds(-1)}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrefixIndex::Create(PrefixIndexOptions{.max_entries = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- RoutingPolicy ----

constexpr uint32_t kChunk = 256;

NodeLoad Prefill(std::string id, uint64_t queued = 0) {
  NodeLoad n;
  n.id = std::move(id);
  n.role = NodeRole::kPrefill;
  n.queued_prefill_tokens = queued;
  return n;
}

NodeLoad Decode(std::string id, uint64_t in_use = 0, uint64_t capacity = 1000) {
  NodeLoad n;
  n.id = std::move(id);
  n.role = NodeRole::kDecode;
  n.kv_bytes_in_use = in_use;
  n.kv_bytes_capacity = capacity;
  n.max_batch = 64;
  return n;
}

HolderOverlap Local(std::string id, uint32_t device, uint32_t ram = 0) {
  HolderOverlap h;
  h.holder_id = std::move(id);
  h.chunks = device + ram;
  h.tier_chunks[0] = device;
  h.tier_chunks[1] = ram;
  return h;
}

std::unique_ptr<RoutingPolicy> MakePolicy(RoutingOptions options = {}) {
  absl::StatusOr<std::unique_ptr<RoutingPolicy>> p = RoutingPolicy::Create(options);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

RouteRequest Request(uint32_t chunks, uint64_t decode_bytes = 10) {
  return RouteRequest{uint64_t{chunks} * kChunk, kChunk, decode_bytes};
}

TEST(RoutingPolicyTest, PrefersTheNodeHoldingThePrefix) {
  auto policy = MakePolicy();
  OverlapResult overlap{40, {Local("p1", 30)}};
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1"), Prefill("p2"), Decode("d0")};
  absl::StatusOr<RouteDecision> d = policy->Route(Request(40), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_id, "p1");
  EXPECT_EQ(d->decode_id, "d0");
  EXPECT_EQ(d->local_chunks, 30u);
  EXPECT_EQ(d->expected_cached_chunks(), 30u);
  EXPECT_EQ(d->uncached_tokens, 10u * kChunk);
  EXPECT_DOUBLE_EQ(d->prefill_cost, 10.0);
  EXPECT_THAT(d->Explain(), HasSubstr("prefill=p1 decode=d0"));
  EXPECT_THAT(d->Explain(), HasSubstr("*p1=10.00"));
}

TEST(RoutingPolicyTest, BackloggedHolderLosesWhenItsQueueOutweighsTheSavedWork) {
  auto policy = MakePolicy();
  OverlapResult overlap{40, {Local("p1", 30)}};
  // p1 saves 30 chunks of work; 20 chunks of queue do not cancel that, 50 do.
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1", 20 * kChunk), Decode("d0")};
  EXPECT_EQ(policy->Route(Request(40), overlap, nodes)->prefill_id, "p1");
  nodes[1].queued_prefill_tokens = 50 * kChunk;
  EXPECT_EQ(policy->Route(Request(40), overlap, nodes)->prefill_id, "p0");
}

TEST(RoutingPolicyTest, TierAndStoreHitsEarnLessThanDeviceHits) {
  auto policy = MakePolicy();
  HolderOverlap store;
  store.holder_id = "store";
  store.kind = HolderKind::kStore;
  store.chunks = 40;
  // p0: 10 local device chunks + 30 more from the store: 40 − (10 + 0.5·30) = 15.
  // p1: 20 chunks in RAM + 20 from the store: 40 − (0.75·20 + 0.5·20) = 15; p2 (no store): 40.
  OverlapResult overlap{40, {Local("p0", 10), Local("p1", 0, 20), store}};
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1"), Prefill("p2"), Decode("d0")};
  nodes[2].reads_store = false;
  nodes[1].active_requests = 1;  // breaks the tie: 15.1
  absl::StatusOr<RouteDecision> d = policy->Route(Request(40), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_id, "p0");
  EXPECT_EQ(d->local_chunks, 10u);
  EXPECT_EQ(d->store_chunks, 30u);
  EXPECT_EQ(d->uncached_tokens, 0u);
  EXPECT_DOUBLE_EQ(d->prefill_candidates[0].cost, 15.0);
  EXPECT_DOUBLE_EQ(d->prefill_candidates[1].cost, 15.1);
  EXPECT_DOUBLE_EQ(d->prefill_candidates[2].cost, 40.0);
  EXPECT_EQ(d->prefill_candidates[2].store_chunks, 0u);
}

// Every host runs a store: a node is credited with its own host's store's chunks and the shared
// tier's, never with another host's store.
TEST(RoutingPolicyTest, ANodeIsCreditedWithItsOwnHostsStoreAndTheSharedTierOnly) {
  EXPECT_EQ(StoreHolderId("10.0.0.1:7070", "10.0.0.1:7070"), "store");
  EXPECT_EQ(StoreHolderId("10.0.0.2:7070", "10.0.0.1:7070"), "store@10.0.0.2:7070");
  auto policy = MakePolicy();
  auto store = [](std::string id, uint32_t chunks) {
    HolderOverlap h;
    h.holder_id = std::move(id);
    h.kind = HolderKind::kStore;
    h.chunks = chunks;
    return h;
  };
  std::vector<NodeLoad> nodes = {Prefill("a0"), Prefill("b0"), Decode("d0")};
  nodes[0].store_holder = "store@a:1";
  nodes[1].store_holder = "store@b:1";
  // Host A's store holds 30 chunks, host B's 5: each node sees its own.
  OverlapResult overlap{40, {store("store@a:1", 30), store("store@b:1", 5)}};
  absl::StatusOr<RouteDecision> d = policy->Route(Request(40), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_id, "a0");
  EXPECT_EQ(d->prefill_candidates[0].store_chunks, 30u);
  EXPECT_EQ(d->prefill_candidates[1].store_chunks, 5u);
  // The shared tier holds 20: B reads them through its store; A still has more of its own.
  overlap.holders.push_back(store(kSharedTierHolder, 20));
  d = policy->Route(Request(40), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_candidates[0].store_chunks, 30u);
  EXPECT_EQ(d->prefill_candidates[1].store_chunks, 20u);
  // A node naming no store of its own is credited with the longest of every store (one store).
  nodes[1].store_holder = "";
  d = policy->Route(Request(40), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_candidates[1].store_chunks, 30u);
}

TEST(RoutingPolicyTest, PredictionRoutesTheNextTurnToTheSameNode) {
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    auto policy = MakePolicy(RoutingOptions{.seed = seed});
    PrefixIndex index(PrefixIndexOptions{});
    std::vector<NodeLoad> nodes;
    for (int i = 0; i < 4; ++i) {
      nodes.push_back(Prefill(absl::StrCat("p", i)));
      ASSERT_TRUE(index.RegisterHolder({nodes.back().id, HolderKind::kNode}, 1).ok());
    }
    nodes.push_back(Decode("d0"));
    // Turn 1: nothing cached anywhere, so any node.
    const std::vector<BlockHash> turn1 = Chain("conv", 10);
    absl::StatusOr<RouteDecision> first =
        policy->Route(Request(10), index.Overlap(turn1, kT0), nodes);
    ASSERT_TRUE(first.ok());
    ASSERT_TRUE(index.Predict(first->prefill_id, turn1, kT0).ok());
    // Turn 2 extends turn 1 and comes before any event from the node.
    const std::vector<BlockHash> turn2 = Chain("conv", 14);
    const absl::Time t2 = kT0 + absl::Seconds(5);
    absl::StatusOr<RouteDecision> second =
        policy->Route(Request(14), index.Overlap(turn2, t2), nodes);
    ASSERT_TRUE(second.ok());
    EXPECT_EQ(second->prefill_id, first->prefill_id);
    EXPECT_EQ(second->local_chunks, 10u);
    // Past the TTL the prediction no longer counts.
    EXPECT_EQ(index.Overlap(turn2, kT0 + absl::Seconds(121)).holders.size(), 0u);
  }
}

TEST(RoutingPolicyTest, LoadTrackerSpreadsABurstAcrossNodes) {
  auto policy = MakePolicy();
  LoadTracker tracker;
  std::vector<NodeLoad> reports = {Prefill("p0"), Prefill("p1"), Prefill("p2"),
                                   Prefill("p3"), Decode("d0"),  Decode("d1")};
  for (NodeLoad& n : reports) n.reported_at = kT0;
  std::map<std::string, int> prefill_count, decode_count;
  // Eight requests with no cached prefix inside one reporting interval.
  for (int r = 0; r < 8; ++r) {
    std::vector<NodeLoad> nodes = reports;
    tracker.Overlay(absl::MakeSpan(nodes));
    absl::StatusOr<RouteDecision> d =
        policy->Route(Request(20, /*decode_bytes=*/100), OverlapResult{20, {}}, nodes);
    ASSERT_TRUE(d.ok()) << d.status();
    ++prefill_count[d->prefill_id];
    ++decode_count[d->decode_id];
    ASSERT_TRUE(tracker.Add(absl::StrCat("r", r), *d, kT0 + absl::Milliseconds(r + 1)).ok());
  }
  for (const auto& [id, n] : prefill_count) EXPECT_EQ(n, 2) << id;
  EXPECT_EQ(prefill_count.size(), 4u);
  EXPECT_EQ(decode_count["d0"], 4);
  EXPECT_EQ(decode_count["d1"], 4);
  EXPECT_EQ(tracker.in_flight(), 8u);
}

TEST(RoutingPolicyTest, UnhealthyNodesAreNeverChosen) {
  auto policy = MakePolicy();
  OverlapResult overlap{40, {Local("p0", 40)}};
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1"), Prefill("p2", 100 * kChunk),
                                 Decode("d0"), Decode("d1", 900)};
  nodes[0].healthy = false;
  nodes[3].healthy = false;
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<RouteDecision> d = policy->Route(Request(40), overlap, nodes);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->prefill_id, "p1");
    EXPECT_EQ(d->decode_id, "d1");
    EXPECT_THAT(d->Explain(), HasSubstr("p0=skip(unhealthy)"));
  }
  for (NodeLoad& n : nodes) n.healthy = n.role == NodeRole::kDecode;
  EXPECT_EQ(policy->Route(Request(40), overlap, nodes).status().code(),
            absl::StatusCode::kUnavailable);
  for (NodeLoad& n : nodes) n.healthy = n.role == NodeRole::kPrefill;
  EXPECT_EQ(policy->Route(Request(40), overlap, nodes).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(policy->Route(Request(40), overlap, {Prefill("p0")}).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(RoutingPolicyTest, OverloadIsResourceExhausted) {
  auto policy = MakePolicy(RoutingOptions{.max_queued_prefill_tokens = 16 * kChunk});
  OverlapResult overlap{20, {Local("p1", 10)}};
  std::vector<NodeLoad> nodes = {Prefill("p0", 0), Prefill("p1", 6 * kChunk), Decode("d0")};
  // p0 would queue its 20 uncached chunks, over the limit; p1 6 + 10, at the limit.
  absl::StatusOr<RouteDecision> d = policy->Route(Request(20), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_id, "p1");
  EXPECT_THAT(d->Explain(), HasSubstr("p0=skip(queue 0+5120 > 4096)"));
  nodes[1].queued_prefill_tokens = 7 * kChunk;
  absl::Status s = policy->Route(Request(20), overlap, nodes).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("no prefill node can take the request"));
  nodes[1].queued_prefill_tokens = 0;
  nodes[2].kv_bytes_in_use = 995;
  s = policy->Route(Request(20, /*decode_bytes=*/10), overlap, nodes).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("no decode node can take the request: d0: kv 1005 > 1000"));
}

TEST(RoutingPolicyTest, NodesOwnQueueBoundsRefuseWhatTheyCannotServeInTime) {
  auto policy = MakePolicy();
  OverlapResult overlap{20, {}};
  // Prefill: each node reports the most prompt tokens it queues (its rate x its queue time).
  std::vector<NodeLoad> nodes = {Prefill("p0", 3 * kChunk), Prefill("p1", 2 * kChunk),
                                 Decode("d0")};
  nodes[0].max_queued_prefill_tokens = 20 * kChunk;
  nodes[1].max_queued_prefill_tokens = 21 * kChunk;
  // p1: 2 + 20 > 21; p0: 3 + 20 > 20; nothing fits.
  absl::Status s = policy->Route(Request(20), overlap, nodes).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr(kNoPrefillRoom));
  EXPECT_THAT(s.message(), HasSubstr("queue full 768+5120 > 5120"));
  // An empty queue takes a request larger than its bound: it is served at once.
  nodes[0].queued_prefill_tokens = 0;
  nodes[0].max_queued_prefill_tokens = 4 * kChunk;
  absl::StatusOr<RouteDecision> d = policy->Route(Request(20), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill_id, "p0");

  // Decode: a full batch still takes requests into its waiting queue, up to max_waiting.
  nodes[2].max_batch = 4;
  nodes[2].max_waiting = 8;
  nodes[2].active_requests = 11;
  d = policy->Route(Request(20), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->decode_id, "d0");
  nodes[2].active_requests = 12;
  s = policy->Route(Request(20), overlap, nodes).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr(kNoDecodeRoom));
  EXPECT_THAT(s.message(), HasSubstr("d0: queue full 12 >= 4+8"));
  // Without a reported max_waiting the node queues without a bound (older nodes).
  nodes[2].max_waiting = 0;
  EXPECT_TRUE(policy->Route(Request(20), overlap, nodes).ok());
}

TEST(RoutingPolicyTest, BusyPrefillNodesAreSkippedUnlessAllAreBusy) {
  auto policy = MakePolicy(RoutingOptions{.busy_prefill_tokens = 10 * kChunk});
  // p1 holds everything but is busy; p0 is idle.
  OverlapResult overlap{40, {Local("p1", 40)}};
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1", 11 * kChunk), Decode("d0")};
  absl::StatusOr<RouteDecision> d = policy->Route(Request(40), overlap, nodes);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->prefill_id, "p0");
  EXPECT_THAT(d->Explain(), HasSubstr("p1=skip(busy"));
  nodes[0].queued_prefill_tokens = 11 * kChunk;
  EXPECT_EQ(policy->Route(Request(40), overlap, nodes)->prefill_id, "p1");
}

TEST(RoutingPolicyTest, DecodePickFiltersNodesThatCannotFitAndTakesTheLeastLoaded) {
  auto policy = MakePolicy();
  OverlapResult overlap{4, {}};
  std::vector<NodeLoad> nodes = {Prefill("p0"),
                                 Decode("small", 90, 100),    // 90 + 20 > 100
                                 Decode("full", 0, 1000),     // batch full
                                 Decode("big", 800, 10'000),  // 8.2 %
                                 Decode("busy", 500, 1000),   // 52 %
                                 Decode("unreported", 0, 0)};
  nodes[2].active_requests = 64;
  absl::StatusOr<RouteDecision> d = policy->Route(Request(4, 20), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->decode_id, "big");
  EXPECT_NEAR(d->decode_load, 0.082, 1e-9);
  EXPECT_THAT(d->Explain(), HasSubstr("small=skip(kv 110 > 100)"));
  EXPECT_THAT(d->Explain(), HasSubstr("full=skip(batch full 64/64)"));
  EXPECT_THAT(d->Explain(), HasSubstr("unreported=skip(no kv capacity reported)"));
  // Sequences count too: a node with free KV but a nearly full batch loses.
  nodes[3].active_requests = 60;  // 61/64
  EXPECT_EQ(policy->Route(Request(4, 20), overlap, nodes)->decode_id, "busy");
  // Every batch full: still routed (the node queues it), to the least loaded, never a 429.
  nodes[3].active_requests = 65;
  nodes[4].active_requests = 70;
  d = policy->Route(Request(4, 20), overlap, nodes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->decode_id, "full");  // (64 + 1) / 64 against 66/64 and 71/64
}

TEST(RoutingPolicyTest, TiesAreBrokenAtRandomReproduciblyBySeed) {
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1"), Prefill("p2"), Decode("d0")};
  auto sequence = [&](uint64_t seed) {
    auto policy = MakePolicy(RoutingOptions{.seed = seed});
    std::string picks;
    for (int i = 0; i < 60; ++i) {
      picks += policy->Route(Request(8), OverlapResult{8, {}}, nodes)->prefill_id.back();
    }
    return picks;
  };
  const std::string a = sequence(7);
  EXPECT_EQ(a, sequence(7));
  EXPECT_NE(a, sequence(8));
  for (char c : {'0', '1', '2'}) EXPECT_NE(a.find(c), std::string::npos) << c;
}

TEST(RoutingPolicyTest, TemperatureSometimesPicksACostlierNode) {
  OverlapResult overlap{40, {Local("p0", 20)}};
  std::vector<NodeLoad> nodes = {Prefill("p0"), Prefill("p1"), Decode("d0")};
  auto greedy = MakePolicy();
  auto soft = MakePolicy(RoutingOptions{.temperature = 1.0});
  int p1_picks = 0;
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(greedy->Route(Request(40), overlap, nodes)->prefill_id, "p0");
    p1_picks += soft->Route(Request(40), overlap, nodes)->prefill_id == "p1";
  }
  // p(p1) = e^-1 / (1 + e^-1) ≈ 0.27.
  EXPECT_GT(p1_picks, 20);
  EXPECT_LT(p1_picks, 100);
}

TEST(RoutingPolicyTest, RejectsMalformedRequestsAndOptions) {
  auto policy = MakePolicy();
  std::vector<NodeLoad> nodes = {Prefill("p0"), Decode("d0")};
  EXPECT_EQ(policy->Route(RouteRequest{0, kChunk, 1}, {}, nodes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(policy->Route(RouteRequest{10, 0, 1}, {}, nodes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RoutingOptions{.store_hit_weight = -1}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      RoutingOptions{.temperature = std::numeric_limits<double>::infinity()}.Validate().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RoutingPolicy::Create(
                RoutingOptions{.busy_prefill_tokens = 10, .max_queued_prefill_tokens = 5})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- LoadTracker ----

TEST(LoadTrackerTest, SharesLastUntilFirstTokenAndCompletionAndOnlyUntilAReport) {
  LoadTracker tracker;
  RouteDecision d;
  d.prefill_id = "p0";
  d.decode_id = "d0";
  d.uncached_tokens = 1000;
  d.decode_kv_bytes = 300;
  ASSERT_TRUE(tracker.Add("r1", d, kT0 + absl::Seconds(1)).ok());
  EXPECT_EQ(tracker.Add("r1", d, kT0).code(), absl::StatusCode::kAlreadyExists);
  d.prefill_id = "";
  EXPECT_EQ(tracker.Add("r2", d, kT0).code(), absl::StatusCode::kInvalidArgument);

  auto overlay = [&](absl::Time reported_at) {
    std::vector<NodeLoad> nodes = {Prefill("p0", 50), Decode("d0", 10)};
    for (NodeLoad& n : nodes) n.reported_at = reported_at;
    tracker.Overlay(absl::MakeSpan(nodes));
    return nodes;
  };
  std::vector<NodeLoad> n = overlay(kT0);
  EXPECT_EQ(n[0].queued_prefill_tokens, 1050u);
  EXPECT_EQ(n[0].active_requests, 1u);
  EXPECT_EQ(n[1].kv_bytes_reserved, 300u);
  EXPECT_EQ(n[1].active_requests, 1u);
  // A report taken after routing already counts the request.
  n = overlay(kT0 + absl::Seconds(1));
  EXPECT_EQ(n[0].queued_prefill_tokens, 50u);
  EXPECT_EQ(n[1].kv_bytes_reserved, 0u);

  EXPECT_TRUE(tracker.MarkPrefillDone("r1"));
  EXPECT_FALSE(tracker.MarkPrefillDone("r1"));
  n = overlay(kT0);
  EXPECT_EQ(n[0].queued_prefill_tokens, 50u);
  EXPECT_EQ(n[0].active_requests, 0u);
  EXPECT_EQ(n[1].kv_bytes_reserved, 300u);
  EXPECT_TRUE(tracker.Complete("r1"));
  EXPECT_FALSE(tracker.Complete("r1"));
  n = overlay(kT0);
  EXPECT_EQ(n[1].kv_bytes_reserved, 0u);
  EXPECT_EQ(tracker.in_flight(), 0u);
}

TEST(LoadTrackerTest, ForgetDropsOldRequests) {
  LoadTracker tracker;
  RouteDecision d;
  d.prefill_id = "p0";
  d.decode_id = "d0";
  ASSERT_TRUE(tracker.Add("old", d, kT0).ok());
  ASSERT_TRUE(tracker.Add("new", d, kT0 + absl::Minutes(10)).ok());
  EXPECT_EQ(tracker.Forget(kT0 + absl::Minutes(5)), 1u);
  EXPECT_EQ(tracker.in_flight(), 1u);
  EXPECT_FALSE(tracker.Complete("old"));
  EXPECT_TRUE(tracker.Complete("new"));
}

}  // namespace
}  // namespace strata::router
