#include "kvstore/block_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "common/endian.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace strata::kvstore {
namespace {

// On disk, per block: its bytes in the block log (block_log.h, `<disk_path>/blocks/`), and in
// RocksDB 'M' + name -> its index record ("SKV2", parent name length (0 or
// BlockName::kEncodedBytes), parent name, block size as 8 bytes, log file number as 4, offset as
// 8; little-endian), small enough to stay in the LSM tree, so a restart scans only these. Stores
// written before the block log have "SKV1" records (no file and offset) and the bytes under
// 'B' + name (in RocksDB's blob files); they are still read, and deleted as before.
constexpr char kMagicV1[4] = {'S', 'K', 'V', '1'};
constexpr char kMagicV2[4] = {'S', 'K', 'V', '2'};

std::string MetaKey(const std::string& key) { return "M" + key; }
std::string BlockKey(const std::string& key) { return "B" + key; }

std::string EncodeMeta(const std::string& parent, uint64_t size, const Extent& where) {
  std::string v(kMagicV2, 4);
  v.push_back(static_cast<char>(parent.size()));
  v += parent;
  const size_t at = v.size();
  v.resize(at + 20);
  auto* p = reinterpret_cast<uint8_t*>(v.data()) + at;
  StoreLE<uint64_t>(p, size);
  StoreLE<uint32_t>(p + 8, where.file);
  StoreLE<uint64_t>(p + 12, where.offset);
  return v;
}

// false when `v` is not an index record. `where->file` is 0 for a block kept in RocksDB.
bool DecodeMeta(absl::string_view v, std::string* parent, uint64_t* size, Extent* where) {
  if (v.size() < 5) return false;
  const bool v1 = std::memcmp(v.data(), kMagicV1, 4) == 0;
  if (!v1 && std::memcmp(v.data(), kMagicV2, 4) != 0) return false;
  const size_t n = static_cast<uint8_t>(v[4]);
  if ((n != 0 && n != BlockName::kEncodedBytes) || v.size() != 5 + n + (v1 ? 8 : 20)) {
    return false;
  }
  *parent = std::string(v.substr(5, n));
  const auto* p = reinterpret_cast<const uint8_t*>(v.data()) + 5 + n;
  *size = LoadLE<uint64_t>(p);
  *where = Extent{};
  if (!v1) {
    where->file = LoadLE<uint32_t>(p + 8);
    where->offset = LoadLE<uint64_t>(p + 12);
    where->size = *size;
    // A block starts 64-byte aligned: on a kAlign boundary, or after its log tag there.
    if (where->file == 0 || where->file > BlockLog::kMaxFile || where->offset % 64 != 0) {
      return false;
    }
  }
  return true;
}

// Whether a block's header is that of the block `name` stands for (its key aside, which the
// header does not carry).
// What the block log keeps before a block: its encoded name and its parent's (none for a first
// chunk), so that an index lost or damaged can be rebuilt from the log alone.
std::string LogTag(const std::string& key, const std::string& parent) { return key + parent; }

bool HeaderMatches(const BlockHeader& h, const BlockName& name) {
  return h.layer == name.layer && h.model_fingerprint == name.model_fingerprint &&
         h.codec_fingerprint == name.codec_fingerprint &&
         h.calibration_fingerprint == name.calibration_fingerprint;
}

// The lock file a store holds on its disk_path (flock) while open: two stores must never share
// a block log, and --repair must never set aside the index of a store that is running.
constexpr char kLockFile[] = "store.lock";
constexpr char kAsidePrefix[] = "damaged-index-";

constexpr char kRepairHint[] =
    "run strata-store with --repair to rebuild the index from the block log (every block whose "
    "bytes verify comes back)";

// The index (RocksDB) failed at Open, without `repair`: DATA_LOSS when RocksDB found its files
// damaged (a Corruption), UNAVAILABLE for anything else (missing or unreadable files, I/O
// errors). Either way the message names the fix.
absl::Status IndexFailure(const std::string& dir, absl::string_view what,
                          const rocksdb::Status& s) {
  const std::string msg = absl::StrCat(
      "store: ", dir, ": ", what, " (", s.ToString(), "); ",
      s.IsCorruption() ? "its files are damaged: " : "if its files are damaged or missing, ",
      kRepairHint);
  return s.IsCorruption() ? absl::DataLossError(msg) : absl::UnavailableError(msg);
}

// A RocksDB error met after Open, as a message: a Corruption names the fix.
std::string IndexErrorText(const rocksdb::Status& s) {
  return absl::StrCat(s.ToString(), s.IsCorruption()
                                        ? "; the index is damaged: restart strata-store with "
                                          "--repair to rebuild it from the block log"
                                        : "");
}

}  // namespace

const char* TierName(Tier t) {
  switch (t) {
    case Tier::kRam:
      return "ram";
    case Tier::kDisk:
      return "disk";
    default:
      return "none";
  }
}

const char* BlockEventKindName(BlockEventKind k) {
  return k == BlockEventKind::kStored ? "stored" : "removed";
}

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
      store_id_(NewStoreId()) {}

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

namespace {

rocksdb::Options IndexOptions() {
  rocksdb::Options o;
  o.create_if_missing = true;
  // Stop replaying the WAL at its first damaged record (never skip one and replay later ones:
  // the index would hold a child without its parent), and check what is read; what that drops
  // is indexed again from the block log's records (ReindexLocked) or counted.
  o.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  o.paranoid_checks = true;
  o.compression = rocksdb::kNoCompression;
  // Index records only (tens of bytes). The blob settings serve the blocks of stores written
  // before the block log, which RocksDB kept in blob files: read, deleted, garbage-collected.
  o.enable_blob_files = true;
  o.min_blob_size = 4096;
  o.blob_file_size = size_t{256} << 20;
  o.enable_blob_garbage_collection = true;
  o.write_buffer_size = size_t{16} << 20;
  return o;
}

// Whether `dir` holds an index's files but not its CURRENT (lost, or never written by a crash
// in the index's creation). RocksDB would take the folder for a new index (create_if_missing) —
// and a failed attempt leaves a new CURRENT behind, so that the next open finds an empty index
// where the old one was: such a folder is an index that will not open.
bool IndexLostItsCurrent(const std::string& dir) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::path(dir) / "CURRENT", ec)) return false;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("MANIFEST-") || name.ends_with(".sst") || name.ends_with(".ldb") ||
        name.ends_with(".blob") || (name.ends_with(".log") && entry.is_regular_file(ec))) {
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status BlockStore::LockDisk() {
  const std::string& dir = options_.disk_path;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("store: create ", dir, ": ", ec.message()));
  const std::string path = (std::filesystem::path(dir) / kLockFile).string();
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("store: open ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("store: ", dir, " is in use by another store (", path, " is locked)"));
    }
    return absl::UnavailableError(absl::StrCat("store: lock ", path, ": ", std::strerror(err)));
  }
  disk_lock_fd_ = fd;
  return absl::OkStatus();
}

absl::StatusOr<std::string> BlockStore::SetIndexAside() {
  const std::string& dir = options_.disk_path;
  const std::string base = absl::StrCat(dir, "/", kAsidePrefix, absl::ToUnixSeconds(absl::Now()));
  std::string aside = base;
  for (int n = 2; std::filesystem::exists(aside); ++n) aside = absl::StrCat(base, "-", n);
  std::error_code ec;
  std::filesystem::create_directories(aside, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("store: create ", aside, ": ", ec.message()));
  std::vector<std::filesystem::path> index_files;  // listed first, moved after
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "blocks" || name == kLockFile || name.starts_with(kAsidePrefix)) continue;
    index_files.push_back(entry.path());
  }
  if (ec) return absl::UnavailableError(absl::StrCat("store: list ", dir, ": ", ec.message()));
  for (const std::filesystem::path& f : index_files) {
    std::filesystem::rename(f, std::filesystem::path(aside) / f.filename(), ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("store: move ", f.string(), " into ", aside, ": ", ec.message()));
    }
  }
  return aside;
}

absl::Status BlockStore::RebuildIndex(absl::string_view why) {
  db_.reset();
  STRATA_ASSIGN_OR_RETURN(const std::string aside, SetIndexAside());
  Log("", absl::StrCat("store: ", options_.disk_path, ": ", why, "; its files are in ", aside,
                       "; rebuilding it from the block log"));
  repaired_ = true;
  rocksdb::DB* db = nullptr;
  const rocksdb::Status opened = rocksdb::DB::Open(IndexOptions(), options_.disk_path, &db);
  if (!opened.ok()) {
    return absl::UnavailableError(absl::StrCat("store: ", options_.disk_path,
                                               ": a new index will not open either (",
                                               opened.ToString(), "); the old one is in ", aside));
  }
  db_.reset(db);
  return absl::OkStatus();
}

absl::Status BlockStore::OpenDisk() {
  STRATA_RETURN_IF_ERROR(LockDisk());
  const std::string& dir = options_.disk_path;
  rocksdb::DB* db = nullptr;
  const rocksdb::Status opened =
      IndexLostItsCurrent(dir)
          ? rocksdb::Status::Corruption(
                absl::StrCat(dir, "/CURRENT is missing, and the index's other files are there"))
          : rocksdb::DB::Open(IndexOptions(), dir, &db);
  if (opened.ok()) {
    db_.reset(db);
  } else if (options_.repair) {
    // The index cannot be opened: set its files aside and rebuild it from the block log, whose
    // records carry each block's name and parent.
    STRATA_RETURN_IF_ERROR(
        RebuildIndex(absl::StrCat("the index would not open (", opened.ToString(), ")")));
  } else {
    return IndexFailure(dir, "the index (RocksDB) will not open", opened);
  }
  absl::StatusOr<std::unique_ptr<BlockLog>> log =
      BlockLog::Open((std::filesystem::path(dir) / "blocks").string());
  if (!log.ok()) return log.status();
  log_ = std::move(*log);
  std::vector<std::string> bad;
  std::vector<Extent> named;
  std::lock_guard<std::mutex> lock(mu_);
  rocksdb::Status scanned = LoadIndexLocked(&bad, &named);
  if (!scanned.ok() && options_.repair && !repaired_) {
    // The index opened but reading it met damage (a table's block failing its checksum, a
    // record RocksDB cannot read): what was read may be partial, so none of it is kept. The
    // whole index is rebuilt from the block log, as for one that would not open.
    ledger_.Clear();
    bad.clear();
    named.clear();
    STRATA_RETURN_IF_ERROR(
        RebuildIndex(absl::StrCat("reading the index met an error (", scanned.ToString(), ")")));
    scanned = LoadIndexLocked(&bad, &named);
  }
  if (!scanned.ok()) {
    if (repaired_) {
      return absl::UnavailableError(
          absl::StrCat("store: ", dir, ": reading the new index: ", scanned.ToString()));
    }
    return IndexFailure(dir, "reading the index (RocksDB) met an error", scanned);
  }
  // Records that do not decode, or name a log file that is gone, leave the index first, so that
  // a block the log still holds can be indexed again below without its new record being deleted.
  for (const std::string& k : bad) {
    DeleteDisk(k, Extent{});
    ++stats_.corruptions;
  }
  // Blocks the log holds that the index does not name (a damaged or cut-short write-ahead log, a
  // crash between a block's append and its record, or a rebuilt index): indexed again when their
  // record names them and their parent is there, parents first; counted as lost otherwise.
  std::vector<BlockLog::Record> damaged;
  std::vector<BlockLog::Record> found = log_->FindUnindexed(named, &damaged);
  STRATA_RETURN_IF_ERROR(ReindexLocked(std::move(found), damaged, &named));
  log_->Recover(named);  // space nothing names goes back
  // Chunks whose parent did not survive (a crash between them) can never be used.
  std::vector<std::string> orphans;
  for (const auto& [key, e] : ledger_.entries()) {
    if (e.has_parent && !ledger_.Contains(e.parent)) orphans.push_back(key);
  }
  for (const std::string& k : orphans) {
    if (ledger_.Contains(k)) DropLocked(k);
  }
  EvictDiskLocked(0);
  // What survived is the first snapshot's; only what happens from here on is an event.
  for (auto& [key, e] : ledger_.entries()) e.announced = true;
  return absl::OkStatus();
}

rocksdb::Status BlockStore::LoadIndexLocked(std::vector<std::string>* bad,
                                            std::vector<Extent>* named) {
  // Every key, its parent, size and extent (blocks are verified when read).
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("M"); it->Valid() && it->key().starts_with("M"); it->Next()) {
    const std::string key = it->key().ToString().substr(1);
    std::string parent;
    uint64_t size = 0;
    Extent where;
    const bool decoded =
        DecodeMeta(absl::string_view(it->value().data(), it->value().size()), &parent, &size,
                   &where);
    if (decoded && where.file != 0) named->push_back(where);  // (new files are numbered past it)
    if (key.size() != BlockName::kEncodedBytes || !decoded || size > options_.max_block_bytes ||
        (where.file != 0 && !log_->Has(where.file))) {
      bad->push_back(key);  // undecodable, or naming a log file that is gone
      continue;
    }
    ledger_.Add(key, parent.empty() ? nullptr : &parent, size);
    AddDiskLocked(key, where);
  }
  return it->status();
}

absl::Status BlockStore::ReindexLocked(std::vector<BlockLog::Record> found,
                                       const std::vector<BlockLog::Record>& damaged,
                                       std::vector<Extent>* named) {
  struct Candidate {
    std::string key, parent;
    Extent where;
  };
  std::vector<Candidate> candidates;
  uint64_t lost = 0, lost_bytes = 0;
  std::vector<uint8_t> bytes;
  for (BlockLog::Record& r : found) {
    const size_t n = BlockName::kEncodedBytes;
    bool ok = r.tag.size() == n || r.tag.size() == 2 * n;
    absl::StatusOr<BlockName> name = BlockName::Decode(absl::string_view(r.tag).substr(0, n));
    ok = ok && name.ok() && r.where.size <= options_.max_block_bytes;
    if (ok) {  // the block is the one its record names (FindUnindexed verified its checksum)
      bytes.resize(r.where.size);
      absl::StatusOr<BlockView> view = absl::InternalError("unread");
      if (log_->Read(r.where, absl::MakeSpan(bytes)).ok()) view = BlockView::Parse(bytes);
      ok = view.ok() && HeaderMatches(view->header(), *name) &&
           (view->header().chunk_index > 0) == (r.tag.size() == 2 * n);
    }
    if (ok && ledger_.Contains(r.tag.substr(0, n))) continue;  // an older copy: space only
    if (!ok) {
      ++lost;
      lost_bytes += r.where.size;
      continue;
    }
    candidates.push_back({r.tag.substr(0, n), r.tag.substr(n), r.where});
  }
  uint64_t recovered = 0;
  for (bool progress = true; progress;) {  // parents first
    progress = false;
    for (Candidate& c : candidates) {
      if (c.key.empty() || ledger_.Contains(c.key)) continue;
      if (!c.parent.empty() && !ledger_.Contains(c.parent)) continue;
      // A record that cannot be written fails the Open, before Recover: no block's bytes are
      // given back for want of an index that works.
      STRATA_RETURN_IF_ERROR(WriteIndexRecordLocked(c.key, c.parent, c.where));
      ledger_.Add(c.key, c.parent.empty() ? nullptr : &c.parent, c.where.size);
      AddDiskLocked(c.key, c.where);
      named->push_back(c.where);
      ++recovered;
      c.key.clear();
      progress = true;
    }
  }
  for (const Candidate& c : candidates) {
    if (c.key.empty()) continue;
    ++lost;  // its parent is nowhere: an orphan
    lost_bytes += c.where.size;
  }
  uint64_t unverified = 0;  // named by their log record, but their bytes do not verify
  for (const BlockLog::Record& r : damaged) {
    const std::string key = r.tag.substr(0, std::min(r.tag.size(), BlockName::kEncodedBytes));
    if (!ledger_.Contains(key)) ++unverified;  // (else an older copy of a block still held)
  }
  lost += unverified;
  stats_.index_recovered_blocks += recovered;
  stats_.index_lost_blocks += lost;
  if (recovered > 0 || lost > 0) {
    const char* why = repaired_ ? "a rebuilt index"
                                : "a damaged or cut-short write-ahead log, or a crash between a "
                                  "block's write and its record";
    std::string line = absl::StrCat("store: ", options_.disk_path, ": ", recovered + lost,
                                    " blocks in the block log had no index record (", why,
                                    "): ", recovered, " indexed again from their log records, ");
    if (lost == 0) {
      absl::StrAppend(&line, "none dropped");
    } else {
      absl::StrAppend(&line, lost, " dropped (", unverified, " whose bytes do not verify; ",
                      lost - unverified, ", ", lost_bytes,
                      " bytes, with no name in the log or no parent)");
    }
    Log("", absl::StrCat(line,
                         "; strata_store_index_recovered_blocks_total, "
                         "strata_store_index_lost_blocks_total"));
  }
  return absl::OkStatus();
}

absl::Status BlockStore::WriteIndexRecordLocked(const std::string& key, const std::string& parent,
                                                const Extent& where) {
  // One index writer at a time: RocksDB would group concurrent writes anyway, and its lock-free
  // write groups are invisible to ThreadSanitizer. (Block bytes are appended in parallel.)
  rocksdb::Status s;
  {
    std::lock_guard<std::mutex> lock(disk_write_mu_);
    s = db_->Put(rocksdb::WriteOptions(), MetaKey(key), EncodeMeta(parent, where.size, where));
  }
  if (s.ok()) return absl::OkStatus();
  NoteIndexErrorLocked("write", s);
  return absl::UnavailableError(absl::StrCat("store: index write: ", IndexErrorText(s)));
}

absl::Status BlockStore::IndexDiskLocked(const std::string& key, const std::string& parent,
                                         const Extent& where) {
  const absl::Status s = WriteIndexRecordLocked(key, parent, where);
  if (!s.ok()) log_->Free(where);
  return s;
}

void BlockStore::NoteIndexErrorLocked(absl::string_view what, const rocksdb::Status& s) {
  if (stats_.index_errors++ == 0) {  // the first one; the rest are counted
    Log("", absl::StrCat("store: ", options_.disk_path, ": index ", what, ": ", IndexErrorText(s),
                         " (further index errors: strata_store_index_errors_total)"));
  }
}

void BlockStore::DeleteDisk(const std::string& key, const Extent& where) {
  rocksdb::WriteBatch batch;
  batch.Delete(MetaKey(key));  // first: an index entry never names freed space for long
  if (where.file == 0) batch.Delete(BlockKey(key));  // an older store's block
  rocksdb::Status st;
  {
    std::lock_guard<std::mutex> lock(disk_write_mu_);
    st = db_->Write(rocksdb::WriteOptions(), &batch);
  }
  // Bytes the index may still name are kept (leaked until the next open's Recover, which frees
  // what the index no longer names).
  if (!st.ok()) NoteIndexErrorLocked("delete", st);
  if (st.ok() && where.file != 0) log_->Free(where);
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
  BlockEvent ev;
  ev.kind = kind;
  ev.name = *BlockName::Decode(key);  // keys are encoded names by construction
  ev.tier = tier;
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    ev.id = ++last_event_id_;
    events_.push_back(std::move(ev));
    if (events_.size() > options_.event_ring) events_.pop_front();
  }
  events_cv_.notify_all();
}

EventRead BlockStore::ReadEvents(uint64_t after_id, size_t max, absl::Duration timeout) const {
  EventRead r;
  std::unique_lock<std::mutex> lock(events_mu_);
  auto first_available = [&] {
    return events_.empty() ? last_event_id_ + 1 : events_.front().id;
  };
  auto gap = [&] { return after_id > last_event_id_ || after_id + 1 < first_available(); };
  auto ready = [&] { return last_event_id_ > after_id || gap(); };
  if (timeout == absl::InfiniteDuration()) {
    events_cv_.wait(lock, ready);
  } else if (timeout > absl::ZeroDuration()) {
    events_cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24))), ready);
  }
  r.first_available_id = first_available();
  r.last_id = last_event_id_;
  r.gap = gap();
  if (r.gap || last_event_id_ <= after_id) return r;
  // Ids are consecutive: the event after `after_id` sits at a known index.
  const size_t from = static_cast<size_t>(after_id + 1 - r.first_available_id);
  const size_t n = std::min(max, events_.size() - from);
  r.events.assign(events_.begin() + from, events_.begin() + from + n);
  return r;
}

StoreSnapshot BlockStore::Snapshot() const {
  StoreSnapshot s;
  std::lock_guard<std::mutex> lock(mu_);  // no event is emitted while it is held
  {
    std::lock_guard<std::mutex> events_lock(events_mu_);
    s.event_id = last_event_id_;
  }
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
