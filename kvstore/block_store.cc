#include "kvstore/block_store.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "common/endian.h"
#include "common/status_macros.h"
#include "kvstore/internal/store_index.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"

namespace strata::kvstore {

using internal::BlockKey;
using internal::HeaderMatches;
using internal::IndexErrorText;
using internal::LogTag;

namespace {

uint64_t NewStoreId() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{rd()} << 32) ^ rd();
  return id;
}

}  // namespace

BlockStore::BlockStore(const StoreOptions& o)
    : options_(o),
      pool_(BufferPool<AlignedBuffer>::Create(o.ram_bytes / 4)),
      ledger_(o.ram_bytes, o.disk_bytes, /*disk_tier=*/!o.disk_path.empty(), o.ram_policy),
      store_id_(NewStoreId()),
      events_(o.event_ring) {}

absl::StatusOr<std::unique_ptr<BlockStore>> BlockStore::Open(const StoreOptions& options) {
  if (!options.disk_path.empty() && options.disk_bytes == 0) {
    return absl::InvalidArgumentError("store: a disk path needs --disk-bytes > 0");
  }
  if (options.event_ring == 0) {
    return absl::InvalidArgumentError("store: event_ring must be at least 1");
  }
  std::unique_ptr<BlockStore> s(new BlockStore(options));
  if (!options.disk_path.empty()) {
    if (absl::Status opened = s->OpenDisk(); !opened.ok()) {
      s->db_.reset();  // closed as found: nothing flushed or written back
      return opened;
    }
    s->spill_thread_ = std::thread([p = s.get()] { p->SpillLoop(); });
  }
  return s;
}

BlockStore::~BlockStore() {
  if (db_ != nullptr) {
    // A clean shutdown keeps the cache warm: blocks only in RAM go to disk (as far as the disk
    // tier has room), then RocksDB flushes its memtable into table and blob files.
    Flush();
    std::vector<std::pair<std::string, Held>> ram_only;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [key, e] : ledger_.entries()) {
        if (e.ram && !e.on_disk) ram_only.emplace_back(key, e.ram);
      }
    }
    for (auto& [key, bytes] : ram_only) {
      std::lock_guard<std::mutex> lock(mu_);
      const Entry* e = ledger_.Find(key);
      if (e == nullptr || e->on_disk) continue;
      if (ledger_.disk_used() + bytes->size() > options_.disk_bytes) break;
      absl::StatusOr<Extent> where = log_->Append(bytes->span(), LogTag(key, e->parent));
      if (!where.ok() || !IndexDiskLocked(key, e->parent, *where).ok()) break;
      AddDiskLocked(key, *where);
    }
    log_->Sync().IgnoreError();  // (a clean shutdown also survives power loss, as far as it can)
    db_->Flush(rocksdb::FlushOptions());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  spill_cv_.notify_all();
  if (spill_thread_.joinable()) spill_thread_.join();
  db_.reset();  // before the lock goes: no other store opens the index while this one has it
  log_.reset();
  if (disk_lock_fd_ >= 0) close(disk_lock_fd_);
}

absl::Status BlockStore::Put(const BlockName& name, const BlockHash* parent,
                             absl::Span<const uint8_t> block) {
  return PutBytes(name, parent, block, nullptr);
}

absl::Status BlockStore::Put(const BlockName& name, const BlockHash* parent, SharedBytes block) {
  // Leases promise 64-byte alignment (block sections are aligned relative to the block's start);
  // bytes without an owner cannot be kept past this call. Either way: copy.
  const bool keep =
      block && reinterpret_cast<uintptr_t>(block.data()) % AlignedBuffer::kAlignment == 0;
  const absl::Span<const uint8_t> bytes = block.span();
  return PutBytes(name, parent, bytes,
                  keep ? std::make_shared<const SharedBytes>(std::move(block)) : nullptr);
}

absl::Status BlockStore::PutBytes(const BlockName& name, const BlockHash* parent,
                                  absl::Span<const uint8_t> block, Held held) {
  if (block.size() > options_.max_block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: block of ", block.size(),
                                                   " bytes exceeds the limit of ",
                                                   options_.max_block_bytes));
  }
  absl::StatusOr<BlockView> view = BlockView::Parse(block);
  if (!view.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.refused_puts;
    return absl::DataLossError(absl::StrCat("store: refused ", name.ToString(), ": ",
                                            view.status().message()));
  }
  const BlockHeader& h = view->header();
  if (!HeaderMatches(h, name)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.refused_puts;
    return absl::InvalidArgumentError(absl::StrCat(
        "store: block header (layer ", h.layer, ", fingerprints ", absl::Hex(h.model_fingerprint),
        "/", absl::Hex(h.codec_fingerprint), "/", absl::Hex(h.calibration_fingerprint),
        ") does not match its name ", name.ToString()));
  }
  // A chain's first chunk has no parent, and every later chunk has one.
  if ((h.chunk_index > 0) != (parent != nullptr)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.refused_puts;
    return absl::InvalidArgumentError(absl::StrCat(
        "store: ", name.ToString(), " is the block of chunk ", h.chunk_index,
        h.chunk_index > 0 ? " but comes without its parent's key (every chunk after the first has "
                            "one)"
                          : " (a chain's first) but comes with a parent key"));
  }
  const uint32_t crc = LoadLE<uint32_t>(block.data() + 4);  // the block format's checksum field
  const std::string key = name.Encode();
  std::string parent_key;
  if (parent != nullptr) {
    BlockName p = name;
    p.key = *parent;
    parent_key = p.Encode();
  }
  const bool through = db_ != nullptr && options_.durable_puts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.puts;
    if (const Entry* e = ledger_.Find(key); e != nullptr) {
      if (e->bytes != block.size() || (e->crc32c != 0 && e->crc32c != crc)) {
        ++stats_.put_conflicts;
        return absl::AlreadyExistsError(absl::StrCat("store: ", name.ToString(),
                                                     " holds another block already (", e->bytes,
                                                     " bytes); the first writer's stays"));
      }
      ++stats_.duplicate_puts;
      ledger_.TouchRam(key);
      return absl::OkStatus();
    }
    if (!parent_key.empty() && !ledger_.Contains(parent_key)) {
      ++stats_.refused_puts;
      return absl::FailedPreconditionError(
          absl::StrCat("store: the parent of ", name.ToString(), " is not stored"));
    }
  }
  if (held == nullptr) {  // copied outside the lock, and only for a block the store lacks
    std::shared_ptr<AlignedBuffer> buffer = AcquireBuffer(*pool_, block.size());
    std::memcpy(buffer->data(), block.data(), block.size());
    held = std::make_shared<const SharedBytes>(SharedBytes::FromShared(std::move(buffer)));
  }
  Extent where;  // the bytes go to the log now, the index record only once this Put wins (below)
  if (through) {
    absl::StatusOr<Extent> written = log_->Append(block, LogTag(key, parent_key));
    if (!written.ok()) return written.status();
    where = *written;
  }
  std::vector<std::pair<std::string, Held>> write_through;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ledger_.Contains(key) || (!parent_key.empty() && !ledger_.Contains(parent_key))) {
      // Raced with another Put of the same block, or the parent left meanwhile.
      if (through) log_->Free(where);
      if (const Entry* e = ledger_.Find(key); e != nullptr) {
        if (e->bytes != block.size() || (e->crc32c != 0 && e->crc32c != crc)) {
          ++stats_.put_conflicts;
          return absl::AlreadyExistsError(absl::StrCat(
              "store: ", name.ToString(), " holds another block already; the first writer's "
              "stays"));
        }
        return absl::OkStatus();
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "store: the parent of ", name.ToString(), " was evicted during the Put"));
    }
    if (through) {
      STRATA_RETURN_IF_ERROR(IndexDiskLocked(key, parent_key, where));
    }
    ledger_.Add(key, parent_key.empty() ? nullptr : &parent_key, block.size()).crc32c = crc;
    if (through) {
      AddDiskLocked(key, where);
      EvictDiskLocked(0);
      if (!ledger_.Contains(key)) return absl::OkStatus();  // larger than the disk tier
    }
    const absl::Status s = InsertRamLocked(key, *ledger_.Find(key), held, &write_through);
    if (Entry* e = ledger_.Find(key); !s.ok() && e != nullptr && !e->on_disk) {
      if (db_ == nullptr) {
        DropLocked(key);
        return s;
      }
      // RAM cannot take it (leased full, or too large): straight to disk.
      e->spilling = held;
      write_through.emplace_back(key, held);
    }
    if (Entry* e = ledger_.Find(key); e != nullptr) {
      e->announced = true;
      EmitLocked(BlockEventKind::kStored, key, TierOf(*e));
    }
  }
  for (auto& [k, b] : write_through) {  // the write-back queue was full: write it ourselves
    std::string tag;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const Entry* e = ledger_.Find(k);
      if (e == nullptr) continue;
      tag = LogTag(k, e->parent);
    }
    const absl::StatusOr<Extent> s = log_->Append(b->span(), tag);
    std::lock_guard<std::mutex> lock(mu_);
    FinishWriteBackLocked(k, b, s);
  }
  return absl::OkStatus();
}

void BlockStore::FinishWriteBackLocked(const std::string& key,
                                       const Held& bytes,
                                       const absl::StatusOr<Extent>& written) {
  Entry* e = ledger_.Find(key);
  if (e == nullptr || e->spilling != bytes) {
    if (written.ok()) log_->Free(*written);  // deleted or superseded meanwhile: never indexed
    return;
  }
  e->spilling = nullptr;
  if (written.ok() && IndexDiskLocked(key, e->parent, *written).ok()) {
    AddDiskLocked(key, *written);
    ++stats_.spills;
    EvictDiskLocked(0);
  } else if (!e->ram) {
    DropLocked(key);  // in no tier any more
  }
}

absl::Status BlockStore::InsertRamLocked(
    const std::string& key, Entry& e, Held bytes,
    std::vector<std::pair<std::string, Held>>* write_through) {
  if (e.bytes > options_.ram_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("store: a block of ", e.bytes,
                                                     " bytes does not fit in RAM of ",
                                                     options_.ram_bytes));
  }
  // Leased blocks stay (the ledger keeps prefixes of resident blocks out of reach itself).
  auto leased = [&](const std::string& k) { return ledger_.Find(k)->ram.use_count() > 1; };
  const bool room =
      ledger_.EvictRam(e.bytes, leased, [&](const std::string& vkey, Entry& v, RamFate fate) {
        ++stats_.ram_evictions;
        Held vbytes = std::move(v.ram);
        v.ram = nullptr;
        switch (fate) {
          case RamFate::kOnDisk:  // the disk has a copy
            return;
          case RamFate::kDrop:  // no lower tier: gone, and its descendants with it
            DropLocked(vkey);
            return;
          case RamFate::kSpill:
            v.spilling = vbytes;
            if (spill_queued_bytes_ + v.bytes <= options_.spill_queue_bytes) {
              spill_queued_bytes_ += v.bytes;
              spill_queue_.emplace_back(vkey, std::move(vbytes));
              spill_cv_.notify_one();
            } else {
              write_through->emplace_back(vkey, std::move(vbytes));
            }
            return;
        }
      });
  if (!room) {
    return absl::ResourceExhaustedError(
        "store: RAM is full of leased blocks and prefixes of resident blocks");
  }
  e.ram = std::move(bytes);
  ledger_.AddToRam(key);
  return absl::OkStatus();
}

void BlockStore::EvictDiskLocked(size_t incoming) {
  // The disk's policy holds leaves only: a block with descendants stays while they do.
  ledger_.EvictDisk(incoming, [&](const std::string& key, Entry& e) {
    DeleteDisk(key, e.where);
    ++stats_.disk_evictions;
    if (!e.ram && !e.spilling) DropLocked(key);  // in no tier any more
  });
}

void BlockStore::AddDiskLocked(const std::string& key, const Extent& where) {
  ledger_.Find(key)->where = where;
  ledger_.AddToDisk(key);
}

void BlockStore::DropLocked(const std::string& root) {
  stats_.orphans_dropped += ledger_.Drop(root, [&](const std::string& key, Entry& e) {
    if (e.on_disk) DeleteDisk(key, e.where);
    if (e.announced) EmitLocked(BlockEventKind::kRemoved, key, Tier::kNone);
  });
}

void BlockStore::SpillLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    spill_cv_.wait(lock, [&] { return stopping_ || !spill_queue_.empty(); });
    if (spill_queue_.empty()) return;  // stopping
    auto [key, bytes] = std::move(spill_queue_.front());
    spill_queue_.pop_front();
    spill_busy_ = true;
    const Entry* e = ledger_.Find(key);
    const bool live = e != nullptr && e->spilling == bytes;
    const std::string tag = live ? LogTag(key, e->parent) : "";
    lock.unlock();
    const absl::StatusOr<Extent> s =
        live ? log_->Append(bytes->span(), tag) : absl::StatusOr<Extent>(Extent{});
    lock.lock();
    spill_queued_bytes_ -= bytes->size();
    spill_busy_ = false;
    if (live) FinishWriteBackLocked(key, bytes, s);
    spill_done_cv_.notify_all();
  }
}

void BlockStore::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  spill_done_cv_.wait(lock, [&] { return spill_queue_.empty() && !spill_busy_; });
}

absl::StatusOr<Lease> BlockStore::Get(const BlockName& name) {
  const std::string key = name.Encode();
  size_t expected_size = 0;
  Extent where;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Entry* found = ledger_.Find(key);
    if (found == nullptr) {
      ++stats_.misses;
      return absl::NotFoundError(absl::StrCat("store: no block ", name.ToString()));
    }
    const Entry& e = *found;
    if (e.ram) {
      ledger_.TouchRam(key);
      ++stats_.ram_hits;
      return Lease(e.ram, Tier::kRam);
    }
    if (e.spilling) {  // on its way to disk: still in memory
      ++stats_.ram_hits;
      return Lease(e.spilling, Tier::kRam);
    }
    ledger_.TouchDisk(key);
    expected_size = e.bytes;
    where = e.where;
  }
  // Read without the lock, straight into the buffer RAM will keep (one copy, from the page cache
  // or the disk), and verify: the block's own CRC-32C guards it on disk.
  std::shared_ptr<AlignedBuffer> buffer = AcquireBuffer(*pool_, expected_size);
  Held held = std::make_shared<const SharedBytes>(SharedBytes::FromShared(buffer));
  absl::Status read;
  rocksdb::Status index_error;  // RocksDB failing to read an older store's block
  if (where.file != 0) {
    read = log_->Read(where, {buffer->data(), buffer->size()});
  } else {  // an older store's block, in RocksDB
    std::string value;
    const rocksdb::Status rs = db_->Get(rocksdb::ReadOptions(), BlockKey(key), &value);
    if (!rs.ok()) {
      if (!rs.IsNotFound()) index_error = rs;
      read = rs.IsNotFound() ? absl::NotFoundError("not in RocksDB")
                             : absl::DataLossError(absl::StrCat("the index: ", IndexErrorText(rs)));
    } else if (value.size() != expected_size) {
      read = absl::DataLossError(absl::StrCat(value.size(), " bytes, not ", expected_size));
    } else {
      std::memcpy(buffer->data(), value.data(), value.size());
    }
  }
  if (read.ok()) {
    // Intact, and the block this name stands for (the bytes a record names, not another's).
    absl::StatusOr<BlockView> view = BlockView::Parse(buffer->span());
    if (!view.ok()) {
      read = view.status();
    } else if (!HeaderMatches(view->header(), name)) {
      read = absl::DataLossError("the bytes read are another block's (layer or fingerprints)");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  Entry* it = ledger_.Find(key);
  if (!index_error.ok()) NoteIndexErrorLocked("read", index_error);
  if (!read.ok()) {
    ++stats_.misses;
    // Evicted or deleted while being read (its space freed): a miss, not a corruption.
    const bool same = it != nullptr && it->on_disk && !it->ram && it->where.file == where.file &&
                      it->where.offset == where.offset;
    if (!same) {
      return absl::NotFoundError(absl::StrCat("store: no block ", name.ToString()));
    }
    if (!absl::IsNotFound(read)) ++stats_.corruptions;
    DropLocked(key);
    return absl::NotFoundError(absl::StrCat("store: block ", name.ToString(),
                                            " was corrupt on disk and is dropped (",
                                            read.message(), ")"));
  }
  ++stats_.disk_hits;
  if (it != nullptr && !it->ram && !it->spilling) {  // promote
    std::vector<std::pair<std::string, Held>> write_through;
    if (InsertRamLocked(key, *it, held, &write_through).ok()) ++stats_.promotions;
    // A promotion only evicts; anything that had to be written through stays queued.
    for (auto& [k, b] : write_through) {
      spill_queue_.emplace_back(k, std::move(b));
      spill_queued_bytes_ += spill_queue_.back().second->size();
      spill_cv_.notify_one();
    }
  }
  return Lease(std::move(held), Tier::kDisk);
}

LookupResult BlockStore::Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                uint32_t layers) {
  const std::vector<uint64_t> codecs(layers, prefix.codec_fingerprint);
  return Lookup(prefix, chain, codecs);
}

LookupResult BlockStore::Lookup(const BlockName& prefix, absl::Span<const BlockHash> chain,
                                absl::Span<const uint64_t> layer_codec_fingerprints) {
  LookupResult r;
  if (layer_codec_fingerprints.empty()) return r;  // no layers: nothing is present for all
  std::lock_guard<std::mutex> lock(mu_);
  BlockName n = prefix;
  for (const BlockHash& k : chain) {
    n.key = k;
    bool all_ram = true;
    for (uint32_t layer = 0; layer < layer_codec_fingerprints.size(); ++layer) {
      n.layer = layer;
      n.codec_fingerprint = layer_codec_fingerprints[layer];
      const Entry* e = ledger_.Find(n.Encode());
      if (e == nullptr) return r;
      all_ram &= e->ram != nullptr || e->spilling != nullptr;
    }
    ++r.chunks;
    r.tiers.push_back(all_ram ? Tier::kRam : Tier::kDisk);
  }
  return r;
}

Tier BlockStore::TierOf(const Entry& e) {
  if (e.ram || e.spilling) return Tier::kRam;
  return e.on_disk ? Tier::kDisk : Tier::kNone;
}

void BlockStore::EmitLocked(BlockEventKind kind, const std::string& key, Tier tier) {
  events_.Append(kind, *BlockName::Decode(key), tier);  // keys are encoded names by construction
}

EventRead BlockStore::ReadEvents(uint64_t after_id, size_t max, absl::Duration timeout) const {
  return events_.Read(after_id, max, timeout);
}

StoreSnapshot BlockStore::Snapshot() const {
  StoreSnapshot s;
  std::lock_guard<std::mutex> lock(mu_);  // no event is emitted while it is held
  s.event_id = events_.last_id();
  s.blocks.reserve(ledger_.entries().size());
  for (const auto& [key, e] : ledger_.entries()) {
    s.blocks.push_back({*BlockName::Decode(key), TierOf(e)});
  }
  return s;
}

bool BlockStore::Delete(const BlockName& name) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string key = name.Encode();
  if (!ledger_.Contains(key)) return false;
  DropLocked(key);
  ++stats_.deletes;
  return true;
}

StoreStats BlockStore::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StoreStats s = stats_;
  s.ram_blocks = ledger_.ram_blocks();
  s.ram_bytes = ledger_.ram_used();
  s.disk_blocks = ledger_.disk_blocks();
  s.disk_bytes = ledger_.disk_used();
  s.spill_queue_bytes = spill_queued_bytes_;
  s.pool_idle_bytes = pool_->idle_bytes();
  s.pool_reuses = pool_->reused();
  return s;
}

}  // namespace strata::kvstore
