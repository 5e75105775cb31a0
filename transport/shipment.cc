#include "transport/shipment.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/endian.h"

namespace strata::transport {
namespace {

constexpr uint8_t kVersion = 1;
constexpr size_t kFixedBytes = 1 + 1 + 2 + 4 + 4 + 1;
constexpr size_t kBlockPartBytes = BlockName::kEncodedBytes + 32;
constexpr size_t kEndBytes = 8 * 4;

}  // namespace

absl::Status ValidateRequestId(const std::string& id) {
  if (id.empty() || id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request id: ", id.size(),
                                                   " bytes, not 1..", kMaxRequestIdBytes));
  }
  for (char c : id) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("request id: only printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

std::string ShipmentId::Encode() const {
  const bool block = kind == ShipmentKind::kBlock;
  std::string out(kFixedBytes + (block ? kBlockPartBytes : 0) + request_id.size(), '\0');
  uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
  p[0] = kVersion;
  p[1] = static_cast<uint8_t>(kind);
  StoreLE<uint16_t>(p + 2, static_cast<uint16_t>(request_id.size()));
  StoreLE<uint32_t>(p + 4, layer);
  StoreLE<uint32_t>(p + 8, chunk);
  p[12] = parent_key.has_value() ? 1 : 0;
  size_t at = kFixedBytes;
  if (block) {
    const std::string n = name.Encode();
    std::memcpy(p + at, n.data(), n.size());
    at += n.size();
    if (parent_key.has_value()) std::memcpy(p + at, parent_key->data(), 32);
    at += 32;
  }
  std::memcpy(p + at, request_id.data(), request_id.size());
  return out;
}

absl::StatusOr<ShipmentId> ShipmentId::Decode(std::span<const uint8_t> b) {
  if (b.size() < kFixedBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shipment id: ", b.size(), " bytes, shorter than its fixed part"));
  }
  if (b[0] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("shipment id: version ", b[0], ", not 1"));
  }
  ShipmentId id;
  if (b[1] < 1 || b[1] > 4) {
    return absl::InvalidArgumentError(absl::StrCat("shipment id: unknown kind ", b[1]));
  }
  id.kind = static_cast<ShipmentKind>(b[1]);
  const size_t rid = LoadLE<uint16_t>(b.data() + 2);
  id.layer = LoadLE<uint32_t>(b.data() + 4);
  id.chunk = LoadLE<uint32_t>(b.data() + 8);
  if (b[12] > 1) return absl::InvalidArgumentError("shipment id: has_parent is not 0 or 1");
  const bool has_parent = b[12] == 1;
  const bool block = id.kind == ShipmentKind::kBlock;
  const size_t want = kFixedBytes + (block ? kBlockPartBytes : 0) + rid;
  if (b.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("shipment id: ", b.size(), " bytes, its fields imply ", want));
  }
  size_t at = kFixedBytes;
  if (block) {
    absl::StatusOr<BlockName> n = BlockName::Decode(absl::string_view(
        reinterpret_cast<const char*>(b.data() + at), BlockName::kEncodedBytes));
    if (!n.ok()) return n.status();
    id.name = *n;
    at += BlockName::kEncodedBytes;
    if (id.name.layer != id.layer) {
      return absl::InvalidArgumentError("shipment id: the block name's layer is not the layer field");
    }
    if (has_parent) {
      BlockHash k;
      std::copy(b.begin() + at, b.begin() + at + 32, k.begin());
      id.parent_key = k;
    }
    at += 32;
    if (has_parent != (id.chunk > 0)) {
      return absl::InvalidArgumentError("shipment id: a parent key exactly when the chunk is not 0");
    }
  } else if (has_parent) {
    return absl::InvalidArgumentError("shipment id: only blocks have a parent key");
  }
  id.request_id.assign(reinterpret_cast<const char*>(b.data() + at), rid);
  if (absl::Status s = ValidateRequestId(id.request_id); !s.ok()) return s;
  return id;
}

std::string ShipmentEnd::Encode() const {
  std::string out(kEndBytes, '\0');
  uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
  const uint32_t f[] = {first_token, prompt_tokens, chunks, layers, window_tokens, cached_tokens, 0, 0};
  for (int i = 0; i < 8; ++i) StoreLE<uint32_t>(p + 4 * i, f[i]);
  return out;
}

absl::StatusOr<ShipmentEnd> ShipmentEnd::Decode(std::span<const uint8_t> b) {
  if (b.size() != kEndBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shipment end: ", b.size(), " bytes, not ", kEndBytes));
  }
  ShipmentEnd e;
  uint32_t* f[] = {&e.first_token, &e.prompt_tokens, &e.chunks, &e.layers, &e.window_tokens,
                   &e.cached_tokens};
  for (int i = 0; i < 6; ++i) *f[i] = LoadLE<uint32_t>(b.data() + 4 * i);
  if (e.cached_tokens > e.prompt_tokens) {
    return absl::InvalidArgumentError("shipment end: cached_tokens beyond prompt_tokens");
  }
  return e;
}

}  // namespace strata::transport
