#include "kvstore/internal/store_index.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/endian.h"
#include "rocksdb/status.h"

namespace strata::kvstore::internal {
namespace {

constexpr char kMagicV1[4] = {'S', 'K', 'V', '1'};
constexpr char kMagicV2[4] = {'S', 'K', 'V', '2'};

constexpr char kRepairHint[] =
    "run strata-store with --repair to rebuild the index from the block log (every block whose "
    "bytes verify comes back)";

}  // namespace

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

std::string LogTag(const std::string& key, const std::string& parent) { return key + parent; }

bool HeaderMatches(const BlockHeader& h, const BlockName& name) {
  return h.layer == name.layer && h.model_fingerprint == name.model_fingerprint &&
         h.codec_fingerprint == name.codec_fingerprint &&
         h.calibration_fingerprint == name.calibration_fingerprint;
}

absl::Status IndexFailure(const std::string& dir, absl::string_view what,
                          const rocksdb::Status& s) {
  const std::string msg = absl::StrCat(
      "store: ", dir, ": ", what, " (", s.ToString(), "); ",
      s.IsCorruption() ? "its files are damaged: " : "if its files are damaged or missing, ",
      kRepairHint);
  return s.IsCorruption() ? absl::DataLossError(msg) : absl::UnavailableError(msg);
}

std::string IndexErrorText(const rocksdb::Status& s) {
  return absl::StrCat(s.ToString(), s.IsCorruption()
                                        ? "; the index is damaged: restart strata-store with "
                                          "--repair to rebuild it from the block log"
                                        : "");
}

}  // namespace strata::kvstore::internal
