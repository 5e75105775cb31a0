// The block shipping protocol, on any Transport.
//
// A prefill node's BlockSender ships each block as one message: a header (transfer sequence
// number, block id, size, CRC-32C) and the block's bytes as the payload (a block larger than
// BlockSenderOptions::piece_bytes as several: the header with the first piece, then the rest,
// each checked as it lands). The peer's BlockReceiver places the payload in registered memory
// from its pool, verifies the checksum, hands the block to its consumer, and acknowledges with
// the consumer's status; a block whose checksum fails is never handed on (DATA_LOSS goes back). The sender's
// Transfer completes with that acknowledgement, or with the failure that prevented it:
//
//   UNAVAILABLE         the peer died or the connection failed (partial data is discarded)
//   DEADLINE_EXCEEDED   no acknowledgement within the transfer's timeout
//   CANCELLED           Transfer::Cancel
//   DATA_LOSS           the receiver's checksum did not match (on every attempt: see
//                       BlockSenderOptions::max_attempts)
//   RESOURCE_EXHAUSTED  the block is larger than the receiver accepts, or the receiver held
//                       its limit of pending bytes at the last attempt
//   anything else       the receiver's consumer refused the block with that status
//
// Streaming: every block is acknowledged on its own, so a prefill node sends layer l while it
// computes layer l+1, and the consumer sees layer 0 as soon as it is verified.
//
// Direct placement (same-host peers, where the transport can map the peer's memory, see
// Endpoint::Map): the receiver lends each such sender a ring of its memory (ring_bytes); the
// sender copies a block straight into free space there and sends only the header, which says
// where it lies. The receiver verifies and consumes it in place: one copy in all (the sender's),
// against two through a transport's shared-memory FIFO. The space returns to the sender when the
// block's last ReceivedBlock copy is gone (flagged on the ack, or a release message later). No
// ring (refused, full, not mappable, a block too large for it): the block travels as payload.
// A sender writes only space it was lent and not given back; the receiver trusts same-host
// senders not to rewrite a block after sending it (the checksum covers the transit, not a
// sender that keeps writing).
//
// Backpressure: a sender keeps at most max_bytes_in_flight unacknowledged bytes per peer;
// Send blocks (up to the transfer's deadline) until the window has room. The receiver
// acknowledges after its consumer returns, so a slow consumer slows the sender, and the
// receiver's memory is bounded by its peers' windows.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace strata::transport {

// Transport message ids the protocol uses.
inline constexpr uint16_t kBlockDataMessage = 1;
inline constexpr uint16_t kBlockAckMessage = 2;
inline constexpr uint16_t kBlockRingRequestMessage = 3;  // sender -> receiver: lend me a ring
inline constexpr uint16_t kBlockRingGrantMessage = 4;    // receiver -> sender: here it is / no
inline constexpr uint16_t kBlockRingReleaseMessage = 5;  // receiver -> sender: space free / ring gone
inline constexpr uint16_t kBlockRingReturnMessage = 6;   // sender -> receiver: ring not used
inline constexpr uint16_t kBlockPieceMessage = 7;        // sender -> receiver: a later piece

// ---- wire format (little-endian; every decoder bounds-checks) ---------------------------------

inline constexpr size_t kMaxBlockIdBytes = 1024;
inline constexpr size_t kMaxAckMessageBytes = 512;
inline constexpr size_t kMaxRingDescriptorBytes = 2048;
inline constexpr size_t kMaxReleasedOffsets = 256;

// Where a directly placed block lies: in ring `token` at `offset`.
struct RingPlace {
  uint64_t token = 0;
  uint64_t offset = 0;
  bool operator==(const RingPlace&) const = default;
};

// A placed block lies at `offset` in the ring; the 64 bytes before it are its progress word
// (little-endian u64 at offset - 64): for a streamed block, how many of its bytes the sender has
// written so far.
inline constexpr uint64_t kPlacedPrefixBytes = 64;

struct BlockDataHeader {
  uint64_t seq = 0;        // the sender's transfer number, echoed by the ack
  uint64_t size = 0;       // block bytes
  uint32_t crc32c = 0;     // of the block
  std::string block_id;    // opaque to the protocol (the store's BlockName bytes), <= 1 KiB
  // Set: the block is written into the receiver's ring there and the message has no payload.
  std::optional<RingPlace> placed = std::nullopt;
  // With `placed`: the header went first and the sender is still writing; the receiver checks
  // the bytes as the progress word says they are there (both cores at work on one block).
  bool streamed = false;
  // Not placed: the block comes in pieces. This message carries the first (its payload, shorter
  // than `size`); kBlockPieceMessage messages carry the rest, in order, each checked as it lands.
  bool pieced = false;
};

// A later piece of a pieced block: its bytes at `offset` (the message's payload). Abandoned (no
// payload): the sender gave the transfer up there (cancel, timeout); the rest will not come.
struct BlockPieceHeader {
  uint64_t seq = 0;
  uint64_t offset = 0;
  bool abandoned = false;
};

struct BlockAckHeader {
  uint64_t seq = 0;
  absl::Status status;     // message truncated to kMaxAckMessageBytes
  // Set: the placed block's ring space is free again.
  std::optional<RingPlace> released = std::nullopt;
  // The receiver's own passing refusal (the bytes were damaged on the way: DATA_LOSS; no room
  // now: RESOURCE_EXHAUSTED): the sender may send the block again (BlockSenderOptions::
  // max_attempts). Never set for the consumer's status or a block too large.
  bool retryable = false;
};

struct RingRequest {
  uint64_t token = 0;      // the sender's name for the ring; every later message carries it
};

struct RingGrant {
  uint64_t token = 0;
  absl::StatusCode code = absl::StatusCode::kOk;  // not OK: refused, no descriptor
  std::string descriptor = {};  // MemoryRegion::RemoteDescriptor of the ring
};

struct RingRelease {
  uint64_t token = 0;
  bool drop = false;                // the whole ring is gone (either side stops using it)
  std::vector<uint64_t> offsets = {};  // placed blocks whose space is free again
};

std::string EncodeBlockDataHeader(const BlockDataHeader& h);
// INVALID_ARGUMENT naming the field for a short, oversized or malformed header.
absl::StatusOr<BlockDataHeader> DecodeBlockDataHeader(std::span<const uint8_t> bytes);
std::string EncodeBlockAckHeader(const BlockAckHeader& h);
absl::StatusOr<BlockAckHeader> DecodeBlockAckHeader(std::span<const uint8_t> bytes);
std::string EncodeBlockPieceHeader(const BlockPieceHeader& h);
absl::StatusOr<BlockPieceHeader> DecodeBlockPieceHeader(std::span<const uint8_t> bytes);
std::string EncodeRingRequest(const RingRequest& r);
absl::StatusOr<RingRequest> DecodeRingRequest(std::span<const uint8_t> bytes);
std::string EncodeRingGrant(const RingGrant& g);
absl::StatusOr<RingGrant> DecodeRingGrant(std::span<const uint8_t> bytes);
std::string EncodeRingRelease(const RingRelease& r);
absl::StatusOr<RingRelease> DecodeRingRelease(std::span<const uint8_t> bytes);

// ---- receiver -----------------------------------------------------------------------------------

// A verified block, in the receiver's registered memory until the last copy is destroyed.
struct ReceivedBlock {
  std::string id;
  uint32_t crc32c = 0;
  std::span<const uint8_t> bytes;
  std::shared_ptr<const void> hold;  // keeps `bytes` alive
  std::shared_ptr<Endpoint> from;    // the sender's connection
};

// Consumes a block. Runs on one of the receiver's verify threads (or the transport's thread, see
// BlockReceiverOptions::inline_max_bytes); may take its time (the sender's window absorbs it).
// Its status is what the sender's Transfer completes with.
using BlockConsumer = std::function<absl::Status(ReceivedBlock)>;

struct BlockReceiverOptions {
  // Larger announced blocks are refused with RESOURCE_EXHAUSTED before any byte moves.
  uint64_t max_block_bytes = uint64_t{1} << 30;
  // Payload bytes held at once, over all senders (arriving, being verified or consumed; placed
  // blocks are in the rings lent and do not count): a block that would take them past this is
  // refused with RESOURCE_EXHAUSTED before any byte moves (its sender may try again). Each
  // sender's window bounds what it keeps in flight; this bounds the receiver against many
  // senders, or one that starts blocks and never finishes them. At least max_block_bytes.
  uint64_t max_pending_bytes = uint64_t{4} << 30;
  // A streamed block (direct placement) whose sender has not advanced it for this long is given
  // up: DEADLINE_EXCEEDED to its sender, counted as aborted, never handed on. Short: a receiver
  // thread waits on the block meanwhile.
  absl::Duration stall_timeout = absl::Seconds(2);
  // A block arriving in pieces that gets no piece for this long (a lost piece, a sender gone
  // quiet on a live connection) is given up the same way and its buffer freed. Long: it only
  // bounds memory (a sender that gives a transfer up says so at once), and the clock also runs
  // while this receiver's own thread is held (an inline consumer, a streamed block).
  absl::Duration piece_timeout = absl::Seconds(30);
  // Free registered buffers kept for reuse (bytes); more are deregistered and freed.
  uint64_t pool_bytes = uint64_t{256} << 20;
  // Threads that verify checksums and run the consumer (>= 1).
  int verify_threads = 1;
  // Blocks up to this size are verified and consumed on the transport's thread as they land:
  // the bytes are still in cache and no thread hand-off is paid (docs/transport.md measures it).
  // Only for a consumer that returns quickly (hands the block on, copies it into RAM): the
  // transport receives nothing else meanwhile. 0: always a verify thread.
  uint64_t inline_max_bytes = 0;
  // Direct placement: bytes of memory lent to each same-host sender that asks (0: never), and
  // how many senders may hold one at once (more are refused and send as payload). The default
  // holds two 64 MiB blocks (each behind its 64-byte progress word); blocks that do not fit go
  // as payload. With UCX's System V shared memory (no huge pages) pages are backed only once
  // written, and blocks fill the ring lowest-first, so a sender of small blocks touches little
  // more than its window of it; huge pages or a pinning (RDMA) domain commit it all when lent.
  // Rings taken back whose memory blocks still hold count toward max_rings, so at most
  // ring_bytes * max_rings is lent memory; a sender refused for that asks again a second later.
  uint64_t ring_bytes = uint64_t{160} << 20;
  int max_rings = 8;

  absl::Status Validate() const;
};

class BlockReceiver {
 public:
  struct Stats {
    uint64_t blocks = 0;             // verified and handed to the consumer
    uint64_t bytes = 0;
    uint64_t refused = 0;            // consumer returned an error
    uint64_t checksum_failures = 0;  // DATA_LOSS sent back
    uint64_t too_large = 0;          // over max_block_bytes: RESOURCE_EXHAUSTED sent back
    uint64_t overloaded = 0;         // over max_pending_bytes: RESOURCE_EXHAUSTED sent back
    uint64_t malformed = 0;          // undecodable header or size mismatch
    uint64_t aborted = 0;            // failed, stalled or given up midway; discarded
    uint64_t max_pending_bytes = 0;  // most payload bytes held at once (arriving or being consumed)
    uint64_t placed = 0;             // of `blocks`, written into a lent ring by the sender
    uint64_t pieced = 0;             // of `blocks`, arrived in pieces (BlockSenderOptions)
    uint64_t rings = 0;              // rings lent now
    uint64_t retired_rings = 0;      // taken back, their memory still held by blocks in use
  };

  // Installs the data handler on `transport` (which must outlive the receiver). One receiver per
  // transport at a time: destroying it uninstalls the handler.
  static absl::StatusOr<std::unique_ptr<BlockReceiver>> Create(Transport* transport,
                                                               BlockReceiverOptions options,
                                                               BlockConsumer consumer);
  // Uninstalls the handler and waits for blocks being verified or consumed.
  ~BlockReceiver();

  Stats stats() const;

  // Prometheus text (strata_transport_received_* counters, pending-bytes gauges), for a node's
  // /metrics (common/metrics.h).
  std::string RenderMetrics() const;

  class Impl;

 private:
  explicit BlockReceiver(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// ---- sender -------------------------------------------------------------------------------------

struct BlockSenderOptions {
  // Unacknowledged bytes per peer endpoint. A block larger than this goes alone.
  uint64_t max_bytes_in_flight = uint64_t{64} << 20;
  // Per-transfer limit from Send until the acknowledgement, unless SendOptions says otherwise.
  absl::Duration timeout = absl::Seconds(30);
  // Direct placement into a same-host receiver's ring (when the transport can map it) for blocks
  // of at least this many bytes; smaller ones ride in the message. 0: never place. (The default
  // is where placement starts to pay: docs/transport.md.)
  uint64_t placement_min_bytes = 1 << 20;
  // Placed blocks of at least this many bytes are streamed: header first, then the copy in
  // pieces that the receiver checks as they land (see block_protocol.h). 0: never.
  uint64_t stream_min_bytes = 1 << 20;
  // Blocks that travel as payload and are larger than this go in pieces of this many bytes, each
  // its own message; the receiver checks each piece's CRC on the transport's thread as it lands,
  // still in cache, instead of reading the whole block again afterwards (docs/transport.md
  // measures the difference). 0: always whole.
  uint64_t piece_bytes = 1 << 20;
  // Ring space of a placed block whose transfer ended without the receiver's answer (timed out,
  // cancelled, its header lost) is presumed lost after this long: if a block does not fit the
  // ring only because of such space, the sender gives the ring back and asks for a new one.
  // (Before then a late ack or release may still free it: a slow consumer, a receiver waiting
  // out a stalled copy.)
  absl::Duration reclaim_after = absl::Seconds(10);
  // Attempts per transfer (>= 1). A block the receiver refuses only for now — its bytes arrived
  // damaged (DATA_LOSS), it holds its limit of pending bytes (RESOURCE_EXHAUSTED) — is sent
  // again after retry_backoff, doubled for each further attempt, within the transfer's timeout.
  // Before sending a damaged block again the sender checks its own bytes against the CRC-32C it
  // sent: if they differ (a wrong SendOptions::crc32c, bytes changed after Send) it is not sent
  // again. Nothing else is retried: the consumer's status, a block too large, a lost connection
  // (UNAVAILABLE: the caller reconnects), the timeout. A block waiting to be sent again keeps its
  // room in the peer's window (its next attempt never waits for room, and a receiver refusing
  // for want of room slows its sender); its peer failing meanwhile fails it at once.
  int max_attempts = 3;
  absl::Duration retry_backoff = absl::Milliseconds(10);

  absl::Status Validate() const;
};

struct SendOptions {
  std::optional<absl::Duration> timeout = std::nullopt;  // default: BlockSenderOptions::timeout
  std::optional<uint32_t> crc32c = std::nullopt;         // the payload's CRC-32C if the caller has it
};

class BlockSender;

// One block on its way. Shared between the caller and the sender.
class Transfer {
 public:
  // Blocks until the transfer completes; returns its status.
  absl::Status Wait();
  // False if it has not completed within `timeout`.
  bool WaitFor(absl::Duration timeout);
  bool done() const;
  // Its status once done (UNKNOWN before).
  absl::Status status() const;
  // Completes it with CANCELLED unless it has already completed (see Endpoint::Cancel for what
  // that does to a payload already moving), also between attempts. The receiver may still have
  // received the block.
  void Cancel();
  // The transfer's sequence number on the wire (of its first attempt; each attempt has its own).
  uint64_t seq() const { return seq_; }

  struct State;

 private:
  friend class BlockSender;
  Transfer(std::shared_ptr<State> state, uint64_t seq) : state_(std::move(state)), seq_(seq) {}
  std::shared_ptr<State> state_;
  uint64_t seq_;
};

class BlockSender {
 public:
  struct Stats {
    uint64_t sent = 0;                   // acknowledged OK
    uint64_t retries = 0;                // attempts after a first (BlockSenderOptions::max_attempts)
    uint64_t bytes = 0;
    uint64_t failed = 0;                 // completed with any other status
    uint64_t max_bytes_in_flight = 0;    // most unacknowledged bytes to one peer at once
    uint64_t late_acks = 0;              // acks for transfers already completed (timed out)
    uint64_t placed = 0;                 // of `sent`, written straight into the peer's ring
    uint64_t rings = 0;                  // peers' rings mapped now
    // Rings given back for a new one because space in them was held by blocks whose transfer
    // ended without the receiver's answer (e.g. a lost header): nothing else would free it.
    uint64_t rings_renewed = 0;
  };

  // Installs the ack handler on `transport` (which must outlive the sender). One sender per
  // transport at a time (it serves every peer): destroying it uninstalls the handler.
  static absl::StatusOr<std::unique_ptr<BlockSender>> Create(Transport* transport,
                                                             BlockSenderOptions options);
  // Cancels what is pending and waits for it to complete.
  ~BlockSender();

  // Ships `payload` (which must stay valid until the transfer completes) as block `block_id`.
  // Blocks while the peer's window is full (backpressure), at most until the deadline. `done`,
  // if set, runs once on completion (on a transport or sender thread; must not block, nor
  // destroy the sender).
  std::shared_ptr<Transfer> Send(const std::shared_ptr<Endpoint>& peer, absl::string_view block_id,
                                 Payload payload, SendOptions options = {},
                                 std::function<void(absl::Status)> done = nullptr);

  Stats stats() const;

  // Prometheus text: strata_transport_sent_* counters and the histogram of transfer times
  // (Send to acknowledgement) of successful transfers.
  std::string RenderMetrics() const;

  class Impl;

 private:
  explicit BlockSender(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace strata::transport
