// A node's fallback to the shared tier (shared_tier_source.h): the tier as a BlockSource on a real
// Redis Cluster (chains found from their first chunk, blocks read once looked up, writes through),
// an unreachable tier that is tried again only after a while, and the failover that asks the
// fallback only when the primary cannot answer.
#include "kvstore/shared_tier_source.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvstore/block_store.h"
#include "kvstore/test_blocks.h"
#include "kvstore/testing/redis_cluster_process.h"

namespace strata::kvstore {
namespace {

using testing::RedisClusterProcess;

constexpr uint64_t kModel = 4242;
constexpr uint32_t kLayers = 2;

struct Chain {
  std::vector<BlockHash> keys;
  std::vector<SharedBytes> blocks;  // [chunk * kLayers + layer]
  BlockName Name(uint32_t c, uint32_t l) const {
    const BlockHeader h = BlockView::Parse(blocks[c * kLayers + l].span())->header();
    return BlockName{h.model_fingerprint, h.codec_fingerprint, h.calibration_fingerprint, keys[c],
                     h.layer};
  }
  SharedBytes Bytes(uint32_t c, uint32_t l) const { return blocks[c * kLayers + l]; }
  std::vector<uint64_t> Fingerprints() const {
    std::vector<uint64_t> f;
    for (uint32_t l = 0; l < kLayers; ++l) f.push_back(Name(0, l).codec_fingerprint);
    return f;
  }
};

Chain MakeChain(uint32_t chunks, uint8_t tag) {
  Chain c;
  for (uint32_t i = 0; i < chunks; ++i) {
    c.keys.push_back(test_blocks::Key(i, tag));
    for (uint32_t l = 0; l < kLayers; ++l) {
      c.blocks.push_back(
          SharedBytes::FromBuffer(test_blocks::MakeBlock(kModel, l, i, 100 * tag + 10 * i + l)));
    }
  }
  return c;
}

class SharedTierSourceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!RedisClusterProcess::Installed()) return;
    redis_ = new RedisClusterProcess(3, 0);
    std::string why;
    if (!redis_->Start(&why)) {
      start_error_ = new std::string(why);
    }
  }
  static void TearDownTestSuite() {
    delete redis_;
    redis_ = nullptr;
  }
  void SetUp() override {
    if (!RedisClusterProcess::Installed()) {
      GTEST_SKIP() << "skipped: no redis-server (scripts/setup.sh installs it)";
    }
    ASSERT_EQ(start_error_, nullptr) << *start_error_;
  }
  static SharedTierOptions Options() { return {.redis = {.seeds = {redis_->seed()}}}; }

  static RedisClusterProcess* redis_;
  static std::string* start_error_;
};
RedisClusterProcess* SharedTierSourceTest::redis_ = nullptr;
std::string* SharedTierSourceTest::start_error_ = nullptr;

// Host A writes a chain through; host B (another source over the same cluster) finds it from its
// first chunk, reads what it looked up, and misses a name no Lookup walked.
TEST_F(SharedTierSourceTest, AChainWrittenByOneHostIsFoundAndReadByAnother) {
  const Chain chain = MakeChain(3, 31);
  SharedTierBlockSource a(Options()), b(Options());
  for (uint32_t c = 0; c < 3; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(
          a.Put(chain.Name(c, l), c > 0 ? &chain.keys[c - 1] : nullptr, chain.Bytes(c, l)).ok());
    }
  }
  EXPECT_EQ(b.Get(chain.Name(0, 0)).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<uint32_t> found = b.Lookup(chain.Name(0, 0), chain.keys, chain.Fingerprints());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, 3u);
  for (uint32_t c = 0; c < 3; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      absl::StatusOr<SharedBytes> got = b.Get(chain.Name(c, l));
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(got->span() == chain.Bytes(c, l).span());
    }
  }
  EXPECT_TRUE(b.verified_on_get());
  ASSERT_NE(b.tier(), nullptr);
  EXPECT_EQ(b.tier()->Stats().hits, 3u * kLayers);

  // A chain whose middle chunk lacks a layer: found up to it.
  const Chain gap = MakeChain(3, 32);
  for (uint32_t c = 0; c < 3; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      if (c == 1 && l == 1) continue;
      ASSERT_TRUE(a.Put(gap.Name(c, l), nullptr, gap.Bytes(c, l)).ok());
    }
  }
  EXPECT_EQ(*b.Lookup(gap.Name(0, 0), gap.keys, gap.Fingerprints()), 1u);
}

// A tier nobody answers for: kUnavailable, and no new attempt before `retry_after`.
TEST(SharedTierBlockSourceTest, AnUnreachableTierIsUnavailableAndTriedAgainOnlyLater) {
  const Chain chain = MakeChain(1, 33);
  SharedTierOptions o{.redis = {.seeds = {"127.0.0.1:1"}}};
  SharedTierBlockSource src(o, absl::Hours(1));
  absl::StatusOr<uint32_t> first = src.Lookup(chain.Name(0, 0), chain.keys, chain.Fingerprints());
  EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable) << first.status();
  const absl::Time t0 = absl::Now();
  absl::Status put = src.Put(chain.Name(0, 0), nullptr, chain.Bytes(0, 0));
  EXPECT_EQ(put.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(put.message().find("not connected"), std::string::npos) << put;
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(100));  // no second connection attempt
  EXPECT_EQ(src.tier(), nullptr);
}

// A primary that answers as told.
class Scripted final : public BlockSource {
 public:
  explicit Scripted(BlockSource* inner) : inner_(inner) {}
  absl::Status answer = absl::OkStatus();  // non-OK: every call fails so
  absl::StatusOr<uint32_t> Lookup(const BlockName& p, absl::Span<const BlockHash> c,
                                  absl::Span<const uint64_t> f) override {
    if (!answer.ok()) return answer;
    return inner_->Lookup(p, c, f);
  }
  absl::StatusOr<SharedBytes> Get(const BlockName& n) override {
    if (!answer.ok()) return answer;
    return inner_->Get(n);
  }
  absl::Status Put(const BlockName& n, const BlockHash* p, SharedBytes b) override {
    if (!answer.ok()) return answer;
    return inner_->Put(n, p, std::move(b));
  }
  bool verified_on_get() const override { return false; }
  std::string Describe() const override { return "scripted"; }

 private:
  BlockSource* inner_;
};

TEST(FailoverBlockSourceTest, TheFallbackAnswersOnlyWhenThePrimaryCannot) {
  const Chain chain = MakeChain(2, 34);
  std::unique_ptr<BlockStore> host = *BlockStore::Open({.ram_bytes = 1 << 22});
  std::unique_ptr<BlockStore> shared = *BlockStore::Open({.ram_bytes = 1 << 22});
  EmbeddedBlockSource host_source(host.get()), shared_source(shared.get());
  Scripted primary(&host_source);
  FailoverBlockSource failover(&primary, &shared_source);
  for (uint32_t c = 0; c < 2; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(
          shared_source
              .Put(chain.Name(c, l), c > 0 ? &chain.keys[c - 1] : nullptr, chain.Bytes(c, l))
              .ok());
    }
  }
  // The primary answers (a miss is an answer): the fallback is not asked.
  EXPECT_EQ(*failover.Lookup(chain.Name(0, 0), chain.keys, chain.Fingerprints()), 0u);
  EXPECT_EQ(failover.Get(chain.Name(0, 0)).status().code(), absl::StatusCode::kNotFound);
  primary.answer = absl::InvalidArgumentError("refused");
  EXPECT_EQ(failover.Get(chain.Name(0, 0)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(failover.stats().gets, 0u);
  // The primary is away: the fallback answers.
  for (const absl::Status& away :
       {absl::UnavailableError("store down"), absl::DeadlineExceededError("store slow")}) {
    primary.answer = away;
    EXPECT_EQ(*failover.Lookup(chain.Name(0, 0), chain.keys, chain.Fingerprints()), 2u);
    absl::StatusOr<SharedBytes> got = failover.Get(chain.Name(1, 1));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->span() == chain.Bytes(1, 1).span());
  }
  EXPECT_EQ(failover.stats().lookups, 2u);
  EXPECT_EQ(failover.stats().gets, 2u);
  // Puts it cannot take go to the fallback, singly or batched.
  const Chain more = MakeChain(2, 35);
  primary.answer = absl::UnavailableError("store down");
  EXPECT_TRUE(failover.Put(more.Name(0, 0), nullptr, more.Bytes(0, 0)).ok());
  std::vector<PutItem> batch = {{more.Name(0, 1), std::nullopt, more.Bytes(0, 1)}};
  absl::StatusOr<std::vector<absl::Status>> many = failover.PutMany(batch);
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_TRUE((*many)[0].ok()) << (*many)[0];
  EXPECT_TRUE(shared->Get(more.Name(0, 1)).ok());
  EXPECT_EQ(failover.stats().puts, 2u);
  EXPECT_FALSE(host->Get(more.Name(0, 0)).ok());
  // Neither answers: the primary's failure, counted (the caller recomputes).
  Scripted dead_fallback(&shared_source);
  dead_fallback.answer = absl::UnavailableError("redis down");
  FailoverBlockSource both_down(&primary, &dead_fallback);
  absl::StatusOr<uint32_t> none =
      both_down.Lookup(chain.Name(0, 0), chain.keys, chain.Fingerprints());
  EXPECT_EQ(none.status().message(), "store down");
  EXPECT_EQ(both_down.stats().failed, 1u);
}

// The host's store answers a request's Lookup, then is lost before its Gets: the shared tier,
// told what the store's Lookup found, serves them (before, it knew no chunk index for them and
// missed, and the request recomputed what Redis held).
TEST_F(SharedTierSourceTest, AStoreLostBetweenLookupAndGetHasTheGetsServedByTheSharedTier) {
  const Chain chain = MakeChain(3, 36);
  std::unique_ptr<BlockStore> host = *BlockStore::Open({.ram_bytes = 1 << 22});
  EmbeddedBlockSource host_source(host.get());
  SharedTierBlockSource writer(Options()), reader(Options());
  for (uint32_t c = 0; c < 3; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      const BlockHash* parent = c > 0 ? &chain.keys[c - 1] : nullptr;
      ASSERT_TRUE(host_source.Put(chain.Name(c, l), parent, chain.Bytes(c, l)).ok());
      ASSERT_TRUE(writer.Put(chain.Name(c, l), parent, chain.Bytes(c, l)).ok());
    }
  }
  Scripted primary(&host_source);
  FailoverBlockSource failover(&primary, &reader);
  absl::StatusOr<uint32_t> found =
      failover.Lookup(chain.Name(0, 0), chain.keys, chain.Fingerprints());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, 3u);
  EXPECT_EQ(failover.stats().lookups, 0u);  // the store answered
  primary.answer = absl::UnavailableError("store lost");
  for (uint32_t c = 0; c < 3; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      absl::StatusOr<SharedBytes> got = failover.Get(chain.Name(c, l));
      ASSERT_TRUE(got.ok()) << "chunk " << c << " layer " << l << ": " << got.status();
      EXPECT_TRUE(got->span() == chain.Bytes(c, l).span());
    }
  }
  EXPECT_EQ(failover.stats().gets, 3u * kLayers);
  EXPECT_EQ(failover.stats().failed, 0u);
  // A chain the store's Lookup did not reach is still unknown to the tier: a miss, not a guess.
  const Chain other = MakeChain(1, 37);
  EXPECT_EQ(failover.Get(other.Name(0, 0)).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace strata::kvstore
