// A ring of a same-host receiver's memory lent to a BlockSender (block_protocol.h, "Placement"),
// and the allocator of its space. Private to transport/.
//
// The sender places a block at the lowest free offset that holds it with its progress word (the
// kPlacedPrefixBytes before it), 256-byte aligned, so that space given back quickly is reused while
// it is cache-warm. Space comes back when the receiver releases it; a streamed block's space
// released while it is still being copied comes back when its copy stops (`copying`). Space of a
// block whose transfer ended without the receiver's answer is `doubtful`: if its header never
// arrived nothing will give it back, so after a while the sender returns the whole ring and asks
// for a new one rather than wait (FitsIfReclaimed).
//
// Not thread-safe: the BlockSender's mutex guards every ring.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>

#include "absl/time/time.h"
#include "transport/transport.h"

namespace strata::transport::internal {

class SenderRing {
 public:
  enum class State { kRequested, kReady, kRefused };

  SenderRing() = default;
  SenderRing(const SenderRing&) = delete;
  SenderRing& operator=(const SenderRing&) = delete;
  // The mapping goes with the last holder (the sender's maps, or a Send still copying).
  ~SenderRing();

  // The space a block of `size` bytes takes, its progress word included.
  static uint64_t Need(uint64_t size);

  // Makes the ring ready over `mem` (mapped from the endpoint), all of it free.
  void Lend(std::span<uint8_t> mem);

  // The lowest free space for a block of `size` bytes, now used by transfer `seq`: the block's
  // offset (its progress word is the kPlacedPrefixBytes before it); nullopt when none holds it.
  std::optional<uint64_t> Allocate(uint64_t size, uint64_t seq);

  // Whether `size` bytes would fit if the space of blocks doubtful since before `before` came
  // back (false if there is none).
  bool FitsIfReclaimed(uint64_t size, absl::Time before) const;

  // Gives back a placed block's space, coalesced with its free neighbours. False for an offset
  // that is not placed (a confused or stale peer: ignored). Space still being copied into is
  // freed when its copy stops (CopyStopped).
  bool Release(uint64_t offset);

  // A streamed block at `offset` starts being copied / has stopped being copied.
  void CopyStarted(uint64_t offset) { copying_[offset] = false; }
  void CopyStopped(uint64_t offset);

  // The transfer `seq` of the block at `offset` ended without the receiver's answer (at `when`):
  // its space is doubtful unless the offset has been released or reused since.
  void Unanswered(uint64_t offset, uint64_t seq, absl::Time when);

  // Free bytes (all extents), for tests and stats.
  uint64_t free_bytes() const;

  uint64_t token = 0;
  std::weak_ptr<Endpoint> ep;
  State state = State::kRequested;
  std::span<uint8_t> mem;  // mapped while the endpoint is held
  // Placed blocks whose transfer is not complete.
  size_t unsettled = 0;
  absl::Time ask_again = absl::InfiniteFuture();  // kRefused: when to ask again
  uint64_t failure_handle = 0;

 private:
  struct Used {
    uint64_t bytes, seq;  // the space taken (with the progress word), and whose
  };
  std::map<uint64_t, uint64_t> free_;        // offset -> bytes, coalesced
  std::unordered_map<uint64_t, Used> used_;  // offset -> placed and not given back
  // Streamed blocks still being written -> given back meanwhile (freed when the copy stops).
  std::unordered_map<uint64_t, bool> copying_;
  // Offsets of blocks whose transfer completed without the receiver's answer (timed out,
  // cancelled, the header's send failed), with when: if the header never arrived, nothing gives
  // their space back; if it did, a release still may.
  std::unordered_map<uint64_t, absl::Time> doubtful_;
};

}  // namespace strata::transport::internal
