// BlockSource: what a serving node needs of a block store, whether the store is embedded in the
// node (a BlockStore) or a `strata-store` reached over gRPC (StoreClient): longest cached prefix,
// Get, Put. Prefill and decode engines take one, so the same engine runs in one process over an
// embedded store and in a cluster over the store service.
//
// Thread-safe: every implementation may be called from several threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "kvstore/block_store.h"

namespace strata::kvstore {

// One block of a batched Put.
struct PutItem {
  BlockName name;
  std::optional<BlockHash> parent;  // chunk > 0
  SharedBytes block;
};

class BlockSource {
 public:
  virtual ~BlockSource() = default;
  // Leading chunks of `chain` present for every layer, layer l named with
  // layer_codec_fingerprints[l] (prefix supplies the model and calibration fingerprints).
  virtual absl::StatusOr<uint32_t> Lookup(const BlockName& prefix,
                                          absl::Span<const BlockHash> chain,
                                          absl::Span<const uint64_t> layer_codec_fingerprints) = 0;
  // The block's bytes; kNotFound on a miss.
  virtual absl::StatusOr<SharedBytes> Get(const BlockName& name) = 0;
  virtual absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block) = 0;
  // Puts in order (parents before their children), one status per item (what Put would have
  // returned); the call's own failure (a broken stream) is the returned status. Default: Put
  // each; a remote store sends them over one stream.
  virtual absl::StatusOr<std::vector<absl::Status>> PutMany(absl::Span<const PutItem> items) {
    std::vector<absl::Status> out;
    out.reserve(items.size());
    for (const PutItem& item : items) {
      out.push_back(Put(item.name, item.parent.has_value() ? &*item.parent : nullptr, item.block));
    }
    return out;
  }
  // `chain`'s leading chunks were found elsewhere (another source's Lookup), and Gets of their
  // blocks may come here: a source that must walk a chain before it can serve a Get (the shared
  // tier needs each chunk's index) notes it, without a round trip. Default: nothing.
  virtual void NoteChain(absl::Span<const BlockHash> chain) { (void)chain; }
  // True when Get's bytes were checksum-verified in this process (an embedded store keeps only
  // verified blocks); false when they crossed a network (the caller verifies once, on use).
  virtual bool verified_on_get() const = 0;
  virtual std::string Describe() const = 0;
};

// An embedded store as a BlockSource (`store` must outlive it).
class EmbeddedBlockSource final : public BlockSource {
 public:
  explicit EmbeddedBlockSource(BlockStore* store) : store_(store) {}
  absl::StatusOr<uint32_t> Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                  absl::Span<const uint64_t> layer_codec_fingerprints) override {
    return store_->Lookup(prefix, chain, layer_codec_fingerprints).chunks;
  }
  absl::StatusOr<SharedBytes> Get(const BlockName& name) override {
    absl::StatusOr<Lease> lease = store_->Get(name);
    if (!lease.ok()) return lease.status();
    return lease->shared();
  }
  absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block) override {
    return store_->Put(name, parent, std::move(block));
  }
  bool verified_on_get() const override { return true; }
  std::string Describe() const override { return "embedded store"; }

 private:
  BlockStore* store_;
};

// A node's own RAM tier in front of the shared store: what the node computed (or Puts) it keeps
// locally as well, and it reads its own blocks before asking the store. Lookup is the longer of
// the two prefixes (each chunk of it is in one or the other); Get tries the local tier first;
// Put and PutMany go to both, and a block is stored (OK) when either tier took it: the node can
// read it back (a preempted sequence resumes from it, also while the store is away). Each tier's
// failures are counted. Both must outlive it; `remote` may be null.
class TieredBlockSource final : public BlockSource {
 public:
  TieredBlockSource(BlockStore* local, BlockSource* remote) : local_(local), remote_(remote) {}
  absl::StatusOr<uint32_t> Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                  absl::Span<const uint64_t> layer_codec_fingerprints) override;
  absl::StatusOr<SharedBytes> Get(const BlockName& name) override;
  absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block) override;
  absl::StatusOr<std::vector<absl::Status>> PutMany(absl::Span<const PutItem> items) override;
  // Local blocks were verified when stored; the store's cross a network: the caller verifies.
  bool verified_on_get() const override { return remote_ == nullptr; }
  std::string Describe() const override;

  struct Stats {
    uint64_t local_hits = 0, remote_hits = 0;  // Get
    uint64_t local_put_errors = 0;
    uint64_t remote_put_errors = 0;  // the shared store refused (or was away) but the node holds it
  };
  Stats stats() const;

 private:
  BlockStore* const local_;
  BlockSource* const remote_;
  std::atomic<uint64_t> local_hits_{0}, remote_hits_{0}, local_put_errors_{0},
      remote_put_errors_{0};
};

}  // namespace strata::kvstore
