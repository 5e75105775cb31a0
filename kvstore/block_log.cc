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

// Whole, verified blocks lying in [from, to) of `fd` at kAlign boundaries (where Append puts
// them): what an index that names none of them has lost. Reads only such candidates.
void CountBlocks(int fd, uint64_t from, uint64_t to, BlockLog::Unindexed* out) {
  std::vector<uint8_t> buf;
  for (uint64_t at = RoundUp(from); at + 16 <= to;) {
    uint8_t head[16];
    if (pread(fd, head, sizeof(head), static_cast<off_t>(at)) != sizeof(head) ||
        LoadLE<uint32_t>(head) != kBlockMagic) {
      at += BlockLog::kAlign;
      continue;
    }
    const uint64_t total = LoadLE<uint32_t>(head + 12);
    if (total < 16 || at + total > to) {
      at += BlockLog::kAlign;
      continue;
    }
    buf.resize(total);
    if (pread(fd, buf.data(), total, static_cast<off_t>(at)) != static_cast<ssize_t>(total) ||
        Crc32c(buf.data() + 8, total - 8) != LoadLE<uint32_t>(buf.data() + 4)) {
      at += BlockLog::kAlign;
      continue;
    }
    ++out->blocks;
    out->bytes += total;
    at = RoundUp(at + total);
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

BlockLog::Unindexed BlockLog::Recover(absl::Span<const Extent> live) {
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> by_file;  // [offset, end)
  for (const Extent& e : live) by_file[e.file].emplace_back(e.offset, e.offset + e.size);
  Unindexed lost;
  std::lock_guard<std::mutex> lock(mu_);
  if (!by_file.empty()) next_file_ = std::max(next_file_, by_file.rbegin()->first + 1);
  std::vector<uint32_t> dead;
  for (auto& [n, f] : files_) {
    struct stat st {};
    const uint64_t size = fstat(f->fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    auto it = by_file.find(n);
    if (it == by_file.end()) {
      CountBlocks(f->fd, 0, size, &lost);
      dead.push_back(n);
      continue;
    }
    std::vector<std::pair<uint64_t, uint64_t>>& xs = it->second;
    std::sort(xs.begin(), xs.end());
    uint64_t at = 0;
    f->live = 0;
    for (const auto& [from, to] : xs) {
      if (from >= at) {
        CountBlocks(f->fd, at, from, &lost);
        Punch(f->fd, at, from);
      }
      at = std::max(at, RoundUp(to));
      f->live += to - from;
    }
    if (size > at) {
      CountBlocks(f->fd, at, size, &lost);
      Punch(f->fd, at, size);
    }
  }
  for (uint32_t n : dead) DeleteLocked(n);
  return lost;
}

absl::StatusOr<Extent> BlockLog::Append(absl::Span<const uint8_t> bytes) {
  std::shared_ptr<File> f;
  Extent e{.size = bytes.size()};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_ == 0 || (active_end_ > 0 && active_end_ + bytes.size() > file_bytes_)) {
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
    e.offset = active_end_;
    active_end_ = RoundUp(active_end_ + bytes.size());
    f->live += bytes.size();
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
  Punch(f->fd, e.offset, RoundUp(e.offset + e.size));
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
