// Two hosts' stores (each a BlockStore behind its StoreService) in front of one shared tier on a
// real Redis Cluster (started on loopback): a chain put through host A's store is found by host
// B's Lookup — read from the shared tier, promoted into B's store whole chunk by whole chunk, then
// served by B locally; a chunk with one layer missing or damaged in Redis ends the promotion
// there (a chunk is only useful after its whole prefix); the shared tier's counters reach the
// store's metrics.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvstore/block_store.h"
#include "kvstore/shared_tier.h"
#include "kvstore/store_service.h"
#include "kvstore/test_blocks.h"
#include "kvstore/testing/redis_cluster_process.h"
#include "proto/store.pb.h"

namespace strata::kvstore {
namespace {

using testing::RedisClusterProcess;

constexpr uint64_t kModel = 991;
constexpr uint32_t kLayers = 3, kChunks = 5;

struct Host {
  std::unique_ptr<BlockStore> store;
  std::unique_ptr<SharedTier> tier;
  std::unique_ptr<StoreService> service;
};

class SharedTierStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!RedisClusterProcess::Installed()) {
      GTEST_SKIP() << "skipped: no redis-server (scripts/setup.sh installs it)";
    }
    redis_ = std::make_unique<RedisClusterProcess>(3, 0);
    std::string why;
    ASSERT_TRUE(redis_->Start(&why)) << why;
    for (Host* h : {&a_, &b_}) {
      h->store = *BlockStore::Open({.ram_bytes = 1 << 24});
      absl::StatusOr<std::unique_ptr<SharedTier>> t =
          SharedTier::Connect({.redis = {.seeds = {redis_->seed()}}});
      ASSERT_TRUE(t.ok()) << t.status();
      h->tier = *std::move(t);
      h->service = std::make_unique<StoreService>(h->store.get(), 1 << 20, h->tier.get());
    }
    // One chain of kChunks chunks, kLayers layers each.
    for (uint32_t c = 0; c < kChunks; ++c) {
      chain_.push_back(test_blocks::Key(c, 77));
      for (uint32_t l = 0; l < kLayers; ++l)
        blocks_.push_back(test_blocks::MakeBlock(kModel, l, c, 10 * c + l));
    }
  }
  const AlignedBuffer& Block(uint32_t c, uint32_t l) const { return blocks_[c * kLayers + l]; }
  BlockName Name(uint32_t c, uint32_t l) const { return test_blocks::Name(Block(c, l), chain_[c]); }

  void PutChain(Host& h, uint32_t chunks) {
    for (uint32_t c = 0; c < chunks; ++c) {
      for (uint32_t l = 0; l < kLayers; ++l) {
        strata::v1::PutRequest req;
        req.set_name(Name(c, l).Encode());
        if (c > 0) req.set_parent_key(std::string(chain_[c - 1].begin(), chain_[c - 1].end()));
        req.set_block(
            std::string(reinterpret_cast<const char*>(Block(c, l).data()), Block(c, l).size()));
        strata::v1::PutResponse resp;
        ASSERT_TRUE(h.service->Put(nullptr, &req, &resp).ok());
      }
    }
  }
  uint32_t Lookup(Host& h) {
    strata::v1::LookupRequest req;
    const BlockName n = Name(0, 0);
    req.set_model_fingerprint(n.model_fingerprint);
    req.set_codec_fingerprint(n.codec_fingerprint);
    req.set_calibration_fingerprint(n.calibration_fingerprint);
    req.set_layers(kLayers);
    for (const BlockHash& k : chain_) req.add_chain(std::string(k.begin(), k.end()));
    strata::v1::LookupResponse resp;
    EXPECT_TRUE(h.service->Lookup(nullptr, &req, &resp).ok());
    return resp.chunks();
  }

  std::unique_ptr<RedisClusterProcess> redis_;
  Host a_, b_;
  std::vector<BlockHash> chain_;
  std::vector<AlignedBuffer> blocks_;
};

TEST_F(SharedTierStoreTest, AChainPutOnOneHostIsFoundAndPromotedOnAnother) {
  PutChain(a_, kChunks);
  EXPECT_EQ(a_.tier->Stats().puts, kChunks * kLayers);  // written through
  EXPECT_EQ(b_.store->Stats().puts, 0u);
  EXPECT_EQ(Lookup(b_), kChunks);                        // from the shared tier
  EXPECT_EQ(b_.store->Stats().puts, kChunks * kLayers);  // promoted, every block
  for (uint32_t c = 0; c < kChunks; ++c) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      absl::StatusOr<Lease> lease = b_.store->Get(Name(c, l));
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_TRUE(lease->bytes() == Block(c, l).span());
    }
  }
  // The next Lookup is local: no shared-tier read.
  const uint64_t gets = b_.tier->Stats().gets;
  EXPECT_EQ(Lookup(b_), kChunks);
  EXPECT_EQ(b_.tier->Stats().gets, gets);
  const std::string metrics = b_.service->RenderMetrics();
  EXPECT_NE(metrics.find("strata_store_shared_promoted_blocks_total 15"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("strata_store_shared_hits_total 15"), std::string::npos);
}

// A second block under a name already stored (two writers whose KV differed in rounding) is
// refused by the store, and the shared tier keeps the first writer's bytes too.
TEST_F(SharedTierStoreTest, AConflictingBlockIsNotWrittenThrough) {
  PutChain(a_, 1);
  const AlignedBuffer other = test_blocks::MakeBlock(kModel, 0, 0, 12345);
  ASSERT_EQ(test_blocks::Name(other, chain_[0]), Name(0, 0));
  ASSERT_FALSE(other.span() == Block(0, 0).span());
  strata::v1::PutRequest req;
  req.set_name(Name(0, 0).Encode());
  req.set_block(std::string(reinterpret_cast<const char*>(other.data()), other.size()));
  strata::v1::PutResponse resp;
  EXPECT_EQ(a_.service->Put(nullptr, &req, &resp).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  std::vector<absl::StatusOr<SharedBytes>> got = a_.tier->Get({{Name(0, 0), 0}});
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_TRUE(got[0]->span() == Block(0, 0).span());  // the first writer's
  EXPECT_EQ(a_.tier->Stats().puts, kLayers);
}

TEST_F(SharedTierStoreTest, PromotionStopsAtTheFirstIncompleteOrDamagedChunk) {
  PutChain(a_, kChunks);
  // Chunk 3 layer 1 gone from Redis; chunk 2 layer 2 damaged there.
  RedisCluster& redis = a_.tier->redis();
  const absl::Time soon = absl::Now() + absl::Seconds(5);
  // (A chunk is a hash, the layer its field: SharedTier::KeyOf, FieldOf.)
  const std::string k3 = a_.tier->KeyOf(Name(3, 1)), k2 = a_.tier->KeyOf(Name(2, 2));
  ASSERT_TRUE(redis.Run({{"HDEL", k3, SharedTier::FieldOf(Name(3, 1))}}, soon)[0].ok());
  absl::StatusOr<RedisReply> v = redis.Run({{"HGET", k2, SharedTier::FieldOf(Name(2, 2))}}, soon)[0];
  ASSERT_TRUE(v.ok() && v->type == RedisReply::Type::kString) << v.status();
  std::string damaged = v->str;
  damaged[300] ^= 0x55;
  ASSERT_TRUE(redis.Run({{"HSET", k2, SharedTier::FieldOf(Name(2, 2)), damaged}}, soon)[0].ok());
  EXPECT_EQ(Lookup(b_), 2u);  // chunks 0 and 1 whole; chunk 2 has a damaged layer
  EXPECT_EQ(b_.tier->Stats().damaged, 1u);
  EXPECT_EQ(b_.store->Stats().puts, 2u * kLayers);
  EXPECT_FALSE(b_.store->Get(Name(2, 0)).ok());  // nothing of chunk 2 promoted
  // Host B recomputes chunk 2 on (its own puts, written through again): then chunk 3 stops it.
  PutChain(b_, 3);
  EXPECT_EQ(Lookup(b_), 3u);
}

}  // namespace
}  // namespace strata::kvstore
