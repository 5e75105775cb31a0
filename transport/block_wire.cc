// The block protocol's wire format: encoders and decoders of its message headers (block data,
// piece and ack headers; ring requests, grants and releases), declared in block_protocol.h.
#include "transport/block_protocol.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace strata::transport {
namespace {

constexpr uint32_t kDataMagic = 0x314b4253;  // "SBK1"
constexpr uint32_t kAckMagic = 0x314b4153;   // "SAK1"
constexpr uint32_t kRequestMagic = 0x31515253;  // "SRQ1"
constexpr uint32_t kGrantMagic = 0x31475253;    // "SRG1"
constexpr uint32_t kReleaseMagic = 0x314c5253;  // "SRL1"
constexpr uint32_t kPieceMagic = 0x31435053;    // "SPC1"
constexpr uint8_t kWireVersion = 1;
constexpr size_t kDataFixed = 4 + 1 + 1 + 2 + 8 + 8 + 4;  // magic ver flags id_len seq size crc
constexpr size_t kAckFixed = 4 + 1 + 1 + 2 + 8 + 4;       // magic ver flags msg_len seq code
constexpr size_t kPlaceBytes = 8 + 8;                     // token offset, when flagged
constexpr uint8_t kPlacedFlag = 1;                        // data: placed; ack: released
constexpr uint8_t kRetryFlag = 2;                         // ack: sending again may succeed
constexpr uint8_t kStreamedFlag = 2;                      // data: placed, still being written
constexpr uint8_t kPiecedFlag = 4;                        // data: first piece; the rest follow
constexpr size_t kPieceBytes = 4 + 1 + 1 + 2 + 8 + 8;     // magic ver flags 0 seq offset
constexpr uint8_t kAbandonedFlag = 1;                     // piece: the rest will not come
constexpr size_t kRequestBytes = 4 + 1 + 1 + 2 + 8;       // magic ver 0 0 token
constexpr size_t kGrantFixed = 4 + 1 + 1 + 2 + 8 + 4;     // magic ver 0 desc_len token code
constexpr size_t kReleaseFixed = 4 + 1 + 1 + 2 + 8;       // magic ver flags count token
constexpr uint8_t kDropFlag = 1;

template <typename T>
void Put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian host (x86-64, aarch64)
  out.append(b, sizeof(T));
}

template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The length, magic and wire version every protocol message starts with; `what` names the
// message in errors.
absl::Status CheckPrefix(std::span<const uint8_t> b, size_t min_size, uint32_t magic,
                         const char* what) {
  if (b.size() < min_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", b.size(), " bytes, needs at least ", min_size));
  }
  if (const uint32_t m = Get<uint32_t>(b.data()); m != magic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: magic %08x, expected %08x", what, m, magic));
  }
  if (b[4] != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": wire version ", b[4], ", this build speaks ", kWireVersion));
  }
  return absl::OkStatus();
}

}  // namespace

std::string EncodeBlockDataHeader(const BlockDataHeader& h) {
  std::string out;
  out.reserve(kDataFixed + h.block_id.size());
  Put<uint32_t>(out, kDataMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, h.placed ? (h.streamed ? kPlacedFlag | kStreamedFlag : kPlacedFlag)
                             : (h.pieced ? kPiecedFlag : 0));
  Put<uint16_t>(out, static_cast<uint16_t>(h.block_id.size()));
  Put<uint64_t>(out, h.seq);
  Put<uint64_t>(out, h.size);
  Put<uint32_t>(out, h.crc32c);
  if (h.placed) {
    Put<uint64_t>(out, h.placed->token);
    Put<uint64_t>(out, h.placed->offset);
  }
  out += h.block_id;
  return out;
}

absl::StatusOr<BlockDataHeader> DecodeBlockDataHeader(std::span<const uint8_t> b) {
  STRATA_RETURN_IF_ERROR(CheckPrefix(b, kDataFixed, kDataMagic, "block data header"));
  if (b[5] != 0 && b[5] != kPlacedFlag && b[5] != (kPlacedFlag | kStreamedFlag) &&
      b[5] != kPiecedFlag) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block data header: flags ", b[5], " (1: placed, 3: placed and streamed, 4: pieced)"));
  }
  const bool placed = (b[5] & kPlacedFlag) != 0;
  const size_t fixed = kDataFixed + (placed ? kPlaceBytes : 0);
  const size_t id_len = Get<uint16_t>(b.data() + 6);
  if (id_len > kMaxBlockIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("block data header: block id of ", id_len,
                                                   " bytes exceeds ", kMaxBlockIdBytes));
  }
  if (b.size() != fixed + id_len) {
    return absl::InvalidArgumentError(absl::StrCat("block data header: ", b.size(),
                                                   " bytes, but its flags and block id length say ",
                                                   fixed + id_len));
  }
  BlockDataHeader h;
  h.seq = Get<uint64_t>(b.data() + 8);
  h.size = Get<uint64_t>(b.data() + 16);
  h.crc32c = Get<uint32_t>(b.data() + 24);
  if (placed) {
    h.placed = RingPlace{.token = Get<uint64_t>(b.data() + kDataFixed),
                         .offset = Get<uint64_t>(b.data() + kDataFixed + 8)};
    h.streamed = (b[5] & kStreamedFlag) != 0;
  }
  h.pieced = b[5] == kPiecedFlag;
  h.block_id.assign(reinterpret_cast<const char*>(b.data() + fixed), id_len);
  return h;
}

std::string EncodeBlockAckHeader(const BlockAckHeader& h) {
  const absl::string_view msg = h.status.message().substr(0, kMaxAckMessageBytes);
  std::string out;
  out.reserve(kAckFixed + msg.size());
  Put<uint32_t>(out, kAckMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, (h.released ? kPlacedFlag : 0) | (h.retryable ? kRetryFlag : 0));
  Put<uint16_t>(out, static_cast<uint16_t>(msg.size()));
  Put<uint64_t>(out, h.seq);
  Put<uint32_t>(out, static_cast<uint32_t>(h.status.code()));
  if (h.released) {
    Put<uint64_t>(out, h.released->token);
    Put<uint64_t>(out, h.released->offset);
  }
  out.append(msg.data(), msg.size());
  return out;
}

absl::StatusOr<BlockAckHeader> DecodeBlockAckHeader(std::span<const uint8_t> b) {
  STRATA_RETURN_IF_ERROR(CheckPrefix(b, kAckFixed, kAckMagic, "block ack header"));
  if ((b[5] & ~(kPlacedFlag | kRetryFlag)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ack header: unknown flags ", b[5], " (1, released, and 2, retryable, are defined)"));
  }
  const bool released = (b[5] & kPlacedFlag) != 0;
  const size_t fixed = kAckFixed + (released ? kPlaceBytes : 0);
  const size_t msg_len = Get<uint16_t>(b.data() + 6);
  if (msg_len > kMaxAckMessageBytes || b.size() != fixed + msg_len) {
    return absl::InvalidArgumentError(absl::StrCat("block ack header: ", b.size(),
                                                   " bytes with flags ", b[5],
                                                   " and a message length of ", msg_len));
  }
  const uint32_t code = Get<uint32_t>(b.data() + 16);
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(absl::StrCat("block ack header: status code ", code));
  }
  BlockAckHeader h;
  h.seq = Get<uint64_t>(b.data() + 8);
  h.retryable = (b[5] & kRetryFlag) != 0;
  h.status = absl::Status(
      static_cast<absl::StatusCode>(code),
      absl::string_view(reinterpret_cast<const char*>(b.data() + fixed), msg_len));
  if (released) {
    h.released = RingPlace{.token = Get<uint64_t>(b.data() + kAckFixed),
                           .offset = Get<uint64_t>(b.data() + kAckFixed + 8)};
  }
  return h;
}

std::string EncodeBlockPieceHeader(const BlockPieceHeader& h) {
  std::string out;
  out.reserve(kPieceBytes);
  Put<uint32_t>(out, kPieceMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, h.abandoned ? kAbandonedFlag : 0);
  Put<uint16_t>(out, 0);
  Put<uint64_t>(out, h.seq);
  Put<uint64_t>(out, h.offset);
  return out;
}

absl::StatusOr<BlockPieceHeader> DecodeBlockPieceHeader(std::span<const uint8_t> b) {
  STRATA_RETURN_IF_ERROR(CheckPrefix(b, kPieceBytes, kPieceMagic, "block piece header"));
  if (b.size() != kPieceBytes || (b[5] & ~kAbandonedFlag) != 0 ||
      Get<uint16_t>(b.data() + 6) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block piece header: ", b.size(), " bytes, flags ", b[5],
        " (only 1, abandoned, is defined) or a reserved field not zero"));
  }
  return BlockPieceHeader{.seq = Get<uint64_t>(b.data() + 8),
                          .offset = Get<uint64_t>(b.data() + 16),
                          .abandoned = (b[5] & kAbandonedFlag) != 0};
}

std::string EncodeRingRequest(const RingRequest& r) {
  std::string out;
  Put<uint32_t>(out, kRequestMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, 0);
  Put<uint16_t>(out, 0);
  Put<uint64_t>(out, r.token);
  return out;
}

absl::StatusOr<RingRequest> DecodeRingRequest(std::span<const uint8_t> b) {
  STRATA_RETURN_IF_ERROR(CheckPrefix(b, kRequestBytes, kRequestMagic, "ring request"));
  if (b.size() != kRequestBytes || b[5] != 0 || Get<uint16_t>(b.data() + 6) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring request: ", b.size(), " bytes or reserved fields not zero"));
  }
  return RingRequest{.token = Get<uint64_t>(b.data() + 8)};
}

std::string EncodeRingGrant(const RingGrant& g) {
  std::string out;
  Put<uint32_t>(out, kGrantMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, 0);
  Put<uint16_t>(out, static_cast<uint16_t>(g.descriptor.size()));
  Put<uint64_t>(out, g.token);
  Put<uint32_t>(out, static_cast<uint32_t>(g.code));
  out += g.descriptor;
  return out;
}

absl::StatusOr<RingGrant> DecodeRingGrant(std::span<const uint8_t> b) {
  STRATA_RETURN_IF_ERROR(CheckPrefix(b, kGrantFixed, kGrantMagic, "ring grant"));
  if (b[5] != 0) return absl::InvalidArgumentError("ring grant: reserved byte not zero");
  const size_t len = Get<uint16_t>(b.data() + 6);
  const uint32_t code = Get<uint32_t>(b.data() + 16);
  if (len > kMaxRingDescriptorBytes || b.size() != kGrantFixed + len) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring grant: ", b.size(), " bytes with a descriptor length of ", len));
  }
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(absl::StrCat("ring grant: status code ", code));
  }
  if ((code == 0) != (len > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring grant: status code ", code, " with a descriptor of ", len,
        " bytes (a grant has one, a refusal none)"));
  }
  RingGrant g;
  g.token = Get<uint64_t>(b.data() + 8);
  g.code = static_cast<absl::StatusCode>(code);
  g.descriptor.assign(reinterpret_cast<const char*>(b.data() + kGrantFixed), len);
  return g;
}

std::string EncodeRingRelease(const RingRelease& r) {
  std::string out;
  Put<uint32_t>(out, kReleaseMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, r.drop ? kDropFlag : 0);
  Put<uint16_t>(out, static_cast<uint16_t>(r.offsets.size()));
  Put<uint64_t>(out, r.token);
  for (uint64_t o : r.offsets) Put<uint64_t>(out, o);
  return out;
}

absl::StatusOr<RingRelease> DecodeRingRelease(std::span<const uint8_t> b) {
  STRATA_RETURN_IF_ERROR(CheckPrefix(b, kReleaseFixed, kReleaseMagic, "ring release"));
  if ((b[5] & ~kDropFlag) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring release: unknown flags ", b[5]));
  }
  const size_t count = Get<uint16_t>(b.data() + 6);
  if (count > kMaxReleasedOffsets || b.size() != kReleaseFixed + 8 * count) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring release: ", b.size(), " bytes for ", count, " offsets"));
  }
  RingRelease r;
  r.drop = (b[5] & kDropFlag) != 0;
  r.token = Get<uint64_t>(b.data() + 8);
  for (size_t i = 0; i < count; ++i) {
    r.offsets.push_back(Get<uint64_t>(b.data() + kReleaseFixed + 8 * i));
  }
  return r;
}

}  // namespace strata::transport
