// Reading Hugging Face safetensors checkpoints: one file, or several shards named by a
// model.safetensors.index.json. Files are memory-mapped read-only; tensors are views into them.
//
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data (offsets are relative
// to the first byte after the header).
//
// The header is validated before any tensor is exposed: its length fits the file (and 100 MiB),
// it is a JSON object, every dtype is known, every shape a list of non-negative integers, every
// data range lies inside the data area with end - begin == elements x element size, and no two
// tensors overlap. Errors are kInvalidArgument (or kNotFound for missing files and tensors) and
// name the file and the tensor.
//
// Thread safety: immutable after Open; share freely.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace strata::model {

enum class TensorDType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32", "F16", ... as safetensors spells them.
const char* TensorDTypeName(TensorDType t);
int TensorDTypeBytes(TensorDType t);

struct TensorInfo {
  std::string name;
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offset of the data in the data area
  uint64_t bytes = 0;

  int64_t numel() const;
};

// Parses and validates a safetensors header. `data_bytes` is the size of the data area that
// follows it. Pure; used by SafetensorsFile and by the fuzzer.
absl::StatusOr<std::vector<TensorInfo>> ParseSafetensorsHeader(absl::string_view header_json,
                                                               uint64_t data_bytes);

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorInfo* Find(absl::string_view name) const;
  absl::Span<const uint8_t> Data(const TensorInfo& t) const {
    return {data_ + t.begin, static_cast<size_t>(t.bytes)};
  }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* data_ = nullptr;  // first byte after the header
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
};

// Writes tensors to a safetensors file (through a temporary file and rename). `data` holds
// numel x element-size bytes for each tensor.
struct TensorToWrite {
  std::string name;
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;
};
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors);

// A checkpoint folder: model.safetensors, or model.safetensors.index.json and its shards.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  // The tensor and the file holding it; kNotFound naming the tensor and the folder.
  struct Tensor {
    const TensorInfo* info = nullptr;
    absl::Span<const uint8_t> data;
  };
  absl::StatusOr<Tensor> Get(absl::string_view name) const;
  std::vector<std::string> Names() const;
  // Hex SHA-256 over every shard's tensor table (names, dtypes, shapes, offsets) and the first
  // MiB of its data: identifies the weights without reading them all.
  std::string ContentDigest() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*, std::less<>> owner_;
};

}  // namespace strata::model
