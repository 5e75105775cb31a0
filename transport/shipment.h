// What a prefill node ships to a decode node for one request, named in the block protocol's
// block id (BlockSender::Send's `block_id`): a fixed form, so a decode node demultiplexes
// requests and a store node can Put what it receives without looking inside the payload.
//
//   block   one layer's block of one chunk (Strata block format); carries its BlockName and
//           its parent chunk's prefix key (absent for chunk 0)
//   window  one layer's partial last chunk at full precision (SequenceKvCache::ExportWindow)
//   end     the request is complete: the payload (ShipmentEnd) says how many chunks, layers and
//           window tokens to expect, and the first generated token
//   abort   the prefill failed or was cancelled: the payload is the reason; free the request
//
// Wire form of the id (little-endian): u8 version (1), u8 kind, u16 request id length,
// u32 layer, u32 chunk, u8 has_parent, then for blocks the 60-byte BlockName and the 32-byte
// parent key (zero when absent), then the request id (1..128 bytes of printable ASCII).
// Every decoder bounds-checks and names the field it refuses (kInvalidArgument).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "common/prefix_key.h"

namespace strata::transport {

enum class ShipmentKind : uint8_t { kBlock = 1, kWindow = 2, kEnd = 3, kAbort = 4 };

inline constexpr size_t kMaxRequestIdBytes = 128;

struct ShipmentId {
  ShipmentKind kind = ShipmentKind::kBlock;
  std::string request_id = "";
  uint32_t layer = 0;
  uint32_t chunk = 0;
  BlockName name{};                      // kBlock
  std::optional<BlockHash> parent_key = std::nullopt;  // kBlock, chunk > 0

  std::string Encode() const;
  static absl::StatusOr<ShipmentId> Decode(std::span<const uint8_t> bytes);
  static absl::StatusOr<ShipmentId> Decode(const std::string& bytes) {
    return Decode(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()),
                                           bytes.size()));
  }
};

// The payload of an end shipment: 8 little-endian u32.
struct ShipmentEnd {
  uint32_t first_token = 0;
  uint32_t prompt_tokens = 0;
  uint32_t chunks = 0;         // full chunks shipped, every layer (adopted and computed)
  uint32_t layers = 0;
  uint32_t window_tokens = 0;  // tokens of each layer's window shipment
  uint32_t cached_tokens = 0;  // prompt tokens adopted from a store instead of computed

  std::string Encode() const;
  static absl::StatusOr<ShipmentEnd> Decode(std::span<const uint8_t> bytes);
};

// Checks a request id: 1..kMaxRequestIdBytes bytes of printable ASCII (0x21..0x7e).
absl::Status ValidateRequestId(const std::string& id);

}  // namespace strata::transport
