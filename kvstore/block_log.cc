#include "kvstore/block_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/block_format.h"
#include "common/crc32c.h"
#include "common/endian.h"

namespace strata::kvstore {

struct BlockLog::File {
  uint32_t number = 0;
  int fd = -1;
  std::string path;
  uint64_t live = 0;  // bytes of extents not freed
  ~File() {
    if (fd >= 0) close(fd);
  }
};

namespace {

uint64_t RoundUp(uint64_t n) { return (n + BlockLog::kAlign - 1) / BlockLog::kAlign * BlockLog::kAlign; }

std::string Errno(absl::string_view what, const std::string& path) {
  return absl::StrCat("store: ", what, " ", path, ": ", std::strerror(errno));
}

// Gives [from, to) of `f` back to the file system; best effort (a file system without hole
// punching keeps the space until the file is deleted).
void Punch(int fd, uint64_t from, uint64_t to) {
  if (to <= from) return;
  fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(from),
            static_cast<off_t>(to - from));
}

// A tag record before a block: "SKVT", the tag's length, its CRC-32C, 4 zero bytes, the tag;
// the block starts at the next 64-byte boundary (so an extent's record starts on the kAlign
// boundary at or below the block).
constexpr uint32_t kTagMagic = 0x54564b53u;  // bytes "SKVT"
constexpr uint64_t kTagHead = 16;

uint64_t TagBytes(size_t tag) { return tag == 0 ? 0 : (kTagHead + tag + 63) / 64 * 64; }

uint64_t RoundDown(uint64_t n) { return n / BlockLog::kAlign * BlockLog::kAlign; }

bool ReadAll(int fd, uint64_t at, void* out, uint64_t n) {
  auto* p = static_cast<uint8_t*>(out);
  for (uint64_t done = 0; done < n;) {
    const ssize_t r = pread(fd, p + done, n - done, static_cast<off_t>(at + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += static_cast<uint64_t>(r);
  }
  return true;
}

// The whole, verified block at `at` (no further than `to`): its size, or 0.
uint64_t VerifiedBlockAt(int fd, uint64_t at, uint64_t to, std::vector<uint8_t>* buf) {
  uint8_t head[16];
  if (at + 16 > to || !ReadAll(fd, at, head, sizeof(head)) || LoadLE<uint32_t>(head) != kBlockMagic) {
    return 0;
  }
  const uint64_t total = LoadLE<uint32_t>(head + 12);
  if (total < 16 || at + total > to) return 0;
  buf->resize(total);
  if (!ReadAll(fd, at, buf->data(), total) ||
      Crc32c(buf->data() + 8, total - 8) != LoadLE<uint32_t>(buf->data() + 4)) {
    return 0;
  }
  return total;
}

// Blocks (tagged or not) lying in [from, to) of file `n` at kAlign boundaries; into `damaged`
// (when given), tags that verify followed by a block that does not.
void ScanRecords(uint32_t n, int fd, uint64_t from, uint64_t to, std::vector<BlockLog::Record>* out,
                 std::vector<BlockLog::Record>* damaged) {
  std::vector<uint8_t> buf;
  for (uint64_t at = RoundUp(from); at + 16 <= to;) {
    uint8_t head[kTagHead];
    if (!ReadAll(fd, at, head, sizeof(head))) break;
    std::string tag;
    uint64_t block_at = at;
    if (LoadLE<uint32_t>(head) == kTagMagic) {
      const uint32_t len = LoadLE<uint32_t>(head + 4);
      if (len == 0 || len > BlockLog::kMaxTag || at + TagBytes(len) > to) {
        at += BlockLog::kAlign;
        continue;
      }
      tag.resize(len);
      if (!ReadAll(fd, at + kTagHead, tag.data(), len) ||
          Crc32c(tag.data(), len) != LoadLE<uint32_t>(head + 8)) {
        at += BlockLog::kAlign;
        continue;
      }
      block_at = at + TagBytes(len);
    }
    const uint64_t size = VerifiedBlockAt(fd, block_at, to, &buf);
    if (size == 0) {
      if (damaged != nullptr && !tag.empty()) {
        damaged->push_back({.where = {.file = n, .offset = block_at}, .tag = std::move(tag)});
      }
      at += BlockLog::kAlign;
      continue;
    }
    out->push_back({.where = {.file = n, .offset = block_at, .size = size}, .tag = std::move(tag)});
    at = RoundUp(block_at + size);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<BlockLog>> BlockLog::Open(const std::string& dir,
                                                         uint64_t file_bytes) {
  if (file_bytes < kAlign) {
    return absl::InvalidArgumentError(
        absl::StrCat("store: block log files of ", file_bytes, " bytes (at least ", kAlign, ")"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("store: create ", dir, ": ", ec.message()));
  }
  std::unique_ptr<BlockLog> log(new BlockLog(dir, file_bytes));
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint32_t n = 0;
    if (!name.ends_with(".log") || !absl::SimpleAtoi(name.substr(0, name.size() - 4), &n) ||
        n == 0 || log->PathOf(n) != entry.path().string()) {
      continue;  // not ours
    }
    auto f = std::make_shared<File>();
    f->number = n;
    f->path = entry.path().string();
    f->fd = open(f->path.c_str(), O_RDWR | O_CLOEXEC);
    if (f->fd < 0) return absl::UnavailableError(Errno("open", f->path));
    log->files_[n] = f;
    log->next_file_ = std::max(log->next_file_, n + 1);
  }
  if (ec) return absl::UnavailableError(absl::StrCat("store: list ", dir, ": ", ec.message()));
  return log;
}

BlockLog::~BlockLog() = default;

std::string BlockLog::PathOf(uint32_t n) const {
  return (std::filesystem::path(dir_) / absl::StrCat(n, ".log")).string();
}

std::vector<BlockLog::Record> BlockLog::FindUnindexed(absl::Span<const Extent> live,
                                                      std::vector<Record>* damaged) const {
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> by_file;  // [record, end)
  for (const Extent& e : live) by_file[e.file].emplace_back(RoundDown(e.offset), e.offset + e.size);
  std::vector<Record> found;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [n, f] : files_) {
    struct stat st {};
    const uint64_t size = fstat(f->fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    std::vector<std::pair<uint64_t, uint64_t>> xs;
    if (auto it = by_file.find(n); it != by_file.end()) xs = it->second;
    std::sort(xs.begin(), xs.end());
    uint64_t at = 0;
    for (const auto& [from, to] : xs) {
      if (from > at) ScanRecords(n, f->fd, at, from, &found, damaged);
      at = std::max(at, RoundUp(to));
    }
    if (size > at) ScanRecords(n, f->fd, at, size, &found, damaged);
  }
  return found;
}

void BlockLog::Recover(absl::Span<const Extent> live) {
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> by_file;  // [record, end)
  std::map<uint32_t, uint64_t> live_bytes;  // block bytes only, as Append and Free count them
  for (const Extent& e : live) {
    by_file[e.file].emplace_back(RoundDown(e.offset), e.offset + e.size);
    live_bytes[e.file] += e.size;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!by_file.empty()) next_file_ = std::max(next_file_, by_file.rbegin()->first + 1);
  std::vector<uint32_t> dead;
  for (auto& [n, f] : files_) {
    auto it = by_file.find(n);
    if (it == by_file.end()) {
      dead.push_back(n);
      continue;
    }
    std::vector<std::pair<uint64_t, uint64_t>>& xs = it->second;
    std::sort(xs.begin(), xs.end());
    struct stat st {};
    const uint64_t size = fstat(f->fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    uint64_t at = 0;
    f->live = live_bytes[n];
    for (const auto& [from, to] : xs) {
      if (from >= at) Punch(f->fd, at, from);
      at = std::max(at, RoundUp(to));
    }
    if (size > at) Punch(f->fd, at, size);
  }
  for (uint32_t n : dead) DeleteLocked(n);
}

absl::StatusOr<Extent> BlockLog::Append(absl::Span<const uint8_t> bytes, absl::string_view tag) {
  if (tag.size() > kMaxTag) {
    return absl::InvalidArgumentError(absl::StrCat("store: a block log tag of ", tag.size(),
                                                   " bytes (at most ", kMaxTag, ")"));
  }
  const uint64_t head = TagBytes(tag.size());
  std::vector<uint8_t> record(head, 0);
  if (head > 0) {
    StoreLE<uint32_t>(record.data(), kTagMagic);
    StoreLE<uint32_t>(record.data() + 4, static_cast<uint32_t>(tag.size()));
    StoreLE<uint32_t>(record.data() + 8, Crc32c(tag.data(), tag.size()));
    std::memcpy(record.data() + kTagHead, tag.data(), tag.size());
  }
  std::shared_ptr<File> f;
  Extent e{.size = bytes.size()};
  uint64_t start = 0;  // where the record (tag, then block) begins
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_ == 0 || (active_end_ > 0 && active_end_ + head + bytes.size() > file_bytes_)) {
      const uint32_t old = active_;
      auto nf = std::make_shared<File>();
      nf->number = next_file_;
      nf->path = PathOf(nf->number);
      nf->fd = open(nf->path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (nf->fd < 0) return absl::UnavailableError(Errno("create", nf->path));
      ++next_file_;
      files_[nf->number] = nf;
      active_ = nf->number;
      active_end_ = 0;
      if (auto o = files_.find(old); o != files_.end() && o->second->live == 0) DeleteLocked(old);
    }
    f = files_.at(active_);
    e.file = active_;
    start = active_end_;
    e.offset = start + head;
    active_end_ = RoundUp(e.offset + bytes.size());
    f->live += bytes.size();
  }
  for (uint64_t done = 0; done < head;) {
    const ssize_t n = pwrite(f->fd, record.data() + done, head - done, static_cast<off_t>(start + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status s = absl::UnavailableError(Errno("write", f->path));
      Free(e);
      return s;
    }
    done += static_cast<uint64_t>(n);
  }
  for (uint64_t done = 0; done < bytes.size();) {
    const ssize_t n = pwrite(f->fd, bytes.data() + done, bytes.size() - done,
                             static_cast<off_t>(e.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status s =
          n < 0 ? absl::UnavailableError(Errno("write", f->path))
                : absl::UnavailableError(absl::StrCat("store: write ", f->path, ": wrote nothing"));
      Free(e);
      return s;
    }
    done += static_cast<uint64_t>(n);
  }
  return e;
}

absl::Status BlockLog::Read(const Extent& e, absl::Span<uint8_t> out) const {
  if (out.size() != e.size) {
    return absl::InvalidArgumentError(absl::StrCat("store: read of ", e.size, " bytes into ",
                                                   out.size()));
  }
  std::shared_ptr<File> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(e.file);
    if (it == files_.end()) {
      return absl::DataLossError(absl::StrCat("store: block log file ", PathOf(e.file),
                                              " is gone"));
    }
    f = it->second;
  }
  if (e.offset > (uint64_t{1} << 62) || e.size > (uint64_t{1} << 62)) {
    return absl::DataLossError(absl::StrCat("store: extent at ", e.offset, " of ", e.size,
                                            " bytes in ", f->path, " is out of range"));
  }
  for (uint64_t done = 0; done < e.size;) {
    const ssize_t n =
        pread(f->fd, out.data() + done, e.size - done, static_cast<off_t>(e.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::DataLossError(Errno("read", f->path));
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("store: ", f->path, " ends at ", e.offset + done,
                                              ", inside the block at ", e.offset, " of ", e.size,
                                              " bytes"));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

bool BlockLog::Has(uint32_t file) const {
  std::lock_guard<std::mutex> lock(mu_);
  return files_.contains(file);
}

void BlockLog::Free(const Extent& e) {
  std::shared_ptr<File> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(e.file);
    if (it == files_.end()) return;
    f = it->second;
    f->live -= std::min(f->live, e.size);
    if (f->live == 0 && e.file != active_) {
      DeleteLocked(e.file);
      return;
    }
  }
  Punch(f->fd, RoundDown(e.offset), RoundUp(e.offset + e.size));  // its tag too
}

absl::Status BlockLog::Sync() {
  std::vector<std::shared_ptr<File>> files;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [n, f] : files_) files.push_back(f);
  }
  for (const auto& f : files) {
    if (fdatasync(f->fd) != 0) return absl::UnavailableError(Errno("sync", f->path));
  }
  return absl::OkStatus();
}

BlockLog::Stats BlockLog::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  for (const auto& [n, f] : files_) {
    ++s.files;
    s.live_bytes += f->live;
    struct stat st {};
    if (fstat(f->fd, &st) == 0) s.allocated_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return s;
}

// The file goes from the directory now; its descriptor closes when the last reader lets go.
void BlockLog::DeleteLocked(uint32_t n) {
  auto it = files_.find(n);
  if (it == files_.end()) return;
  unlink(it->second->path.c_str());
  files_.erase(it);
}

}  // namespace strata::kvstore
