// Small whole-file helpers for the CLI tools.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"

namespace strata::tools {

// Reads a whole file into a 64-byte-aligned buffer. kNotFound / kPermissionDenied /
// kInvalidArgument (too large, not a regular file) with the path in the message.
absl::StatusOr<AlignedBuffer> ReadFileAligned(const std::string& path, size_t max_bytes);

// The first min(n, file size) bytes of a regular file, and its size in *file_bytes; the same
// errors as ReadFileAligned (but no size limit: only n bytes are read).
absl::StatusOr<std::string> ReadFileHead(const std::string& path, size_t n, uint64_t* file_bytes);

// Writes bytes to path through a temporary file and rename, so readers never see a partial file.
absl::Status WriteFileAtomic(const std::string& path, absl::Span<const uint8_t> bytes);

}  // namespace strata::tools
