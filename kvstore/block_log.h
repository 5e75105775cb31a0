// BlockLog: the disk tier's block bytes, appended to files of their own (`<dir>/<n>.log`) and
// read back with one pread each; RocksDB keeps only the index (BlockStore: name -> parent, size,
// extent).
//
// Why not RocksDB's blob files, as before: a value put there is written twice (the WAL, then a
// blob file when the memtable flushes) and checksummed by RocksDB both times, with a CRC-32C that
// Debian's portable RocksDB build computes without the SSE4.2 instruction (table-driven): 26 % of
// all CPU samples of a store_bench run (perf). Here a block is written once, and
// its own CRC-32C (block format) guards it: BlockStore::Get parses and verifies what it reads.
//
// Space: extents start on 4 KiB boundaries. A freed extent's pages are punched out of its file
// (fallocate PUNCH_HOLE), and a file with nothing live left that is no longer appended to is
// deleted. Extents are never rewritten (files only grow, file numbers only increase), so a read
// racing a Free sees the block or zeros, never another block. Durability matches RocksDB's
// unsynced WAL: bytes written survive the process being killed; Sync() makes them survive power
// loss.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace strata::kvstore {

// Where a block lies in the log. File 0 is no file (a block kept the old way, in RocksDB).
struct Extent {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
};

class BlockLog {
 public:
  static constexpr uint64_t kAlign = 4096;
  static constexpr uint32_t kMaxFile = uint32_t{1} << 30;  // file numbers a record may name

  // Opens (creating) `dir`. Files found there are kept until Recover says which extents live.
  static absl::StatusOr<std::unique_ptr<BlockLog>> Open(const std::string& dir,
                                                        uint64_t file_bytes = uint64_t{256} << 20);
  ~BlockLog();
  BlockLog(const BlockLog&) = delete;
  BlockLog& operator=(const BlockLog&) = delete;

  // A block found in the log that the index given to FindUnindexed does not name.
  struct Record {
    Extent where;     // the block's bytes (verified: magic, size, CRC-32C)
    std::string tag;  // what Append was given with it ("" for a block written without one)
  };
  // After Open and before Recover: the whole, verified blocks lying outside `live` (the extents
  // the index holds): what the index lost (a damaged or cut-short RocksDB WAL; a crash between a
  // block's append and its index record), or, for a store rebuilding its index, everything. A
  // block whose tag names it can be indexed again (its extent then passed to Recover as live).
  // With `damaged`, it also gets the records whose tag verifies but whose block does not (bytes
  // damaged on disk, or a write cut short): where.size is 0, the block's size being unknown.
  std::vector<Record> FindUnindexed(absl::Span<const Extent> live,
                                    std::vector<Record>* damaged = nullptr) const;

  // Once, after Open, with every extent the index holds: files holding none are deleted, and the
  // space around the live extents (left by a crash between an append and its index entry, or
  // between an index delete and its punch) is punched out. New files are numbered past every
  // file named, so that a record naming a lost file can never name a new one. Extents lying past
  // a file's end are left to fail when read.
  void Recover(absl::Span<const Extent> live);

  // Writes `bytes` at the end of the current file (a new file when it would pass file_bytes),
  // after `tag` (at most kMaxTag bytes; the store's is the block's name and parent: what an index
  // rebuilt from the log needs). The extent is the block's alone. Thread-safe; appends proceed
  // in parallel.
  static constexpr size_t kMaxTag = 1024;
  absl::StatusOr<Extent> Append(absl::Span<const uint8_t> bytes, absl::string_view tag = {});
  // Reads `e` into `out` (out.size() == e.size). DATA_LOSS when the file is gone or ends early.
  absl::Status Read(const Extent& e, absl::Span<uint8_t> out) const;
  bool Has(uint32_t file) const;
  // The extent's bytes are no longer needed.
  void Free(const Extent& e);
  // fdatasync of every file (clean shutdown).
  absl::Status Sync();

  struct Stats {
    uint64_t files = 0;
    uint64_t live_bytes = 0;       // of extents not freed
    uint64_t allocated_bytes = 0;  // disk space the files take (st_blocks), holes not counted
  };
  Stats stats() const;
  const std::string& dir() const { return dir_; }

 private:
  struct File;
  BlockLog(std::string dir, uint64_t file_bytes) : dir_(std::move(dir)), file_bytes_(file_bytes) {}
  std::string PathOf(uint32_t n) const;
  void DeleteLocked(uint32_t n);

  const std::string dir_;
  const uint64_t file_bytes_;
  mutable std::mutex mu_;
  std::map<uint32_t, std::shared_ptr<File>> files_;
  uint32_t active_ = 0;       // the file appended to (0: none yet)
  uint64_t active_end_ = 0;   // where its next extent starts
  uint32_t next_file_ = 1;
};

}  // namespace strata::kvstore
