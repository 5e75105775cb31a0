// A node's way to the shared tier when its host's store is away (issue 45, "a store host lost: its
// nodes fall back to the shared tier, then recompute, never fail").
//
// SharedTierBlockSource is the shared tier (shared_tier.h) as a BlockSource: Lookup walks a chain
// from its first chunk while every layer's block is in Redis; Get reads a block Lookup found
// (the tier needs the chunk's index, to check the block and renew its TTL: a name no Lookup
// walked is a miss); Put writes through. It connects lazily, and after a failed attempt tries
// again no sooner than `retry_after`, so a node whose Redis is away too pays one attempt now and
// then, not one per request; while one caller's attempt runs (seconds, when Redis does not
// answer), the others are told UNAVAILABLE at once rather than wait for it.
//
// FailoverBlockSource puts a primary (the host's store) in front of a fallback (the shared tier):
// each call goes to the primary, and to the fallback only when the primary cannot answer
// (kUnavailable, kDeadlineExceeded); a primary's miss or refusal is an answer. What the primary's
// Lookup found is noted with the fallback (NoteChain), so a primary lost between a request's
// Lookup and its Gets still has them served by the fallback. Puts the primary
// cannot take go to the fallback, so a prefix computed while the store is away still reaches the
// other hosts. When both fail the caller sees the failure and recomputes: never worse than
// without a fallback.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "kvstore/block_source.h"
#include "kvstore/shared_tier.h"

namespace strata::kvstore {

class SharedTierBlockSource final : public BlockSource {
 public:
  explicit SharedTierBlockSource(SharedTierOptions options,
                                 absl::Duration retry_after = absl::Seconds(5));

  absl::StatusOr<uint32_t> Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                  absl::Span<const uint64_t> layer_codec_fingerprints) override;
  absl::StatusOr<SharedBytes> Get(const BlockName& name) override;
  absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block) override;
  // Remembers chain[i]'s chunk index i, as a Lookup that walked it would.
  void NoteChain(absl::Span<const BlockHash> chain) override;
  // The tier verifies every block it returns (checksum and name).
  bool verified_on_get() const override { return true; }
  std::string Describe() const override;

  // The tier once connected (null before): its counters.
  SharedTier* tier();

 private:
  // The tier, connecting when due; kUnavailable naming why when it cannot be had now.
  absl::StatusOr<SharedTier*> Tier();
  void Remember(const BlockHash& key, uint32_t chunk);

  const SharedTierOptions options_;
  const absl::Duration retry_after_;
  // The connection. An attempt runs without the lock (it may take seconds when Redis is away);
  // callers meanwhile are told UNAVAILABLE at once.
  std::mutex mu_;
  std::unique_ptr<SharedTier> tier_;                // guarded by mu_ (set once)
  bool connecting_ = false;                         // guarded by mu_
  absl::Time next_attempt_ = absl::InfinitePast();  // guarded by mu_
  absl::Status last_error_;                         // guarded by mu_
  // Chunk index of each prefix key a Lookup walked (or a Put wrote), for Get. Bounded by two
  // generations: when the current one fills it becomes the previous one, so a request between
  // its Lookup and its Gets keeps its entries.
  std::mutex keys_mu_;
  absl::flat_hash_map<BlockHash, uint32_t> chunk_of_;  // guarded by keys_mu_
  absl::flat_hash_map<BlockHash, uint32_t> older_;     // guarded by keys_mu_
};

class FailoverBlockSource final : public BlockSource {
 public:
  // Both must outlive it.
  FailoverBlockSource(BlockSource* primary, BlockSource* fallback)
      : primary_(primary), fallback_(fallback) {}

  absl::StatusOr<uint32_t> Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                  absl::Span<const uint64_t> layer_codec_fingerprints) override;
  absl::StatusOr<SharedBytes> Get(const BlockName& name) override;
  absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block) override;
  // The primary's batch (one stream to a remote store); the items it could not take for want of
  // an answer, or all of them when the call itself failed so, go to the fallback.
  absl::StatusOr<std::vector<absl::Status>> PutMany(absl::Span<const PutItem> items) override;
  void NoteChain(absl::Span<const BlockHash> chain) override {
    primary_->NoteChain(chain);
    fallback_->NoteChain(chain);
  }
  bool verified_on_get() const override {
    return primary_->verified_on_get() && fallback_->verified_on_get();
  }
  std::string Describe() const override;

  struct Stats {
    uint64_t lookups = 0, gets = 0, puts = 0;  // calls the fallback answered
    uint64_t failed = 0;                       // calls neither answered
  };
  Stats stats() const;

  // Whether the primary could not answer: only then does a call go to the fallback.
  static bool Unreachable(const absl::Status& s);

 private:
  BlockSource* const primary_;
  BlockSource* const fallback_;
  std::atomic<uint64_t> lookups_{0}, gets_{0}, puts_{0}, failed_{0};
};

}  // namespace strata::kvstore
