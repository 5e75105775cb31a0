// libFuzzer target: the block shipping protocol's decoders (headers, piece and ring messages:
// bytes a peer sends). Every
// input either decodes to a header that re-encodes to the same bytes, or is refused with
// INVALID_ARGUMENT; nothing else (no crash, no out-of-bounds read under ASan).
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

#include "transport/block_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::transport;
  const std::span<const uint8_t> bytes(data, size);
  const std::string raw(reinterpret_cast<const char*>(data), size);
  if (auto h = DecodeBlockDataHeader(bytes); h.ok()) {
    if (EncodeBlockDataHeader(*h) != raw) std::abort();
  } else if (h.status().code() != absl::StatusCode::kInvalidArgument) {
    std::abort();
  }
  if (auto a = DecodeBlockAckHeader(bytes); a.ok()) {
    if (a->status.message().size() > kMaxAckMessageBytes) std::abort();
  } else if (a.status().code() != absl::StatusCode::kInvalidArgument) {
    std::abort();
  }
  // The ring messages (direct placement) re-encode exactly too.
  auto exact = [&](const auto& decoded, auto encode) {
    if (decoded.ok()) {
      if (encode(*decoded) != raw) std::abort();
    } else if (decoded.status().code() != absl::StatusCode::kInvalidArgument) {
      std::abort();
    }
  };
  exact(DecodeBlockPieceHeader(bytes),
        [](const BlockPieceHeader& p) { return EncodeBlockPieceHeader(p); });
  exact(DecodeRingRequest(bytes), [](const RingRequest& r) { return EncodeRingRequest(r); });
  exact(DecodeRingGrant(bytes), [](const RingGrant& g) { return EncodeRingGrant(g); });
  exact(DecodeRingRelease(bytes), [](const RingRelease& r) { return EncodeRingRelease(r); });
  return 0;
}
