// BlockStore: Strata blocks kept by (prefix key, layer) across tiers — host RAM, then local disk
// (the blocks in a log of files of their own, kvstore/block_log.h, indexed in RocksDB) — with
// eviction, spill and promotion, and a disk tier that survives restarts. Embeddable in any node;
// `strata-store` serves it over gRPC.
//
//   StoreOptions o{.ram_bytes = 8ull << 30, .disk_path = "/nvme/strata", .disk_bytes = 1ull << 40};
//   STRATA_ASSIGN_OR_RETURN(auto store, BlockStore::Open(o));
//   STRATA_RETURN_IF_ERROR(store->Put(name, &parent_key, block_bytes));
//   LookupResult hit = store->Lookup(prefix, chain_of_keys, layer_codec_fingerprints);
//   STRATA_ASSIGN_OR_RETURN(Lease lease, store->Get(name));             // zero-copy, pinned
//
// Semantics:
// - Put is idempotent; a block whose checksum or structure fails is refused (kDataLoss), and so
//   is a block whose header disagrees with its name (layer, fingerprints: kInvalidArgument).
//   Another block under a name already stored (different bytes: two writers whose KV differed in
//   rounding) is refused with kAlreadyExists and counted (put_conflicts): the first writer's
//   bytes stay, and serving callers take that as stored.
// - A block's parent is the previous chunk's block of the same layer: nullptr exactly for chunk
//   0 (the block header's chunk_index; anything else is kInvalidArgument). A block whose parent
//   is in no tier is refused (kFailedPrecondition), and when a block leaves every tier its
//   descendants are dropped too: a chunk is only useful after its whole prefix.
// - At Open, blocks in the block log that no index record names (RocksDB's WAL damaged or cut
//   short: replay stops at the first bad record) are indexed again from their log records
//   (index_recovered_blocks), or counted (index_lost_blocks) and logged, never silently dropped;
//   their space is reclaimed.
// - The index (RocksDB in disk_path) damaged: when it will not open (a damaged or missing
//   MANIFEST, CURRENT, table file or table footer), or reading it at Open meets an error (a
//   table's block failing its checksum), Open fails — kDataLoss when RocksDB reports its files
//   corrupt (or CURRENT is missing beside the other files), kUnavailable for any other failure
//   (a missing MANIFEST, unreadable files, I/O errors) — with a message naming --repair, and
//   leaves the block log as it is. With StoreOptions::repair, the whole index is set aside and
//   rebuilt from the block log instead. An index error met after Open (reading an older store's
//   block, writing or deleting a record) is counted (index_errors) and logged once: a Get is
//   then a miss (kNotFound), a Put kUnavailable; a Corruption's message names --repair.
// - A disk_path is held by one store at a time (a lock file, `store.lock`): Open of a second
//   one fails with kFailedPrecondition, and repair never touches a store that is running.
// - Codecs may differ per layer (TaDA's per-layer bits, the Strata mix): each layer's blocks
//   carry (and are named by) that layer's own codec fingerprint, so Lookup takes one codec
//   fingerprint per layer.
// - RAM is byte-accurate: the bytes of resident blocks never exceed ram_bytes. Put(span) copies
//   into a buffer from a pool that reuses freed ones of the same size (at most ram_bytes / 4
//   idle); Put(SharedBytes) keeps the caller's bytes as the RAM copy (no copy) when they start
//   on a 64-byte boundary, so every lease's bytes are 64-byte aligned. RAM counts a block's own
//   bytes; an owner the caller shared may keep more memory alive. Eviction (LRU or
//   S3-FIFO) spills to disk through a bounded write-back queue (when the queue is full the
//   evicting call writes through itself); the disk evicts for good (LRU). A hit on disk is
//   promoted to RAM; the disk copy stays (inclusive), so a later eviction costs no write.
// - Leases pin: a leased block is never evicted; the bytes stay valid until the lease (and every
//   SharedBytes taken from it) drops, even if the block is deleted meanwhile.
// - Durability: with `durable_puts` (the default when there is a disk tier) Put writes the block
//   through to disk (the block log, then RocksDB's write-ahead log; no fsync) before it returns,
//   so a killed process (kill -9) loses at most the Puts that had not returned; RAM then holds
//   copies, and evicting one costs no write. Without it, blocks reach the disk only when evicted
//   from RAM (write-back), and a crash loses what was only in RAM — a cache's trade for less
//   disk traffic. After a restart the disk tier's index is rebuilt from RocksDB (log space
//   nothing names, left by a crash, is given back); a block corrupted on disk is detected by its
//   checksum when read, counted, dropped and reported as a miss — never served. Blocks of stores
//   written before the block log (in RocksDB's blob files) are still read.
// - Events (for a router's index of who holds what): a block entering the store (its first
//   successful Put) is a kStored event; a block leaving every tier (eviction from the last
//   tier, Delete, a descendant dropped with its prefix, corruption) is a kRemoved event. Moves
//   between tiers (spill, promotion) are not events. Ids are consecutive from 1 in one
//   incarnation of the store (store_id(), random per Open); the last `event_ring` events are
//   kept for ReadEvents. A reader that fell behind the ring (EventRead::gap) takes a Snapshot()
//   — every present block, as of an event id — and reads on from there. Blocks found on disk at
//   Open are in the first snapshot, not in events. The feed is pulled: no user code runs under
//   the store's locks.
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

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"
#include "common/buffer_pool.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "kvstore/block_log.h"
#include "kvstore/event_feed.h"
#include "kvstore/eviction_policy.h"
#include "kvstore/tier_ledger.h"

namespace rocksdb {
class DB;
class Status;
}

namespace strata::kvstore {

struct StoreOptions {
  size_t ram_bytes = size_t{1} << 30;
  std::string disk_path = "";   // empty: RAM only
  size_t disk_bytes = 0;        // capacity of the disk tier (value bytes)
  PolicyKind ram_policy = PolicyKind::kS3Fifo;
  size_t spill_queue_bytes = size_t{256} << 20;  // bytes waiting to be written to disk
  size_t max_block_bytes = size_t{64} << 20;     // larger Puts are refused
  bool durable_puts = true;                      // write through to disk before Put returns
  size_t event_ring = 65536;                     // events kept for ReadEvents (>= 1)
  // When the index (RocksDB) fails at Open — it will not open, or reading it meets an error —
  // set its files aside (disk_path/damaged-index-T/) and rebuild it from the block log: every
  // block whose bytes verify (CRC-32C) and whose log record names it (and its parent) comes
  // back; the others are counted in index_lost_blocks. Blocks of a store written before the
  // block log (kept in RocksDB itself) are not in the log: they are lost. Without `repair`, Open
  // fails and its message names --repair. A healthy index is left as it is.
  bool repair = false;
};

struct StoreStats {
  uint64_t puts = 0, duplicate_puts = 0, refused_puts = 0;
  uint64_t ram_hits = 0, disk_hits = 0, misses = 0;
  uint64_t ram_evictions = 0, disk_evictions = 0, spills = 0, promotions = 0;
  uint64_t orphans_dropped = 0, corruptions = 0, deletes = 0;
  // Put of another block under a name already stored: refused (ALREADY_EXISTS); the first
  // writer's bytes stay.
  uint64_t put_conflicts = 0;
  // Found at Open: blocks in the block log that no index record names (a damaged or cut-short
  // RocksDB write-ahead log, a crash between a block's append and its index record, or an index
  // rebuilt by `repair`). Those whose log record names them (and whose parent is there) are
  // indexed again; the others (written before blocks carried names, or orphans) are lost, their
  // space reclaimed.
  // Blocks whose log record names them but whose bytes fail their checksum are counted as lost.
  uint64_t index_recovered_blocks = 0;
  uint64_t index_lost_blocks = 0;
  // Errors the index (RocksDB) returned after Open: a write or delete of a record, or a read of
  // an older store's block (that Get is a miss). A damaged index file: restart with --repair.
  uint64_t index_errors = 0;
  uint64_t ram_blocks = 0, ram_bytes = 0, disk_blocks = 0, disk_bytes = 0;
  uint64_t spill_queue_bytes = 0;
  uint64_t pool_idle_bytes = 0;  // freed block buffers kept for reuse (not counted in ram_bytes)
  uint64_t pool_reuses = 0;      // block buffers handed out again instead of allocated
};

// A pinned, zero-copy view of a block; its bytes start on a 64-byte boundary.
class Lease {
 public:
  Lease() = default;
  absl::Span<const uint8_t> bytes() const {
    return held_ ? held_->span() : absl::Span<const uint8_t>();
  }
  // The same bytes as SharedBytes (to send, or keep in a sequence's cache without a copy). Every
  // copy pins the block as the lease does, until the last one drops.
  SharedBytes shared() const { return held_ ? SharedBytes(held_->span(), held_) : SharedBytes(); }
  Tier served_from() const { return tier_; }
  explicit operator bool() const { return held_ != nullptr; }

 private:
  friend class BlockStore;
  Lease(std::shared_ptr<const SharedBytes> b, Tier t) : held_(std::move(b)), tier_(t) {}
  std::shared_ptr<const SharedBytes> held_;
  Tier tier_ = Tier::kNone;
};

struct LookupResult {
  uint32_t chunks = 0;      // leading chunks of the chain present for every layer
  std::vector<Tier> tiers;  // per present chunk: kRam if every layer is in RAM, else kDisk
};

struct StoredBlock {
  BlockName name;
  Tier tier = Tier::kNone;  // the fastest tier holding it
};

struct StoreSnapshot {
  uint64_t event_id = 0;  // every event up to this id is reflected; read on with ReadEvents(it)
  std::vector<StoredBlock> blocks;  // every block present, in no particular order
};

class BlockStore {
 public:
  static absl::StatusOr<std::unique_ptr<BlockStore>> Open(const StoreOptions& options);
  ~BlockStore();
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  // Copies `block` into a pooled buffer (RAM) and, with durable_puts, writes it to disk.
  // kInvalidArgument (too large, or the header disagrees with `name`), kDataLoss (corrupt),
  // kFailedPrecondition (parent not stored), kResourceExhausted (no tier can take it, RAM only),
  // kUnavailable (disk errors).
  absl::Status Put(const BlockName& name, const BlockHash* parent, absl::Span<const uint8_t> block);
  // The same, keeping `block` itself as the RAM copy when it starts on a 64-byte boundary (else
  // it is copied): its bytes must not change while the store or a lease holds them.
  absl::Status Put(const BlockName& name, const BlockHash* parent, SharedBytes block);
  // How many leading chunks of `chain` are present for every layer: layer l is looked up under
  // `prefix`'s model and calibration fingerprints and layer_codec_fingerprints[l] (one per
  // layer; a model of L layers passes L). `prefix`'s codec fingerprint, key and layer are ignored.
  LookupResult Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                      absl::Span<const uint64_t> layer_codec_fingerprints);
  // The same with prefix.codec_fingerprint for each of `layers` layers (one codec for all).
  LookupResult Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                      uint32_t layers);
  absl::StatusOr<Lease> Get(const BlockName& name);  // kNotFound on a miss
  bool Delete(const BlockName& name);                 // and its descendants
  StoreStats Stats() const;
  // Waits until the write-back queue is empty (tests, shutdown).
  void Flush();

  // This incarnation's id: random, never 0, new at every Open.
  uint64_t store_id() const { return store_id_; }
  // At most `max` events after `after_id`, oldest first. Waits up to `timeout` while there are
  // none (returns at once on a gap). Never blocks a Put for longer than it takes to copy them.
  EventRead ReadEvents(uint64_t after_id, size_t max, absl::Duration timeout) const;
  // Every block present, consistent with the event feed up to the snapshot's event_id. Holds the
  // store's lock while it lists them (time in proportion to the blocks): for a reader's start or
  // a gap, not a loop.
  StoreSnapshot Snapshot() const;

 private:
  // A block's bytes as the store holds them: a lease copies this pointer, so a use count above
  // one means leased (or queued for write-back); the caller's own copies of the SharedBytes do
  // not count.
  using Held = std::shared_ptr<const SharedBytes>;
  // What the store keeps of a block beside the ledger's sizes and tiers (tier_ledger.h: parent,
  // bytes, in_ram, on_disk), keyed by its encoded name (parent: "" for chunk 0).
  struct Copies {
    Held ram;      // set exactly while the ledger has it in RAM
    Extent where;  // its bytes in the block log, while on_disk (file 0: in RocksDB, an old store)
    Held spilling;  // queued for write-back (still servable)
    bool announced = false;  // a kStored event (or the snapshot at Open) made it known
    uint32_t crc32c = 0;     // the block's checksum (its header); 0: not known (loaded at Open)
  };
  using Ledger = TierLedger<std::string, Copies>;
  using Entry = Ledger::Entry;
  explicit BlockStore(const StoreOptions& o);
  absl::Status OpenDisk();
  // Takes disk_path's lock file (disk_lock_fd_); kFailedPrecondition when another store holds it.
  absl::Status LockDisk();
  // Loads the index records into entries_ (holds mu_): records that do not decode, or name a log
  // file that is gone, into *bad; every extent a record names into *named. RocksDB's error, if
  // reading the index met one (what was loaded is then partial).
  rocksdb::Status LoadIndexLocked(std::vector<std::string>* bad, std::vector<Extent>* named);
  // Closes the index, moves its files into disk_path/damaged-index-<time>/ (SetIndexAside: its
  // path), and opens a new, empty one, which ReindexLocked then fills from the block log.
  // `why` is logged.
  absl::Status RebuildIndex(absl::string_view why);
  absl::StatusOr<std::string> SetIndexAside();
  // `held` is `block` already owned (Put(SharedBytes)), or null to copy `block` into the pool.
  absl::Status PutBytes(const BlockName& name, const BlockHash* parent,
                        absl::Span<const uint8_t> block, Held held);
  // All of these hold mu_.
  absl::Status InsertRamLocked(const std::string& key, Entry& e, Held bytes,
                               std::vector<std::pair<std::string, Held>>* write_through);
  void EvictDiskLocked(size_t incoming);
  void DropLocked(const std::string& key);  // from every tier, with descendants
  // `key`'s bytes are at `where` in the block log (indexed): the disk tier has it.
  void AddDiskLocked(const std::string& key, const Extent& where);
  void SpillLoop();
  // Indexes again the blocks FindUnindexed found that their log records name (parents first),
  // adding their extents to *named; counts and logs the rest, and the `damaged` records (their
  // bytes do not verify). At Open; fails (kUnavailable) only when a record cannot be written.
  absl::Status ReindexLocked(std::vector<BlockLog::Record> found,
                             const std::vector<BlockLog::Record>& damaged,
                             std::vector<Extent>* named);
  // A block goes to disk in two steps: log_->Append writes its bytes (without mu_, in parallel),
  // then this writes its index record, under mu_ and only for the write that the entry takes (a
  // racing Put of the same block, a block deleted or superseded meanwhile: their bytes are just
  // freed). So the index always names the entry's own copy, and a crash between the steps leaves
  // only log space, which the next open gives back. On failure the bytes are freed.
  absl::Status IndexDiskLocked(const std::string& key, const std::string& parent,
                               const Extent& where);
  // The record alone (IndexDiskLocked also frees the bytes when it fails). Holds mu_.
  absl::Status WriteIndexRecordLocked(const std::string& key, const std::string& parent,
                                      const Extent& where);
  // Counts an error RocksDB returned after Open, and logs the first. Holds mu_.
  void NoteIndexErrorLocked(absl::string_view what, const rocksdb::Status& s);
  // Unindexes `key` and frees its bytes. Holds mu_.
  void DeleteDisk(const std::string& key, const Extent& where);
  // After a write-back of `bytes` for `key` (spill thread or a write-through by the evicting
  // call) returned `written`: the entry now lives on disk, or leaves every tier if the write
  // failed; a block deleted meanwhile is removed from disk again. Holds mu_.
  void FinishWriteBackLocked(const std::string& key, const Held& bytes,
                             const absl::StatusOr<Extent>& written);
  static Tier TierOf(const Entry& e);
  // Appends an event to the ring and wakes readers. Holds mu_ (so events follow the entries'
  // order and Snapshot() can name the id it is current as of).
  void EmitLocked(BlockEventKind kind, const std::string& key, Tier tier);

  const StoreOptions options_;
  int disk_lock_fd_ = -1;  // disk_path's lock file, held (flock) while the store is open
  std::shared_ptr<BufferPool<AlignedBuffer>> pool_;
  std::unique_ptr<rocksdb::DB> db_;  // the disk tier's index (and blocks of older stores)
  std::unique_ptr<BlockLog> log_;    // the disk tier's blocks
  bool repaired_ = false;            // this Open rebuilt the index (StoreOptions::repair)
  mutable std::mutex mu_;
  std::mutex disk_write_mu_;  // after mu_ when both are held
  std::condition_variable spill_cv_, spill_done_cv_;
  Ledger ledger_;  // every block: its tiers, sizes, parent and bytes
  std::deque<std::pair<std::string, Held>> spill_queue_;
  size_t spill_queued_bytes_ = 0;
  bool spill_busy_ = false;
  bool stopping_ = false;
  StoreStats stats_;
  std::thread spill_thread_;
  const uint64_t store_id_;
  EventFeed events_;  // appended to under mu_ only (its own lock after mu_)
};

}  // namespace strata::kvstore
