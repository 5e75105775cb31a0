#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/endian.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DTypeEntry {
  const char* name;
  TensorDType type;
  int bytes;
};
constexpr DTypeEntry kDTypes[] = {
    {"F32", TensorDType::kF32, 4},   {"F16", TensorDType::kF16, 2}, {"BF16", TensorDType::kBF16, 2},
    {"F64", TensorDType::kF64, 8},   {"I64", TensorDType::kI64, 8}, {"I32", TensorDType::kI32, 4},
    {"I16", TensorDType::kI16, 2},   {"I8", TensorDType::kI8, 1},   {"U8", TensorDType::kU8, 1},
    {"BOOL", TensorDType::kBool, 1},
};

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", what));
}

}  // namespace

const char* TensorDTypeName(TensorDType t) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.type == t) return e.name;
  }
  return "?";
}

int TensorDTypeBytes(TensorDType t) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.type == t) return e.bytes;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::vector<TensorInfo>> ParseSafetensorsHeader(absl::string_view header_json,
                                                               uint64_t data_bytes) {
  const Json j = Json::parse(header_json.begin(), header_json.end(), nullptr,
                             /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("header is not valid JSON");
  if (!j.is_object()) return Bad("header is not a JSON object");
  std::vector<TensorInfo> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Bad(absl::StrCat("__metadata__ value '", m.key(), "' is not a string"));
        }
      }
      continue;
    }
    auto bad = [&](absl::string_view why) {
      return Bad(absl::StrCat("tensor '", name, "': ", why));
    };
    if (!v.is_object()) return bad("entry is not an object");
    const auto dt = v.find("dtype");
    const auto sh = v.find("shape");
    const auto off = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || off == v.end() || v.size() != 3) {
      return bad("needs exactly dtype, shape and data_offsets");
    }
    TensorInfo t;
    t.name = name;
    if (!dt->is_string()) return bad("dtype is not a string");
    const std::string dts = dt->get<std::string>();
    const DTypeEntry* entry = nullptr;
    for (const DTypeEntry& e : kDTypes) {
      if (dts == e.name) entry = &e;
    }
    if (entry == nullptr) return bad(absl::StrCat("unknown dtype '", dts, "'"));
    t.dtype = entry->type;
    if (!sh->is_array() || sh->size() > 16) return bad("shape is not a list of up to 16 sizes");
    uint64_t numel = 1;
    for (const Json& d : *sh) {
      if (!d.is_number_unsigned()) return bad("shape holds a value that is not a size");
      const uint64_t n = d.get<uint64_t>();
      if (n > (1ull << 40) || (n != 0 && numel > (1ull << 50) / n)) return bad("shape too large");
      numel *= n;
      t.shape.push_back(static_cast<int64_t>(n));
    }
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return bad("data_offsets is not [begin, end]");
    }
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end || end > data_bytes) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] outside the ", data_bytes,
                              "-byte data area"));
    }
    if (end - begin != numel * entry->bytes) {
      return bad(absl::StrCat(end - begin, " bytes for ", numel, " elements of ", dts));
    }
    t.begin = begin;
    t.bytes = end - begin;
    out.push_back(std::move(t));
  }
  std::vector<const TensorInfo*> order;
  for (const TensorInfo& t : out) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  const TensorInfo* reach = nullptr;  // the tensor ending furthest so far
  for (const TensorInfo* t : order) {
    if (t->bytes == 0) continue;
    if (reach != nullptr && reach->begin + reach->bytes > t->begin) {
      return Bad(absl::StrCat("tensors '", reach->name, "' and '", t->name, "' overlap"));
    }
    if (reach == nullptr || t->begin + t->bytes > reach->begin + reach->bytes) reach = t;
  }
  return out;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const std::string msg =
        absl::StrCat("safetensors: cannot open ", path, ": ", std::strerror(errno));
    return errno == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Bad(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return Bad(absl::StrCat(path, ": ", size, " bytes, too short for a header"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Bad(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = map;
  f->map_bytes_ = size;
  const auto* bytes = static_cast<const uint8_t*>(map);
  const uint64_t header_bytes = LoadLE<uint64_t>(bytes);
  if (header_bytes > kMaxHeaderBytes || header_bytes > size - 8) {
    return Bad(absl::StrCat(path, ": header length ", header_bytes, " exceeds the file (", size,
                            " bytes) or the 100 MiB limit"));
  }
  f->data_ = bytes + 8 + header_bytes;
  absl::StatusOr<std::vector<TensorInfo>> tensors = ParseSafetensorsHeader(
      absl::string_view(reinterpret_cast<const char*>(bytes + 8), header_bytes),
      size - 8 - header_bytes);
  if (!tensors.ok()) {
    return absl::Status(tensors.status().code(),
                        absl::StrCat(tensors.status().message(), " (in ", path, ")"));
  }
  f->tensors_ = *std::move(tensors);
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->index_[f->tensors_[i].name] = i;
  return f;
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors) {
  Json header = Json::object();
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (static_cast<uint64_t>(numel) * TensorDTypeBytes(t.dtype) != t.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: '", t.name, "' has ", t.data.size(), " bytes for its shape"));
    }
    header[t.name] = {{"dtype", TensorDTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    uint8_t len[8];
    StoreLE<uint64_t>(len, h.size());
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const TensorToWrite& t : tensors) {
      out.write(reinterpret_cast<const char*>(t.data.data()),
                static_cast<std::streamsize>(t.data.size()));
    }
    if (!out) return absl::InternalError(absl::StrCat("safetensors: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("safetensors: cannot rename onto ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto ck = std::make_unique<Checkpoint>();
  ck->dir_ = dir;
  const std::string index_path = absl::StrCat(dir, "/model.safetensors.index.json");
  std::ifstream index(index_path);
  std::vector<std::string> shards;
  if (index) {
    std::stringstream ss;
    ss << index.rdbuf();
    const std::string text = ss.str();
    const Json j = Json::parse(text.begin(), text.end(), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return Bad(absl::StrCat(index_path, ": not an index with a weight_map object"));
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) return Bad(absl::StrCat(index_path, ": '", it.key(), "'"));
      const std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos || shard.empty()) {
        return Bad(absl::StrCat(index_path, ": shard name '", shard, "' is not a plain file name"));
      }
      if (std::find(shards.begin(), shards.end(), shard) == shards.end()) shards.push_back(shard);
    }
  } else {
    shards.push_back("model.safetensors");
  }
  for (const std::string& shard : shards) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f,
                            SafetensorsFile::Open(absl::StrCat(dir, "/", shard)));
    for (const TensorInfo& t : f->tensors()) {
      if (!ck->owner_.emplace(t.name, f.get()).second) {
        return Bad(absl::StrCat("tensor '", t.name, "' appears in two shards of ", dir));
      }
    }
    ck->files_.push_back(std::move(f));
  }
  return ck;
}

absl::StatusOr<Checkpoint::Tensor> Checkpoint::Get(absl::string_view name) const {
  const auto it = owner_.find(name);
  if (it == owner_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor '", name, "'"));
  }
  const TensorInfo* info = it->second->Find(name);
  return Tensor{info, it->second->Data(*info)};
}

std::string Checkpoint::ContentDigest() const {
  Sha256 h;
  for (const auto& f : files_) {
    uint64_t data_end = 0;
    for (const TensorInfo& t : f->tensors()) {
      h.Update(absl::StrCat(t.name, ":", TensorDTypeName(t.dtype), ":", absl::StrJoin(t.shape, ","),
                            ":", t.begin, ":", t.bytes, ";"));
      data_end = std::max(data_end, t.begin + t.bytes);
    }
    if (!f->tensors().empty()) {
      const absl::Span<const uint8_t> first = f->Data(f->tensors().front());
      const uint8_t* base = first.data() - f->tensors().front().begin;
      h.Update(base, static_cast<size_t>(std::min<uint64_t>(data_end, 1 << 20)));
    }
  }
  return ToHex(h.Finish());
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, file] : owner_) names.push_back(name);
  return names;
}

}  // namespace strata::model
