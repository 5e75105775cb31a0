// BlockStore: Strata blocks kept by (prefix key, layer) across tiers — host RAM, then local disk
// (the blocks in a log of files of their own, kvstore/block_log.h, indexed in RocksDB) — with
// eviction, spill and promotion, and a disk tier that survives restarts. Embeddable in any node; `strata-store` serves it over gRPC.
//
//   StoreOptions o{.ram_bytes = 8ull << 30, .disk_path = "/nvme/strata", .disk_bytes = 1ull << 40};
//   STRATA_ASSIGN_OR_RETURN(auto store, BlockStore::Open(o));
//   STRATA_RETURN_IF_ERROR(store->Put(name, &parent_key, block_bytes));
//   LookupResult hit = store->Lookup(prefix, chain_of_keys, layers);   // leading chunks present
//   STRATA_ASSIGN_OR_RETURN(Lease lease, store->Get(name));             // zero-copy, pinned
//
// Semantics:
// - Put is idempotent; a block whose checksum or structure fails is refused (kDataLoss), and so
//   is a block whose header disagrees with its name (layer, fingerprints).
// - A block's parent is the previous chunk's block of the same layer (nullptr for chunk 0). A
//   block whose parent is in no tier is refused (kFailedPrecondition), and when a block leaves
//   every tier its descendants are dropped too: a chunk is only useful after its whole prefix.
// - RAM is byte-accurate: the bytes of resident blocks never exceed ram_bytes. Block buffers come
//   from a pool that reuses freed ones of the same size (at most ram_bytes / 4 idle). Eviction (LRU or
//   S3-FIFO) spills to disk through a bounded write-back queue (when the queue is full the
//   evicting call writes through itself); the disk evicts for good (LRU). A hit on disk is
//   promoted to RAM; the disk copy stays (inclusive), so a later eviction costs no write.
// - Leases pin: a leased block is never evicted; the bytes stay valid until the lease drops,
//   even if the block is deleted meanwhile.
// - Durability: with `durable_puts` (the default when there is a disk tier) Put writes the block
//   through to disk (the block log, then RocksDB's write-ahead log; no fsync) before it returns, so a killed process
//   (kill -9) loses at most the Puts that had not returned; RAM then holds copies, and evicting
//   one costs no write. Without it, blocks reach the disk only when evicted from RAM (write-
//   back), and a crash loses what was only in RAM — a cache's trade for less disk traffic. After
//   a restart the disk tier's index is rebuilt from RocksDB (log space nothing names, left by a
//   crash, is given back); a block corrupted on disk is detected by its checksum when read,
//   counted, dropped and reported as a miss — never served. Blocks of stores written before the
//   block log (in RocksDB's blob files) are still read.
// Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"
#include "common/prefix_key.h"
#include "common/buffer_pool.h"
#include "kvstore/block_log.h"
#include "kvstore/eviction_policy.h"

namespace rocksdb {
class DB;
}

namespace strata::kvstore {

enum class Tier : uint8_t { kNone = 0, kRam = 1, kDisk = 2 };
const char* TierName(Tier t);

struct StoreOptions {
  size_t ram_bytes = size_t{1} << 30;
  std::string disk_path = "";   // empty: RAM only
  size_t disk_bytes = 0;        // capacity of the disk tier (value bytes)
  PolicyKind ram_policy = PolicyKind::kS3Fifo;
  size_t spill_queue_bytes = size_t{256} << 20;  // bytes waiting to be written to disk
  size_t max_block_bytes = size_t{64} << 20;     // larger Puts are refused
  bool durable_puts = true;                      // write through to disk before Put returns
};

struct StoreStats {
  uint64_t puts = 0, duplicate_puts = 0, refused_puts = 0;
  uint64_t ram_hits = 0, disk_hits = 0, misses = 0;
  uint64_t ram_evictions = 0, disk_evictions = 0, spills = 0, promotions = 0;
  uint64_t orphans_dropped = 0, corruptions = 0, deletes = 0;
  uint64_t ram_blocks = 0, ram_bytes = 0, disk_blocks = 0, disk_bytes = 0;
  uint64_t spill_queue_bytes = 0;
  uint64_t pool_idle_bytes = 0;  // freed block buffers kept for reuse (not counted in ram_bytes)
  uint64_t pool_reuses = 0;      // block buffers handed out again instead of allocated
};

// A pinned, zero-copy view of a block.
class Lease {
 public:
  Lease() = default;
  absl::Span<const uint8_t> bytes() const { return buffer_ ? buffer_->span() : absl::Span<const uint8_t>(); }
  Tier served_from() const { return tier_; }
  explicit operator bool() const { return buffer_ != nullptr; }

 private:
  friend class BlockStore;
  Lease(std::shared_ptr<const AlignedBuffer> b, Tier t) : buffer_(std::move(b)), tier_(t) {}
  std::shared_ptr<const AlignedBuffer> buffer_;
  Tier tier_ = Tier::kNone;
};

struct LookupResult {
  uint32_t chunks = 0;      // leading chunks of the chain present for every layer
  std::vector<Tier> tiers;  // per present chunk: kRam if every layer is in RAM, else kDisk
};

class BlockStore {
 public:
  static absl::StatusOr<std::unique_ptr<BlockStore>> Open(const StoreOptions& options);
  ~BlockStore();
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  absl::Status Put(const BlockName& name, const BlockHash* parent, absl::Span<const uint8_t> block);
  // `prefix` supplies the fingerprints; its key and layer are ignored.
  LookupResult Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                      uint32_t layers);
  absl::StatusOr<Lease> Get(const BlockName& name);  // kNotFound on a miss
  bool Delete(const BlockName& name);                 // and its descendants
  StoreStats Stats() const;
  // Waits until the write-back queue is empty (tests, shutdown).
  void Flush();

 private:
  struct Entry {
    std::string parent;  // encoded name of the parent block, "" for chunk 0
    uint64_t id = 0;
    size_t bytes = 0;
    std::shared_ptr<const AlignedBuffer> ram;  // set while in RAM
    bool on_disk = false;
    Extent where;  // its bytes in the block log, while on_disk (file 0: in RocksDB, an old store)
    std::shared_ptr<const AlignedBuffer> spilling;  // queued for write-back (still servable)
  };
  explicit BlockStore(const StoreOptions& o);
  absl::Status OpenDisk();
  // All of these hold mu_.
  absl::Status InsertRamLocked(const std::string& key, Entry& e,
                               std::shared_ptr<const AlignedBuffer> bytes,
                               std::vector<std::pair<std::string, std::shared_ptr<const AlignedBuffer>>>* write_through);
  void EvictDiskLocked(size_t incoming);
  void DropLocked(const std::string& key);  // from every tier, with descendants
  bool HasChildrenLocked(const std::string& key) const;
  void AddDiskLocked(const std::string& key, Entry& e, const Extent& where);
  void AddChildLocked(const std::string& parent, const std::string& child);
  void RemoveChildLocked(const std::string& parent, const std::string& child);
  void SpillLoop();
  // A block goes to disk in two steps: log_->Append writes its bytes (without mu_, in parallel),
  // then this writes its index record, under mu_ and only for the write that the entry takes (a
  // racing Put of the same block, a block deleted or superseded meanwhile: their bytes are just
  // freed). So the index always names the entry's own copy, and a crash between the steps leaves
  // only log space, which the next open gives back. On failure the bytes are freed.
  absl::Status IndexDiskLocked(const std::string& key, const std::string& parent,
                               const Extent& where);
  // Unindexes `key` and frees its bytes. Holds mu_.
  void DeleteDisk(const std::string& key, const Extent& where);
  // After a write-back of `bytes` for `key` (spill thread or a write-through by the evicting
  // call) returned `written`: the entry now lives on disk, or leaves every tier if the write
  // failed; a block deleted meanwhile is removed from disk again. Holds mu_.
  void FinishWriteBackLocked(const std::string& key,
                             const std::shared_ptr<const AlignedBuffer>& bytes,
                             const absl::StatusOr<Extent>& written);

  const StoreOptions options_;
  std::shared_ptr<BufferPool<AlignedBuffer>> pool_;
  std::unique_ptr<rocksdb::DB> db_;  // the disk tier's index (and blocks of older stores)
  std::unique_ptr<BlockLog> log_;    // the disk tier's blocks
  mutable std::mutex mu_;
  std::mutex disk_write_mu_;  // after mu_ when both are held
  std::condition_variable spill_cv_, spill_done_cv_;
  absl::flat_hash_map<std::string, Entry> entries_;
  absl::flat_hash_map<std::string, absl::flat_hash_set<std::string>> children_;
  absl::flat_hash_map<uint64_t, std::string> ram_ids_, disk_ids_;
  std::unique_ptr<EvictionPolicy> ram_policy_, disk_policy_;
  uint64_t next_id_ = 1;
  size_t ram_used_ = 0, disk_used_ = 0;
  std::deque<std::pair<std::string, std::shared_ptr<const AlignedBuffer>>> spill_queue_;
  size_t spill_queued_bytes_ = 0;
  bool spill_busy_ = false;
  bool stopping_ = false;
  StoreStats stats_;
  std::thread spill_thread_;
};

}  // namespace strata::kvstore
