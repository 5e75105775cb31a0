// BlockStore's disk tier: the lock on its folder, the index (RocksDB) read at Open and rebuilt
// when damaged, the blocks the log holds that no record names indexed again, and the index
// records written and deleted as blocks come and go. The tiers in memory: block_store.cc.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/block_reader.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kvstore/block_store.h"
#include "kvstore/internal/store_index.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace strata::kvstore {

using internal::BlockKey;
using internal::DecodeMeta;
using internal::EncodeMeta;
using internal::HeaderMatches;
using internal::IndexErrorText;
using internal::IndexFailure;
using internal::kAsidePrefix;
using internal::kLockFile;
using internal::MetaKey;

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
    const bool decoded = DecodeMeta(absl::string_view(it->value().data(), it->value().size()),
                                    &parent, &size, &where);
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

}  // namespace strata::kvstore
