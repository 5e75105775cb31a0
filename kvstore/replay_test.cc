#include "kvstore/replay.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstore/block_store.h"
#include "kvstore/test_blocks.h"

namespace strata::kvstore {
namespace {

using testing::HasSubstr;

std::vector<TraceRequest> Trace() {
  // Two conversations sharing a system prompt (ids 0, 1), each turn extending its own history.
  std::vector<TraceRequest> t;
  auto req = [&](std::vector<uint64_t> ids) {
    TraceRequest r;
    r.hash_ids = ids;
    r.input_tokens = static_cast<uint32_t>(ids.size() * 512 - 100);  // last block partial
    t.push_back(r);
  };
  req({0, 1, 10, 11});
  req({0, 1, 20, 21});
  req({0, 1, 10, 11, 12, 13});
  req({0, 1, 20, 21, 22, 23});
  return t;
}

TEST(ReplayTest, UnlimitedRamFindsEveryRepeatedFullChunk) {
  const ReplayResult r = Replay(Trace(), {.chunk_bytes = 100, .ram_bytes = 1 << 20});
  // Full chunks: 3 + 3 + 5 + 5 = 16; repeated: 2 (req 2: 0, 1) + 3 (req 3: 0 1 10 11; 11 is
  // request 1's partial last block, never stored) ... counted exactly:
  // req1: 0 1 10 (11 partial) -> 0 hits; req2: 0 1 20 -> 2; req3: 0 1 10 11 12 -> 3 (11 new);
  // req4: 0 1 20 21 22 -> 3.
  EXPECT_EQ(r.chunks_requested, 16u);
  EXPECT_EQ(r.chunk_hits_ram, 8u);
  EXPECT_EQ(r.chunk_hits_disk, 0u);
  EXPECT_EQ(r.tokens_saved, 8u * 512);
  EXPECT_EQ(r.ram_evictions, 0u);
}

// Conversations: a shared 2-chunk system prompt, each turn re-sending the history plus 2 chunks.
std::vector<TraceRequest> Conversations(int n, int turns) {
  std::vector<TraceRequest> t;
  std::vector<std::vector<uint64_t>> hist(n, std::vector<uint64_t>{0, 1});
  uint64_t next = 100;
  for (int turn = 0; turn < turns; ++turn) {
    for (int c = 0; c < n; ++c) {
      hist[c].push_back(next++);
      hist[c].push_back(next++);
      TraceRequest r;
      r.hash_ids = hist[c];
      r.input_tokens = static_cast<uint32_t>(r.hash_ids.size() * 512);
      t.push_back(r);
    }
  }
  return t;
}

TEST(ReplayTest, SmallRamSpillsToDiskAndNoTierMeansNoHits) {
  const std::vector<TraceRequest> trace = Conversations(20, 5);
  const ReplayResult unlimited = Replay(trace, {.chunk_bytes = 100, .ram_bytes = 1 << 30});
  const ReplayResult ram_only =
      Replay(trace, {.chunk_bytes = 100, .ram_bytes = 1000, .ram_policy = PolicyKind::kLru});
  const ReplayResult with_disk = Replay(trace, {.chunk_bytes = 100,
                                                .ram_bytes = 1000,
                                                .disk_bytes = 1 << 30,
                                                .ram_policy = PolicyKind::kLru});
  // A disk that holds everything finds every chunk unlimited RAM would, some from disk.
  EXPECT_EQ(with_disk.chunk_hits_ram + with_disk.chunk_hits_disk, unlimited.chunk_hits_ram);
  EXPECT_GT(with_disk.chunk_hits_disk, 0u);
  EXPECT_EQ(with_disk.promotions, with_disk.chunk_hits_disk);
  EXPECT_GT(with_disk.bytes_written_disk, 0u);
  EXPECT_EQ(with_disk.bytes_read_disk, with_disk.chunk_hits_disk * 100);
  EXPECT_LT(ram_only.chunk_hit_rate(), with_disk.chunk_hit_rate());
  EXPECT_GT(ram_only.ram_evictions, 0u);
  EXPECT_EQ(ram_only.orphans_dropped, 0u);  // leaves go first: no prefix is evicted under a child
  // RAM smaller than one chunk and no disk: nothing is ever found.
  const ReplayResult none = Replay(trace, {.chunk_bytes = 100, .ram_bytes = 50});
  EXPECT_EQ(none.chunk_hits_ram + none.chunk_hits_disk, 0u);
}

// Conversations picked at random: each request continues one (1 or 2 new chunks) or re-sends an
// earlier point of its history.
std::vector<TraceRequest> RandomConversations(int n, int requests, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint64_t>> hist(n, std::vector<uint64_t>{0, 1});
  uint64_t next = 100;
  std::vector<TraceRequest> t;
  for (int i = 0; i < requests; ++i) {
    std::vector<uint64_t>& h = hist[rng() % n];
    TraceRequest r;
    if (rng() % 4 == 0 && h.size() > 3) {
      r.hash_ids.assign(h.begin(), h.begin() + 2 + rng() % (h.size() - 2));
    } else {
      for (uint32_t k = 1 + rng() % 2; k > 0; --k) h.push_back(next++);
      r.hash_ids = h;
    }
    r.input_tokens = static_cast<uint32_t>(r.hash_ids.size() * 512);
    t.push_back(r);
  }
  return t;
}

// The trace fed to a real BlockStore the way a node uses it (Get each chunk found, in order, then
// Put the rest under their parents), with one-layer blocks of one size. What the store counts.
ReplayResult FeedStore(const std::vector<TraceRequest>& trace, const StoreOptions& o) {
  absl::StatusOr<std::unique_ptr<BlockStore>> store = BlockStore::Open(o);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return {};
  BlockStore& s = **store;
  ReplayResult r;
  auto name = [](uint64_t id, uint32_t chunk) {
    return test_blocks::Name(test_blocks::MakeBlock(7, 0, chunk, 1, 16),
                             test_blocks::Key(static_cast<uint32_t>(id), 0x3c));
  };
  for (const TraceRequest& q : trace) {
    ++r.requests;
    const size_t full = std::min<size_t>(q.hash_ids.size(), q.input_tokens / 512);
    r.chunks_requested += full;
    size_t hits = 0;
    for (; hits < full; ++hits) {
      absl::StatusOr<Lease> lease = s.Get(name(q.hash_ids[hits], hits));
      if (!lease.ok()) break;
      (lease->served_from() == Tier::kRam ? r.chunk_hits_ram : r.chunk_hits_disk)++;
      s.Flush();  // a promotion's spills too
    }
    for (size_t i = hits; i < full; ++i) {
      const AlignedBuffer b = test_blocks::MakeBlock(7, 0, static_cast<uint32_t>(i), 1, 16);
      const BlockHash parent =
          test_blocks::Key(static_cast<uint32_t>(i > 0 ? q.hash_ids[i - 1] : 0), 0x3c);
      const absl::Status put = s.Put(name(q.hash_ids[i], i), i > 0 ? &parent : nullptr, b.span());
      // The parent is gone, or RAM alone is full of this chain's own prefixes: the replay stops
      // there too.
      if (absl::IsFailedPrecondition(put) || absl::IsResourceExhausted(put)) break;
      EXPECT_TRUE(put.ok()) << put;
      s.Flush();  // spills land before the next step, as the replay has them at once
    }
  }
  const StoreStats st = s.Stats();
  r.ram_evictions = st.ram_evictions;
  r.disk_evictions = st.disk_evictions;
  r.promotions = st.promotions;
  r.orphans_dropped = st.orphans_dropped;
  return r;
}

// `strata replay`'s figures are the store's: the same trace through the replay and through a real
// BlockStore (RocksDB and the block log on disk) finds the same chunks in the same tiers, with the
// same evictions, promotions and orphans, for RAM alone and for RAM over a disk, written through
// or back.
TEST(ReplayTest, TheReplayFindsWhatARealStoreFedTheSameTraceFinds) {
  const std::vector<TraceRequest> trace = RandomConversations(12, 300, 42);
  const uint64_t block = test_blocks::MakeBlock(7, 0, 1, 1, 16).size();
  struct Case {
    const char* what;
    uint64_t ram_blocks, disk_blocks;
    PolicyKind policy;
    bool durable;
  };
  const Case cases[] = {{"RAM alone, LRU", 40, 0, PolicyKind::kLru, true},
                        {"RAM alone, S3-FIFO", 40, 0, PolicyKind::kS3Fifo, true},
                        {"RAM over disk, written through", 20, 120, PolicyKind::kS3Fifo, true},
                        {"RAM over disk, written back", 20, 120, PolicyKind::kLru, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const ReplayResult want = Replay(trace, {.block_tokens = 512,
                                             .chunk_bytes = block,
                                             .ram_bytes = c.ram_blocks * block,
                                             .disk_bytes = c.disk_blocks * block,
                                             .ram_policy = c.policy,
                                             .durable_puts = c.durable});
    StoreOptions o{
        .ram_bytes = c.ram_blocks * block, .ram_policy = c.policy, .durable_puts = c.durable};
    const std::string dir = absl::StrCat(testing::TempDir(), "/replay-store-", getpid());
    std::filesystem::remove_all(dir);
    if (c.disk_blocks > 0) {
      o.disk_path = dir;
      o.disk_bytes = c.disk_blocks * block;
    }
    const ReplayResult got = FeedStore(trace, o);
    std::filesystem::remove_all(dir);
    EXPECT_EQ(got.chunks_requested, want.chunks_requested);
    EXPECT_EQ(got.chunk_hits_ram, want.chunk_hits_ram);
    EXPECT_EQ(got.chunk_hits_disk, want.chunk_hits_disk);
    EXPECT_EQ(got.ram_evictions, want.ram_evictions);
    EXPECT_EQ(got.disk_evictions, want.disk_evictions);
    EXPECT_EQ(got.promotions, want.promotions);
    EXPECT_EQ(got.orphans_dropped, want.orphans_dropped);
    // The trace exercises what it should: hits, evictions, and (with a disk) both tiers.
    EXPECT_GT(want.chunk_hits_ram, 0u);
    EXPECT_GT(want.ram_evictions, 0u);
    if (c.disk_blocks > 0) {
      EXPECT_GT(want.chunk_hits_disk, 0u);
      EXPECT_GT(want.disk_evictions, 0u);
    }
  }
}

TEST(ReplayTest, TraceFilesAreValidatedLineByLine) {
  const std::string path = absl::StrCat(testing::TempDir(), "/trace.jsonl");
  std::ofstream(path)
      << R"({"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]})"
      << "\n"
      << R"({"timestamp": 1, "input_length": -3, "hash_ids": [1]})"
      << "\n";
  absl::StatusOr<std::vector<TraceRequest>> t = LoadMooncakeTrace(path);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("line 2: input_length"));
  std::ofstream(path) << R"({"timestamp": 0, "input_length": 1100, "hash_ids": [7, 8, 9]})"
                      << "\n";
  t = LoadMooncakeTrace(path);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 1u);
  EXPECT_EQ((*t)[0].hash_ids, (std::vector<uint64_t>{7, 8, 9}));
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

// Conversations that arrive over time (one turn of each every `gap_ms`), for the router's load.
std::vector<TraceRequest> TimedConversations(int n, int turns, double gap_ms) {
  std::vector<TraceRequest> t = Conversations(n, turns);
  for (size_t i = 0; i < t.size(); ++i) t[i].timestamp_ms = static_cast<double>(i) * gap_ms;
  return t;
}

// With room for everything: the shared tier finds every chunk one central store finds (a chunk
// computed on any host is written through and found from every other); per-host stores with
// routing by overlap alone send each conversation back to its history and find as much too,
// except where the router spreads them by load.
TEST(ReplayClusterTest, TheSharedTierFindsWhatOneCentralStoreFinds) {
  const std::vector<TraceRequest> trace = TimedConversations(24, 6, 10);
  const ReplayConfig big{.chunk_bytes = 100, .ram_bytes = 1 << 30};
  const ReplayResult central = ReplayCluster(trace, {.store = big});
  // Heavily loaded hosts: the router spreads turns across hosts, so histories are on another
  // host's store more often than not.
  const ClusterReplayConfig loaded{.store = big,
                                   .layout = StoreLayout::kPerHost,
                                   .hosts = 4,
                                   .shared_bytes = 1 << 30,
                                   .prefill_tokens_per_s = 1000};
  const ReplayResult per_host = ReplayCluster(trace, loaded);
  ClusterReplayConfig with_tier = loaded;
  with_tier.layout = StoreLayout::kSharedTier;
  const ReplayResult shared = ReplayCluster(trace, with_tier);
  EXPECT_GT(central.chunk_hit_rate(), 0.5);
  EXPECT_LT(per_host.chunk_hit_rate(), central.chunk_hit_rate());
  EXPECT_EQ(shared.chunk_hits_ram + shared.chunk_hits_disk + shared.chunk_hits_shared,
            central.chunk_hits_ram + central.chunk_hits_disk);
  EXPECT_GT(shared.chunk_hits_shared, 0u);
  EXPECT_EQ(shared.bytes_read_shared, shared.chunk_hits_shared * 100);
  EXPECT_EQ(shared.shared_evictions, 0u);
  EXPECT_EQ(shared.shared_orphans, 0u);
  // Every host served some of the load.
  ASSERT_EQ(per_host.host_requests.size(), 4u);
  for (uint64_t n : per_host.host_requests) EXPECT_GT(n, 0u);
  // Routing by overlap alone keeps every conversation on the host holding its history (and the
  // shared system prompt draws every new one there too): as good as one store.
  ClusterReplayConfig affinity = loaded;
  affinity.prefill_tokens_per_s = 0;
  EXPECT_EQ(ReplayCluster(trace, affinity).chunk_hit_rate(), central.chunk_hit_rate());
}

// A shared tier with no room changes nothing (the same routing, the same stores); a small one
// evicts by recency alone, as Redis does, and leaves orphans that are counted.
TEST(ReplayClusterTest, ASmallSharedTierEvictsByRecencyAndCountsItsOrphans) {
  const std::vector<TraceRequest> trace = TimedConversations(30, 5, 10);
  const ClusterReplayConfig per_host{.store = {.chunk_bytes = 100, .ram_bytes = 3000},
                                     .layout = StoreLayout::kPerHost,
                                     .hosts = 3,
                                     .prefill_tokens_per_s = 1000};
  const ReplayResult a = ReplayCluster(trace, per_host);
  ClusterReplayConfig none = per_host;
  none.layout = StoreLayout::kSharedTier;
  none.shared_bytes = 0;
  const ReplayResult b = ReplayCluster(trace, none);
  EXPECT_EQ(b.chunk_hits_shared, 0u);
  EXPECT_EQ(b.chunk_hit_rate(), a.chunk_hit_rate());
  EXPECT_EQ(b.host_requests, a.host_requests);
  ClusterReplayConfig small = none;
  small.shared_bytes = 5000;  // 50 chunks of the ~600 the trace computes
  const ReplayResult c = ReplayCluster(trace, small);
  EXPECT_GT(c.shared_evictions, 0u);
  EXPECT_LE(c.shared_chunks, 50u);
  EXPECT_GT(c.shared_orphans, 0u);
  EXPECT_LE(c.shared_orphans, c.shared_chunks);
  EXPECT_GT(c.chunk_hits_shared, 0u);
  // The router credits a chunk in the host's store and one in the tier alike (as the live one
  // does): a tier this small may draw a request off the host holding its history, then lose the
  // chunks it counted on; it costs little either way.
  EXPECT_NEAR(c.chunk_hit_rate(), a.chunk_hit_rate(), 0.02);
}

// What Redis takes for a chunk: jemalloc's classes (16-byte steps to 128 B, then four per
// doubling), and a hash of the chunk's layers costs more than its bytes; the tier then holds
// fewer chunks in the same memory.
TEST(ReplayClusterTest, RedisTakesItsSizeClassesAndStructuresForEachChunk) {
  EXPECT_EQ(JemallocSizeClass(1), 8u);
  EXPECT_EQ(JemallocSizeClass(17), 32u);
  EXPECT_EQ(JemallocSizeClass(128), 128u);
  EXPECT_EQ(JemallocSizeClass(129), 160u);
  EXPECT_EQ(JemallocSizeClass(4096), 4096u);
  EXPECT_EQ(JemallocSizeClass(4097), 5120u);
  EXPECT_EQ(JemallocSizeClass(5386), 6144u);
  EXPECT_EQ(JemallocSizeClass((uint64_t{1} << 20) + 1), (uint64_t{1} << 20) + (1 << 18));
  EXPECT_EQ(RedisChunkBytes(16000, 0), 16000u);
  // A 3-layer chunk of 16 KB (the bundled model's): about 19 KB, as Redis counted on a live run.
  const uint64_t cost = RedisChunkBytes(3 * 5376, 3);
  EXPECT_GT(cost, 18500u);
  EXPECT_LT(cost, 19500u);
  // Large blocks are rounded too: an 8B-class fp16 layer block (2 MiB of K and V and a 64-byte
  // header) takes the next class, 2.5 MiB; one that fits a class loses only the structures.
  const uint64_t fp16 = (uint64_t{2} << 20) + 64;
  EXPECT_GE(RedisChunkBytes(32 * fp16, 32), 32 * (uint64_t{5} << 19));
  const uint64_t fits = (uint64_t{5} << 19) - 1024;
  EXPECT_LT(RedisChunkBytes(32 * fits, 32), 32 * ((uint64_t{5} << 19) + 64) + 256);

  const std::vector<TraceRequest> trace = TimedConversations(30, 5, 10);
  ClusterReplayConfig exact{.store = {.chunk_bytes = 300, .ram_bytes = 3000},
                            .layout = StoreLayout::kSharedTier,
                            .hosts = 3,
                            .shared_bytes = 30000,
                            .prefill_tokens_per_s = 1000};
  ClusterReplayConfig redis = exact;
  redis.shared_layers = 3;
  const ReplayResult e = ReplayCluster(trace, exact);
  const ReplayResult r = ReplayCluster(trace, redis);
  EXPECT_LE(e.shared_chunks, 100u);
  EXPECT_LE(r.shared_chunks, 30000u / RedisChunkBytes(300, 3));
  EXPECT_LT(r.shared_chunks, e.shared_chunks);
  EXPECT_GT(r.shared_evictions, e.shared_evictions);
  EXPECT_EQ(r.bytes_written_shared % 300, 0u);  // what moves is still the chunk's bytes
}

// The tier is Redis's masters: each holds its share of the memory less what it takes before any
// key, and evicts by Redis's approximated LRU. Sampling many keys per eviction is about as good
// as the exact LRU; sampling one is random eviction, worse on conversations that come back.
TEST(ReplayClusterTest, TheTierIsRedisMastersEachWithItsBaselineAndItsSampledLru) {
  // A second apart: Redis's LRU clock (whole seconds) tells the requests apart.
  const std::vector<TraceRequest> trace = TimedConversations(30, 5, 1000);
  const ClusterReplayConfig one{.store = {.chunk_bytes = 100, .ram_bytes = 3000},
                                .layout = StoreLayout::kSharedTier,
                                .hosts = 3,
                                .shared_bytes = 9000,
                                .prefill_tokens_per_s = 1000};
  const ReplayResult exact = ReplayCluster(trace, one);
  EXPECT_LE(exact.shared_chunks, 90u);
  EXPECT_GT(exact.shared_chunks, 80u);
  ClusterReplayConfig three = one;
  three.shared_masters = 3;
  three.shared_baseline_bytes = 1000;
  const ReplayResult t = ReplayCluster(trace, three);
  EXPECT_LE(t.shared_chunks, 60u);  // 3 x (3000 - 1000) / 100
  EXPECT_GT(t.shared_chunks, 45u);  // the chunks spread over every master
  EXPECT_LT(t.chunk_hits_shared, exact.chunk_hits_shared);

  EXPECT_GT(t.shared_evictions, exact.shared_evictions);
}

// Redis's approximated LRU: a master of ten keys, one hot key (0) read every second and a new
// key added each second. An exact LRU never evicts the hot key; Redis's (5 samples into its pool
// of 16) neither, the pool always holding older keys; one sample per eviction is random
// eviction, which takes it now and then.
TEST(ReplayClusterTest, RedisSampledLruKeepsAHotKeyAsAnExactOneDoes) {
  auto hot_evictions = [](uint32_t samples) {
    RedisMasterModel m(1000, samples, /*seed=*/1);
    int evicted_hot = 0, evicted = 0;
    auto count = [&](uint64_t victim) {
      ++evicted;
      evicted_hot += victim == 0;
    };
    for (int64_t t = 0; t < 10; ++t) EXPECT_TRUE(m.Add(t, 100, t, count));
    for (int64_t t = 10; t < 1010; ++t) {
      if (!m.Contains(0)) {
        EXPECT_TRUE(m.Add(0, 100, t, count));  // missed: computed again
      }
      m.Touch(0, t);
      EXPECT_TRUE(m.Add(1000 + t, 100, t, count));
      EXPECT_EQ(m.size(), 10u);
    }
    EXPECT_GE(evicted, 1000);
    return evicted_hot;
  };
  EXPECT_EQ(hot_evictions(0), 0);
  EXPECT_EQ(hot_evictions(5), 0);
  const int random = hot_evictions(1);
  EXPECT_GT(random, 20);  // about one eviction in ten
  EXPECT_LT(random, 250);
  RedisMasterModel m(1000, 5, 1);
  EXPECT_FALSE(m.Add(7, 1001, 0, [](uint64_t) {}));  // larger than the master: not kept
  EXPECT_FALSE(m.Contains(7));
}

// Requests in flight together: a prompt repeated while its first request is still in prefill
// misses (its chunks are not stored yet), and hits once that request is done, on the host that
// computed it or, through the shared tier, on any other.
TEST(ReplayClusterTest, ARequestArrivingWhileItsPrefixIsInPrefillMissesIt) {
  std::vector<TraceRequest> t;
  for (double at : {0.0, 500.0, 5000.0}) {
    TraceRequest r;
    r.timestamp_ms = at;
    r.hash_ids = {1, 2, 3, 4};
    r.input_tokens = 4 * 512;  // 2.048 s of prefill at 1,000 tokens/s
    t.push_back(r);
  }
  for (const StoreLayout layout : {StoreLayout::kPerHost, StoreLayout::kSharedTier}) {
    SCOPED_TRACE(StoreLayoutName(layout));
    ClusterReplayConfig c{.store = {.chunk_bytes = 100, .ram_bytes = 1 << 20},
                          .layout = layout,
                          .hosts = 2,
                          .shared_bytes = 1 << 20,
                          .prefill_tokens_per_s = 1000,
                          .store_credit = 10};  // overlap outweighs load: back to the history
    const ReplayResult at_arrival = ReplayCluster(t, c);
    c.in_flight = true;
    const ReplayResult in_flight = ReplayCluster(t, c);
    // At arrival: the second and third each find all 4 chunks. In flight: the second arrives
    // 0.5 s into the first's 2 s of prefill and finds none; the third finds all 4.
    EXPECT_EQ(at_arrival.tokens_saved, 2u * 4 * 512);
    EXPECT_EQ(in_flight.tokens_saved, 4u * 512);
    EXPECT_EQ(in_flight.chunks_requested, 12u);
  }
}

// Decode nodes store the chunks a request completes while decoding (DecodeEngine::PutGenerated):
// 3 prompt chunks and 1,100 generated tokens end with (1,536 + 1,100 - 1) / 512 = 5 chunks, 2 of
// them new. One store holds the prompt already and takes the 2; with a store per host, a decode
// host other than the prefill host lacks the prompt and takes it too (the live store refuses a
// chunk without its parent, and the node puts from chunk 0).
TEST(ReplayClusterTest, DecodeNodesStoreTheirChunksAndThePromptWhereTheirStoreLacksIt) {
  auto prompt = [](uint64_t first, double at_ms) {
    TraceRequest r;
    r.timestamp_ms = at_ms;
    r.hash_ids = {first, first + 1, first + 2};
    r.input_tokens = 3 * 512;
    r.output_tokens = 1100;
    return r;
  };
  std::vector<TraceRequest> t;
  for (int i = 0; i < 40; ++i) t.push_back(prompt(10 * i + 1, 1000.0 * i));
  const ReplayConfig big{.chunk_bytes = 100, .ram_bytes = 1 << 20};
  const ReplayResult central = ReplayCluster(t, {.store = big});
  EXPECT_EQ(central.decode_writers, 40u);
  EXPECT_EQ(central.decode_generated_chunks, 80u);
  EXPECT_EQ(central.decode_prompt_copies, 0u);
  ClusterReplayConfig off{.store = big};
  off.decode_puts = false;
  EXPECT_EQ(ReplayCluster(t, off).decode_writers, 0u);
  // One host is one store whatever the layout: no tier, and the decode nodes' puts as above.
  const ReplayResult one_host = ReplayCluster(
      t, {.store = big, .layout = StoreLayout::kSharedTier, .hosts = 1, .shared_bytes = 1 << 20});
  EXPECT_EQ(one_host.bytes_written_shared, 0u);
  EXPECT_EQ(one_host.tokens_saved, central.tokens_saved);
  EXPECT_EQ(one_host.decode_generated_chunks, 80u);
  for (const StoreLayout layout : {StoreLayout::kPerHost, StoreLayout::kSharedTier}) {
    SCOPED_TRACE(StoreLayoutName(layout));
    const ClusterReplayConfig c{
        .store = big, .layout = layout, .hosts = 2, .shared_bytes = 1 << 20};
    const ReplayResult r = ReplayCluster(t, c);
    EXPECT_EQ(r.decode_generated_chunks, 80u);
    // Each request whose decode host was not its prefill host copied its 3 prompt chunks: about
    // half of them, the decode host being drawn at random.
    EXPECT_EQ(r.decode_prompt_copies % 3, 0u);
    EXPECT_GT(r.decode_prompt_copies, 3u * 5);
    EXPECT_LT(r.decode_prompt_copies, 3u * 35);
    if (layout == StoreLayout::kSharedTier) {  // every chunk stored is written through
      EXPECT_EQ(r.bytes_written_shared, (40u * 3 + 80) * 100);
    }
  }
  // The store evicts chains from their ends, so a decode's chunks, which extend the prompt's,
  // go before the prompt does: a repeat of the prompt in a store of 4 chunks finds all 3.
  std::vector<TraceRequest> again = {prompt(1, 0), prompt(1, 1000)};
  const ReplayResult tight = ReplayCluster(
      again, {.store = {.chunk_bytes = 100, .ram_bytes = 400, .ram_policy = PolicyKind::kLru}});
  // The first decode's second chunk pushed out its first (the chain's end) and so lost its
  // parent; the repeat's decode took one more: 2 in all.
  EXPECT_EQ(tight.decode_generated_chunks, 2u);
  EXPECT_EQ(tight.ram_evictions, 1u);
  EXPECT_EQ(tight.tokens_saved, 3u * 512);
}

TEST(ReplayClusterTest, LayoutNamesParseAndUnknownOnesAreRefused) {
  for (StoreLayout l : {StoreLayout::kCentral, StoreLayout::kPerHost, StoreLayout::kSharedTier}) {
    EXPECT_EQ(*ParseStoreLayout(StoreLayoutName(l)), l);
  }
  absl::StatusOr<StoreLayout> bad = ParseStoreLayout("mesh");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("mesh"));
}

}  // namespace
}  // namespace strata::kvstore
