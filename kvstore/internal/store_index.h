// The disk tier's index records and names, shared by BlockStore's two halves (block_store.cc:
// the tiers in memory; block_store_disk.cc: the disk tier, its index and its recovery).
//
// On disk, per block: its bytes in the block log (block_log.h, `<disk_path>/blocks/`), and in
// RocksDB 'M' + name -> its index record ("SKV2", parent name length (0 or
// BlockName::kEncodedBytes), parent name, block size as 8 bytes, log file number as 4, offset as
// 8; little-endian), small enough to stay in the LSM tree, so a restart scans only these. Stores
// written before the block log have "SKV1" records (no file and offset) and the bytes under
// 'B' + name (in RocksDB's blob files); they are still read, and deleted as before.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/block_reader.h"
#include "common/prefix_key.h"
#include "kvstore/block_log.h"

namespace rocksdb {
class Status;
}

namespace strata::kvstore::internal {

std::string MetaKey(const std::string& key);   // the index record's RocksDB key
std::string BlockKey(const std::string& key);  // an older store's block bytes' RocksDB key

std::string EncodeMeta(const std::string& parent, uint64_t size, const Extent& where);
// false when `v` is not an index record. `where->file` is 0 for a block kept in RocksDB.
bool DecodeMeta(absl::string_view v, std::string* parent, uint64_t* size, Extent* where);

// What the block log keeps before a block: its encoded name and its parent's (none for a first
// chunk), so that an index lost or damaged can be rebuilt from the log alone.
std::string LogTag(const std::string& key, const std::string& parent);

// Whether a block's header is that of the block `name` stands for (its key aside, which the
// header does not carry).
bool HeaderMatches(const BlockHeader& h, const BlockName& name);

// The lock file a store holds on its disk_path (flock) while open: two stores must never share
// a block log, and --repair must never set aside the index of a store that is running.
inline constexpr char kLockFile[] = "store.lock";
inline constexpr char kAsidePrefix[] = "damaged-index-";

// The index (RocksDB) failed at Open, without `repair`: DATA_LOSS when RocksDB found its files
// damaged (a Corruption), UNAVAILABLE for anything else (missing or unreadable files, I/O
// errors). Either way the message names the fix.
absl::Status IndexFailure(const std::string& dir, absl::string_view what, const rocksdb::Status& s);

// A RocksDB error met after Open, as a message: a Corruption names the fix.
std::string IndexErrorText(const rocksdb::Status& s);

}  // namespace strata::kvstore::internal
