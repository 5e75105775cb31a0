#include "tools/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace strata::tools {
namespace {

absl::Status ErrnoStatus(int err, absl::string_view what, const std::string& path) {
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace

namespace {

// Opens `path` for reading, a regular file; *st gets its stat. The caller closes the fd.
absl::StatusOr<int> OpenRegularFile(const std::string& path, struct stat* st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  if (::fstat(fd, st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "cannot stat", path);
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  return fd;
}

// Reads `n` bytes at offset 0 of `fd` into `out` (pread: EINTR retried, a short file is EIO).
absl::Status ReadFully(int fd, const std::string& path, uint8_t* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, out + done, n - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return ErrnoStatus(r < 0 ? errno : EIO, "cannot read", path);
    done += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadFileHead(const std::string& path, size_t n, uint64_t* file_bytes) {
  struct stat st;
  STRATA_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, &st));
  *file_bytes = static_cast<uint64_t>(st.st_size);
  std::string head(std::min<uint64_t>(n, *file_bytes), '\0');
  const absl::Status read =
      ReadFully(fd, path, reinterpret_cast<uint8_t*>(head.data()), head.size());
  ::close(fd);
  if (!read.ok()) return read;
  return head;
}

absl::StatusOr<AlignedBuffer> ReadFileAligned(const std::string& path, size_t max_bytes) {
  struct stat st;
  STRATA_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, &st));
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", st.st_size, " bytes, more than the limit of ", max_bytes));
  }
  AlignedBuffer buf(static_cast<size_t>(st.st_size));
  const absl::Status read = ReadFully(fd, path, buf.data(), buf.size());
  ::close(fd);
  if (!read.ok()) return read;
  return buf;
}

absl::Status WriteFileAtomic(const std::string& path, absl::Span<const uint8_t> bytes) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, "cannot create", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoStatus(err, "cannot write", tmp);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, "cannot sync", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, "cannot rename onto", path);
  }
  return absl::OkStatus();
}

}  // namespace strata::tools
