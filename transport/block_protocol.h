// The block shipping protocol, on any Transport.
//
// A prefill node's BlockSender ships each block as one message: a header (transfer sequence
// number, block id, size, CRC-32C) and the block's bytes as the payload. The peer's
// BlockReceiver places the payload in registered memory from its pool, verifies the checksum off
// the transport's thread, hands the block to its consumer, and acknowledges with the consumer's
// status; a block whose checksum fails is never handed on (DATA_LOSS goes back). The sender's
// Transfer completes with that acknowledgement, or with the failure that prevented it:
//
//   UNAVAILABLE         the peer died or the connection failed (partial data is discarded)
//   DEADLINE_EXCEEDED   no acknowledgement within the transfer's timeout
//   CANCELLED           Transfer::Cancel
//   DATA_LOSS           the receiver's checksum did not match
//   RESOURCE_EXHAUSTED  the block is larger than the receiver accepts
//   anything else       the receiver's consumer refused the block with that status
//
// Streaming: every block is acknowledged on its own, so a prefill node sends layer l while it
// computes layer l+1, and the consumer sees layer 0 as soon as it is verified.
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
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace strata::transport {

// Transport message ids the protocol uses.
inline constexpr uint16_t kBlockDataMessage = 1;
inline constexpr uint16_t kBlockAckMessage = 2;

// ---- wire format (little-endian; every decoder bounds-checks) ---------------------------------

inline constexpr size_t kMaxBlockIdBytes = 1024;
inline constexpr size_t kMaxAckMessageBytes = 512;

struct BlockDataHeader {
  uint64_t seq = 0;        // the sender's transfer number, echoed by the ack
  uint64_t size = 0;       // payload bytes
  uint32_t crc32c = 0;     // of the payload
  std::string block_id;    // opaque to the protocol (the store's BlockName bytes), <= 1 KiB
};

struct BlockAckHeader {
  uint64_t seq = 0;
  absl::Status status;     // message truncated to kMaxAckMessageBytes
};

std::string EncodeBlockDataHeader(const BlockDataHeader& h);
// INVALID_ARGUMENT naming the field for a short, oversized or malformed header.
absl::StatusOr<BlockDataHeader> DecodeBlockDataHeader(std::span<const uint8_t> bytes);
std::string EncodeBlockAckHeader(const BlockAckHeader& h);
absl::StatusOr<BlockAckHeader> DecodeBlockAckHeader(std::span<const uint8_t> bytes);

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
// BlockReceiverOptions::inline_max_bytes); may take its time (the sender's window absorbs it). Its status is what the sender's Transfer completes with.
using BlockConsumer = std::function<absl::Status(ReceivedBlock)>;

struct BlockReceiverOptions {
  // Larger announced blocks are refused with RESOURCE_EXHAUSTED before any byte moves.
  uint64_t max_block_bytes = uint64_t{1} << 30;
  // Free registered buffers kept for reuse (bytes); more are deregistered and freed.
  uint64_t pool_bytes = uint64_t{256} << 20;
  // Threads that verify checksums and run the consumer (>= 1).
  int verify_threads = 1;
  // Blocks up to this size are verified and consumed on the transport's thread as they land:
  // the bytes are still in cache and no thread hand-off is paid (+30 % throughput at 1 MiB on
  // the benchmark machine). Only for a consumer that returns quickly (hands the block on, copies
  // it into RAM): the transport receives nothing else meanwhile. 0: always a verify thread.
  uint64_t inline_max_bytes = 0;

  absl::Status Validate() const;
};

class BlockReceiver {
 public:
  struct Stats {
    uint64_t blocks = 0;             // verified and handed to the consumer
    uint64_t bytes = 0;
    uint64_t refused = 0;            // consumer returned an error
    uint64_t checksum_failures = 0;  // DATA_LOSS sent back
    uint64_t too_large = 0;          // RESOURCE_EXHAUSTED sent back
    uint64_t malformed = 0;          // undecodable header or size mismatch
    uint64_t aborted = 0;            // payload transfer failed midway; discarded
    uint64_t max_pending_bytes = 0;  // most payload bytes held at once (arriving or being consumed)
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
  // that does to a payload already moving). The receiver may still have received the block.
  void Cancel();
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
    uint64_t bytes = 0;
    uint64_t failed = 0;                 // completed with any other status
    uint64_t max_bytes_in_flight = 0;    // most unacknowledged bytes to one peer at once
    uint64_t late_acks = 0;              // acks for transfers already completed (timed out)
  };

  // Installs the ack handler on `transport` (which must outlive the sender). One sender per
  // transport at a time (it serves every peer): destroying it uninstalls the handler.
  static absl::StatusOr<std::unique_ptr<BlockSender>> Create(Transport* transport,
                                                             BlockSenderOptions options);
  // Cancels what is pending and waits for it to complete.
  ~BlockSender();

  // Ships `payload` (which must stay valid until the transfer completes) as block `block_id`.
  // Blocks while the peer's window is full (backpressure), at most until the deadline. `done`,
  // if set, runs once on completion (on a transport or sender thread; must not block).
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
