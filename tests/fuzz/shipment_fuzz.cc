// libFuzzer target: what a prefill node sends a decode node — shipment ids (the block protocol's
// block id), end shipments, and a layer's exported window. Every input either decodes (an id
// re-encodes to the same bytes; a window installs into a cache of its shape) or is refused with
// INVALID_ARGUMENT; nothing else (no crash, no out-of-bounds read under ASan).
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>

#include "model/kv_cache.h"
#include "transport/shipment.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::span<const uint8_t> bytes(data, size);
  const std::string raw(reinterpret_cast<const char*>(data), size);
  if (auto id = transport::ShipmentId::Decode(bytes); id.ok()) {
    if (id->Encode() != raw) std::abort();
  } else if (id.status().code() != absl::StatusCode::kInvalidArgument) {
    std::abort();
  }
  if (auto e = transport::ShipmentEnd::Decode(bytes); !e.ok() &&
                                                      e.status().code() != absl::StatusCode::kInvalidArgument) {
    std::abort();
  }
  // A window for layer 1 of a 2-layer cache of 2 KV heads of dim 8, chunks of 16 tokens.
  static const model::KvCacheOptions options{.codec = "fp16", .chunk_tokens = 16};
  auto cache = model::SequenceKvCache::Create(options, 2, 2, 8);
  if (!cache.ok()) std::abort();
  const absl::Status s = (*cache)->ImportWindow(1, absl::MakeConstSpan(data, size));
  if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) std::abort();
  return 0;
}
