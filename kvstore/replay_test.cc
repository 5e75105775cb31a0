#include "kvstore/replay.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
  const ReplayResult ram_only = Replay(trace, {.chunk_bytes = 100, .ram_bytes = 1000,
                                               .ram_policy = PolicyKind::kLru});
  const ReplayResult with_disk = Replay(trace, {.chunk_bytes = 100, .ram_bytes = 1000,
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

TEST(ReplayTest, TraceFilesAreValidatedLineByLine) {
  const std::string path = absl::StrCat(testing::TempDir(), "/trace.jsonl");
  std::ofstream(path) << R"({"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]})"
                      << "\n"
                      << R"({"timestamp": 1, "input_length": -3, "hash_ids": [1]})" << "\n";
  absl::StatusOr<std::vector<TraceRequest>> t = LoadMooncakeTrace(path);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("line 2: input_length"));
  std::ofstream(path) << R"({"timestamp": 0, "input_length": 1100, "hash_ids": [7, 8, 9]})" << "\n";
  t = LoadMooncakeTrace(path);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 1u);
  EXPECT_EQ((*t)[0].hash_ids, (std::vector<uint64_t>{7, 8, 9}));
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::kvstore
