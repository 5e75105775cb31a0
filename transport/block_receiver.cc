// The block protocol's receiving side: BlockReceiver, which lands, verifies and hands on the
// blocks a BlockSender ships, and lends same-host senders rings of its memory.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/aligned_buffer.h"
#include "common/buffer_pool.h"
#include "common/crc32c.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "common/task_queue.h"
#include "transport/block_protocol.h"
#include "transport/internal/block_common.h"

namespace strata::transport {

using internal::HandlerList;
using internal::InstallHandlers;
using internal::SendMessage;
using internal::SendRelease;
using internal::UninstallHandlers;

namespace {

void SpinPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A receive buffer and its registration with the transport, pooled together (a registration
// is what makes reuse pay: registering memory costs far more than the copy for RDMA NICs).
struct RegisteredBuffer {
  AlignedBuffer buffer;
  std::unique_ptr<MemoryRegion> region;
  size_t size() const { return buffer.size(); }
};

// A registered buffer for `size` bytes, reused by 4 KiB-rounded size (a model's blocks come in
// few sizes).
absl::StatusOr<std::shared_ptr<RegisteredBuffer>> AcquireRegistered(
    BufferPool<RegisteredBuffer>& pool, Transport& transport, size_t size) {
  const size_t capacity = std::max<size_t>(64, (size + 4095) / 4096 * 4096);
  if (std::shared_ptr<RegisteredBuffer> b = pool.Reuse(capacity)) return b;
  auto b = std::make_unique<RegisteredBuffer>();
  b->buffer = AlignedBuffer::Uninitialized(capacity);
  STRATA_ASSIGN_OR_RETURN(b->region,
                          transport.Register(b->buffer.data(), capacity, MemoryKind::kHost));
  return pool.Track(std::move(b));
}

// `retryable`: the receiver's own passing refusal (bytes damaged on the way, no room now).
void Reply(const std::shared_ptr<Endpoint>& ep, uint64_t seq, const absl::Status& status,
           std::optional<RingPlace> released = std::nullopt, bool retryable = false) {
  if (ep == nullptr) return;
  SendMessage(ep, kBlockAckMessage,
              EncodeBlockAckHeader(
                  {.seq = seq, .status = status, .released = released, .retryable = retryable}),
              [](absl::Status) {});
}

// Memory lent to one same-host sender.
struct LentRing {
  uint64_t token = 0;
  std::unique_ptr<MemoryRegion> region;
  std::weak_ptr<Endpoint> ep;
  uint64_t failure_handle = 0;
};

// Who gives a placed block's ring space back: the ack, if the block's last hold is gone by the
// time it is sent, or else a release message when it goes.
struct PlacedRelease {
  RingPlace place;
  std::weak_ptr<Endpoint> ep;
  std::atomic<int> state{0};  // 0: both pending; 1: hold gone first; 2: ack went first

  void HoldGone() {
    if (state.exchange(1) == 2) {
      SendRelease(ep.lock(), kBlockRingReleaseMessage,
                  {.token = place.token, .offsets = {place.offset}});
    }
  }
  // The ack carries the release if the hold went first.
  std::optional<RingPlace> AckGoing() {
    return state.exchange(2) == 1 ? std::optional<RingPlace>(place) : std::nullopt;
  }
};

}  // namespace

absl::Status BlockReceiverOptions::Validate() const {
  if (max_block_bytes == 0) return absl::InvalidArgumentError("max_block_bytes must be > 0");
  if (max_pending_bytes < max_block_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_pending_bytes (", max_pending_bytes,
                     ") must be at least max_block_bytes (", max_block_bytes, ")"));
  }
  if (stall_timeout <= absl::ZeroDuration() || piece_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stall_timeout and piece_timeout must be positive, got ",
                     absl::FormatDuration(stall_timeout), " and ",
                     absl::FormatDuration(piece_timeout)));
  }
  if (max_rings < 0) return absl::InvalidArgumentError("max_rings must be >= 0");
  if (verify_threads < 1 || verify_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify_threads must be in [1, 64], got ", verify_threads));
  }
  return absl::OkStatus();
}

class BlockReceiver::Impl : public std::enable_shared_from_this<BlockReceiver::Impl> {
 public:
  Impl(Transport* transport, BlockReceiverOptions options, BlockConsumer consumer)
      : transport_(transport),
        options_(options),
        consumer_(std::move(consumer)),
        pool_(BufferPool<RegisteredBuffer>::Create(options.pool_bytes)),
        tasks_(options.verify_threads) {
    watcher_ = std::thread([this] { WatchStalls(); });
  }

  static HandlerList<Impl> Handlers() {
    return {{kBlockDataMessage, &Impl::OnData},
            {kBlockPieceMessage, &Impl::OnPiece},
            {kBlockRingRequestMessage, &Impl::OnRingRequest},
            {kBlockRingReturnMessage, &Impl::OnRingReturn}};
  }

  void OnData(IncomingMessage& m) {
    absl::StatusOr<BlockDataHeader> h = DecodeBlockDataHeader(m.header());
    if (!h.ok()) {
      Count(&Stats::malformed);
      return;  // no sequence number to answer to; the sender times out
    }
    std::shared_ptr<Endpoint> ep = m.endpoint();
    if (h->placed) {
      OnPlaced(std::move(*h), m.payload_size(), std::move(ep));
      return;
    }
    const uint64_t first = m.payload_size();
    if (h->pieced ? first == 0 || first >= h->size || ep == nullptr : first != h->size) {
      Count(&Stats::malformed);
      Reply(ep, h->seq,
            absl::InvalidArgumentError(absl::StrCat(
                "block ", h->seq, ": header says ", h->size, " bytes",
                h->pieced ? " in pieces (the first shorter than the block)" : "",
                ", the message carries ", first)));
      return;
    }
    if (h->size > options_.max_block_bytes) {
      Count(&Stats::too_large);
      Reply(ep, h->seq,
            absl::ResourceExhaustedError(absl::StrCat("block of ", h->size,
                                                      " bytes exceeds the receiver's limit of ",
                                                      options_.max_block_bytes)));
      return;
    }
    if (absl::Status room = TakePending(h->size); !room.ok()) {
      Count(&Stats::overloaded);
      Reply(ep, h->seq, room, std::nullopt, /*retryable=*/true);
      return;
    }
    absl::StatusOr<std::shared_ptr<RegisteredBuffer>> slot =
        AcquireRegistered(*pool_, *transport_, h->size);
    if (!slot.ok()) {
      AddPending(-static_cast<int64_t>(h->size), /*pooled=*/true);
      Reply(ep, h->seq, slot.status());
      return;
    }
    auto self = shared_from_this();
    auto header = std::make_shared<BlockDataHeader>(std::move(*h));
    std::shared_ptr<RegisteredBuffer> buf = std::move(*slot);
    Landed landed{.bytes = std::span<const uint8_t>(buf->buffer.data(), header->size),
                  .hold = buf};
    if (header->size == 0) {
      Arrived(self, header, std::move(landed), ep, absl::OkStatus());
      return;
    }
    if (header->pieced) {
      StartPieces(m, header, std::move(buf), std::move(ep));
      return;
    }
    Destination dest{.bytes = std::span<uint8_t>(buf->buffer.data(), header->size),
                     .region = buf->region.get()};
    m.Accept(dest, [self, header, landed, ep](absl::Status s) {
      Arrived(self, header, landed, ep, std::move(s));
    });
  }

  // A later piece of a pieced block: it must be the next one (pieces come in order).
  void OnPiece(IncomingMessage& m) {
    absl::StatusOr<BlockPieceHeader> p = DecodeBlockPieceHeader(m.header());
    if (!p.ok()) {
      Count(&Stats::malformed);
      return;
    }
    std::shared_ptr<Pieces> a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pieces_.find({m.endpoint().get(), p->seq});
      if (it == pieces_.end()) return;  // its block failed or was given up: dropped
      a = it->second;
    }
    if (p->abandoned) {  // the sender gave the transfer up (cancel, timeout) before its end
      GiveUp(a, &Stats::aborted,
             absl::CancelledError(absl::StrCat("block ", p->seq, ": the sender gave it up with ",
                                               p->offset, " of its ", a->header->size,
                                               " bytes sent")));
      return;
    }
    absl::Status bad;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (a->over) return;
      const uint64_t n = m.payload_size();
      if (p->offset != a->arrived || n == 0 || n > a->header->size - a->arrived) {
        bad = absl::InvalidArgumentError(absl::StrCat(
            "block ", p->seq, ": a piece of ", n, " bytes at offset ", p->offset,
            ", where the next piece of its ", a->header->size, " bytes starts at ", a->arrived));
      } else {
        a->arrived += n;
        a->moved = absl::Now();
      }
    }
    if (!bad.ok()) {
      GiveUp(a, &Stats::malformed, std::move(bad));
      return;
    }
    AcceptPiece(m, a, p->offset);
  }

  // A pieced block being received: its pieces land in one buffer, each checked as it lands.
  struct Pieces {
    std::shared_ptr<BlockDataHeader> header;
    std::shared_ptr<RegisteredBuffer> buf;
    std::shared_ptr<Endpoint> ep;
    uint64_t failure_handle = 0;
    std::mutex mu;
    uint64_t arrived = 0;  // bytes whose pieces have arrived: where the next piece starts
    absl::Time moved = absl::Now();  // when a piece last arrived or landed
    uint64_t checked = 0;  // bytes from the start whose CRC is `crc`
    uint32_t crc = 0;
    std::map<uint64_t, uint64_t> ahead;  // offset -> bytes of pieces landed before their turn
    bool over = false;  // complete, failed or given up: nothing more is done with it
  };

  void StartPieces(IncomingMessage& m, std::shared_ptr<BlockDataHeader> header,
                   std::shared_ptr<RegisteredBuffer> buf, std::shared_ptr<Endpoint> ep) {
    auto a = std::make_shared<Pieces>();
    a->header = std::move(header);
    a->buf = std::move(buf);
    a->ep = std::move(ep);
    a->arrived = m.payload_size();
    bool stopped;
    std::shared_ptr<Pieces> stale;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped = stopped_;
      if (!stopped) {
        std::shared_ptr<Pieces>& slot = pieces_[{a->ep.get(), a->header->seq}];
        stale = std::move(slot);
        slot = a;
      }
    }
    if (stopped) {
      GiveUp(a, nullptr, absl::UnavailableError(absl::StrCat("block ", a->header->seq,
                                                             ": the receiver is shutting down")));
      return;
    }
    if (stale != nullptr) {
      // A block under the same sequence number that never finished (a sender that started
      // again numbers its transfers from 1 again): freed without an answer, which would now go
      // to the new block's transfer.
      GiveUp(stale, &Stats::aborted, absl::AbortedError("superseded"), /*reply=*/false);
    }
    // The pieces still to come go with the connection.
    bool handle_set = false;
    const uint64_t handle =
        a->ep->OnFailure([weak = weak_from_this(), wa = std::weak_ptr<Pieces>(a)](
                             const absl::Status& s) {
          auto self = weak.lock();
          auto a = wa.lock();
          if (self == nullptr || a == nullptr) return;
          self->GiveUp(a, &Stats::aborted, absl::UnavailableError(
                              absl::StrCat("block ", a->header->seq,
                                           ": the connection failed while its pieces arrived: ",
                                           s.message())));
        });
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (!a->over) {
        a->failure_handle = handle;
        handle_set = true;
      }
    }
    if (!handle_set) {  // the connection had already failed, or shutdown came first
      a->ep->RemoveFailureCallback(handle);
      return;
    }
    AcceptPiece(m, a, 0);
  }

  // Lands the message's payload at `at` in the block's buffer; PieceLanded checks it.
  void AcceptPiece(IncomingMessage& m, const std::shared_ptr<Pieces>& a, uint64_t at) {
    const uint64_t n = m.payload_size();
    m.Accept({.bytes = std::span<uint8_t>(a->buf->buffer.data() + at, n),
              .region = a->buf->region.get()},
             [self = shared_from_this(), a, at, n](absl::Status s) {
               self->PieceLanded(a, at, n, std::move(s));
             });
  }

  // On the transport's thread, while the piece is in cache: its CRC extends the block's (a piece
  // that landed before its turn is checked when its turn comes). The last one hands the block on.
  void PieceLanded(const std::shared_ptr<Pieces>& a, uint64_t at, uint64_t n, absl::Status s) {
    if (!s.ok()) {
      GiveUp(a, &Stats::aborted, std::move(s));
      return;
    }
    uint32_t crc;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (a->over) return;
      a->moved = absl::Now();
      a->ahead[at] = n;
      for (auto it = a->ahead.begin(); it != a->ahead.end() && it->first == a->checked;
           it = a->ahead.erase(it)) {
        a->crc = Crc32cExtend(a->crc, a->buf->buffer.data() + it->first, it->second);
        a->checked += it->second;
      }
      if (a->checked != a->header->size) return;
      a->over = true;
      crc = a->crc;
    }
    Forget(a);
    Arrived(shared_from_this(), a->header,
            Landed{.bytes = std::span<const uint8_t>(a->buf->buffer.data(), a->header->size),
                   .hold = a->buf,
                   .crc = crc},
            a->ep, absl::OkStatus());
  }

  // Gives up pieced blocks whose sender stopped sending their pieces (a lost piece, a sender
  // that went quiet without its connection failing), until Shutdown.
  void WatchStalls() {
    const absl::Duration stall = options_.piece_timeout;
    const absl::Duration period =
        std::clamp(stall / 4, absl::Milliseconds(5), absl::Milliseconds(500));
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopped_) {
      watch_cv_.wait_for(lock, absl::ToChronoNanoseconds(period));
      if (stopped_ || pieces_.empty()) continue;
      std::vector<std::shared_ptr<Pieces>> arriving;
      for (const auto& [key, a] : pieces_) arriving.push_back(a);
      lock.unlock();
      const absl::Time now = absl::Now();
      for (const auto& a : arriving) {
        uint64_t arrived;
        {
          std::lock_guard<std::mutex> piece_lock(a->mu);
          if (now - a->moved < stall) continue;
          arrived = a->arrived;
        }
        GiveUp(a, &Stats::aborted,
               absl::DeadlineExceededError(absl::StrCat(
                   "block ", a->header->seq, ": no piece for ", absl::FormatDuration(stall),
                   " with ", arrived, " of its ", a->header->size, " bytes sent")));
      }
      lock.lock();
    }
  }

  // Fails a pieced block (once; `counter`, if set, counts it then): the sender learns why
  // (unless `reply` is false), the partial data goes with the buffer (once the pieces still
  // landing are in), later pieces are dropped.
  void GiveUp(const std::shared_ptr<Pieces>& a, uint64_t Stats::*counter, absl::Status why,
              bool reply = true) {
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (a->over) return;
      a->over = true;
    }
    if (counter != nullptr) Count(counter);
    Forget(a);
    if (reply) {
      Finish(a->ep, *a->header, Landed{.bytes = {}, .hold = a->buf}, why);
    } else {
      AddPending(-static_cast<int64_t>(a->header->size), /*pooled=*/true);
    }
  }

  // Takes a block that is over out of the map (if it is still the one there) and off its
  // connection's failure callbacks.
  void Forget(const std::shared_ptr<Pieces>& a) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pieces_.find({a->ep.get(), a->header->seq});
      if (it != pieces_.end() && it->second == a) pieces_.erase(it);
    }
    uint64_t handle;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      handle = a->failure_handle;
    }
    if (handle != 0) a->ep->RemoveFailureCallback(handle);
  }

  // A sender asks for a ring: lend one (allocated where the transport moves it fastest, i.e.
  // where a same-host peer can map it) or say why not.
  void OnRingRequest(IncomingMessage& m) {
    absl::StatusOr<RingRequest> req = DecodeRingRequest(m.header());
    if (!req.ok()) {
      Count(&Stats::malformed);
      return;
    }
    std::shared_ptr<Endpoint> ep = m.endpoint();
    RingGrant grant{.token = req->token};
    auto refuse = [&](absl::StatusCode code) {
      grant.code = code;
      SendMessage(ep, kBlockRingGrantMessage, EncodeRingGrant(grant), [](absl::Status) {});
    };
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_ || options_.ring_bytes == 0) return refuse(absl::StatusCode::kUnimplemented);
      if (rings_.contains(req->token)) return refuse(absl::StatusCode::kAlreadyExists);
      std::erase_if(retired_, Expired);
      if (rings_.size() + retired_.size() >= static_cast<size_t>(options_.max_rings)) {
        return refuse(absl::StatusCode::kResourceExhausted);
      }
    }
    auto ring = std::make_shared<LentRing>();
    ring->token = req->token;
    ring->ep = ep;
    absl::StatusOr<std::unique_ptr<MemoryRegion>> region =
        transport_->Allocate(options_.ring_bytes, MemoryKind::kHost);
    // (Never RESOURCE_EXHAUSTED, which has the sender ask again: a failed allocation is not
    // retried.)
    if (!region.ok()) return refuse(absl::StatusCode::kUnavailable);
    ring->region = std::move(*region);
    absl::StatusOr<std::string> desc = ring->region->RemoteDescriptor();
    if (!desc.ok()) return refuse(desc.status().code());
    if (desc->empty() || desc->size() > kMaxRingDescriptorBytes) {
      return refuse(absl::StatusCode::kUnimplemented);
    }
    grant.descriptor = std::move(*desc);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return refuse(absl::StatusCode::kUnavailable);
      rings_[ring->token] = ring;
    }
    // The ring goes with the connection (the holds of blocks in it keep its memory).
    const uint64_t handle =
        ep->OnFailure([weak = weak_from_this(), token = ring->token](const absl::Status&) {
          if (auto self = weak.lock()) self->TakeBack(token, /*tell_sender=*/false);
        });
    {
      std::lock_guard<std::mutex> lock(mu_);
      ring->failure_handle = handle;
    }
    SendMessage(ep, kBlockRingGrantMessage, EncodeRingGrant(grant), [](absl::Status) {});
  }

  // A sender gives its ring back (it cannot map it, or is shutting down).
  void OnRingReturn(IncomingMessage& m) {
    absl::StatusOr<RingRelease> r = DecodeRingRelease(m.header());
    if (!r.ok() || !r->drop) {
      Count(&Stats::malformed);
      return;
    }
    TakeBack(r->token, /*tell_sender=*/false);
  }

  BlockReceiver::Stats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return StatsLocked();
  }
  BlockReceiver::Stats StatsLocked() const {
    BlockReceiver::Stats st = stats_;
    st.rings = rings_.size();
    st.retired_rings = retired_.size() - std::count_if(retired_.begin(), retired_.end(), Expired);
    return st;
  }

  std::string RenderMetrics() const {
    Stats st;
    uint64_t pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      st = StatsLocked();
      pending = pending_bytes_;
    }
    std::string out;
    const std::pair<const char*, uint64_t> counters[] = {
        {"blocks", st.blocks},
        {"bytes", st.bytes},
        {"refused", st.refused},
        {"checksum_failures", st.checksum_failures},
        {"too_large", st.too_large},
        {"overloaded", st.overloaded},
        {"malformed", st.malformed},
        {"aborted", st.aborted},
        {"placed_blocks", st.placed},
        {"pieced_blocks", st.pieced}};
    for (const auto& [name, v] : counters) {
      RenderMetric(absl::StrCat("strata_transport_received_", name, "_total"), "counter",
                   absl::StrCat("block receiver: ", name), static_cast<double>(v), &out);
    }
    RenderMetric("strata_transport_received_pending_bytes", "gauge",
                 "payload bytes arriving or being consumed now", static_cast<double>(pending),
                 &out);
    RenderMetric("strata_transport_received_max_pending_bytes", "gauge",
                 "most payload bytes held at once", static_cast<double>(st.max_pending_bytes),
                 &out);
    RenderMetric("strata_transport_lent_rings", "gauge",
                 "rings of memory lent to same-host senders now", static_cast<double>(st.rings),
                 &out);
    RenderMetric("strata_transport_retired_rings", "gauge",
                 "rings taken back whose memory blocks in use still hold",
                 static_cast<double>(st.retired_rings), &out);
    return out;
  }

  // After this no consumer call starts; those under way (queued or inline) finish first. Lent
  // rings are taken back (their senders told); blocks still held keep their memory.
  void Shutdown() {
    UninstallHandlers(transport_, Handlers());
    std::vector<uint64_t> tokens;
    std::vector<std::shared_ptr<Pieces>> arriving;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      watch_cv_.notify_all();
      for (const auto& [token, ring] : rings_) tokens.push_back(token);
      for (const auto& [key, a] : pieces_) arriving.push_back(a);
    }
    if (watcher_.joinable()) watcher_.join();
    for (uint64_t token : tokens) TakeBack(token, /*tell_sender=*/true);
    for (const auto& a : arriving) {
      GiveUp(a, nullptr, absl::UnavailableError(absl::StrCat("block ", a->header->seq,
                                                             ": the receiver shut down")));
    }
    tasks_.Stop();
    std::unique_lock<std::mutex> lock(mu_);
    inline_cv_.wait(lock, [&] { return inline_running_ == 0; });
  }

 private:
  // Where a block's bytes are, and what keeps them there.
  struct Landed {
    std::span<const uint8_t> bytes;
    std::shared_ptr<const void> hold;
    std::shared_ptr<PlacedRelease> placed = nullptr;  // set for a block in a lent ring
    uint64_t* progress = nullptr;  // a streamed block's progress word (in the ring)
    std::optional<uint32_t> crc = std::nullopt;  // a pieced block's, computed as it landed
  };

  // The CRC of a streamed block, computed as the sender's progress word says its bytes are
  // there (each piece still in cache from the sender's copy).
  absl::StatusOr<uint32_t> CrcAsWritten(const BlockDataHeader& h, const Landed& landed,
                                        const std::shared_ptr<Endpoint>& ep) const {
    const absl::Duration stall = options_.stall_timeout;
    std::atomic_ref<uint64_t> progress(*landed.progress);
    const uint64_t n = landed.bytes.size();
    uint32_t crc = 0;
    uint64_t done = 0;
    absl::Time stall_at = absl::Now() + stall;
    for (uint32_t spins = 0; done < n;) {
      const uint64_t there = progress.load(std::memory_order_acquire);
      if (there > n) {
        return absl::DataLossError(absl::StrCat("block ", h.seq, ": the sender's progress word says ",
                                                there, " of its ", n, " bytes are written"));
      }
      if (there > done) {
        crc = Crc32cExtend(crc, landed.bytes.data() + done, there - done);
        done = there;
        stall_at = absl::Now() + stall;
        continue;
      }
      if (++spins % 1024 == 0) {
        if (absl::Status health = ep != nullptr ? ep->health() : absl::OkStatus(); !health.ok()) {
          return absl::UnavailableError(absl::StrCat("block ", h.seq, ": the sender failed with ",
                                                     done, " of ", n, " bytes written: ",
                                                     health.message()));
        }
        if (absl::Now() > stall_at) {
          return absl::DeadlineExceededError(
              absl::StrCat("block ", h.seq, ": the sender stopped writing at ", done, " of ", n,
                           " bytes for ", absl::FormatDuration(stall)));
        }
      }
      SpinPause();
    }
    return crc;
  }

  void OnPlaced(BlockDataHeader h, size_t payload_size, std::shared_ptr<Endpoint> ep) {
    const RingPlace place = *h.placed;
    std::shared_ptr<LentRing> ring;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = rings_.find(place.token); it != rings_.end()) ring = it->second;
    }
    absl::Status bad;
    if (payload_size != 0) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "block ", h.seq, ": placed in a ring, yet the message carries ", payload_size,
          " payload bytes"));
    } else if (ring == nullptr) {
      bad = absl::FailedPreconditionError(absl::StrFormat(
          "block %d: placed in ring %016x, which this receiver has not lent (or took back)",
          h.seq, place.token));
    } else if (place.offset < kPlacedPrefixBytes || place.offset % 8 != 0 ||
               place.offset > ring->region->size() ||
               h.size > ring->region->size() - place.offset) {
      bad = absl::OutOfRangeError(absl::StrCat(
          "block ", h.seq, ": ", h.size, " bytes at offset ", place.offset,
          " do not fit the ring of ", ring->region->size(),
          " bytes after an aligned progress word"));
    }
    if (!bad.ok()) {
      Count(&Stats::malformed);
      Reply(ep, h.seq, bad);  // (no space to give back: what it names was never lent)
      if (ring == nullptr && payload_size == 0) {  // tell the sender to forget that ring
        SendRelease(ep, kBlockRingReleaseMessage, {.token = place.token, .drop = true});
      }
      return;
    }
    AddPending(static_cast<int64_t>(h.size), /*pooled=*/false);
    auto control = std::make_shared<PlacedRelease>();
    control->place = place;
    control->ep = ep;
    const uint8_t* at = ring->region->data() + place.offset;
    Landed landed{.bytes = std::span<const uint8_t>(at, h.size),
                  .hold = std::shared_ptr<const void>(
                      at, [ring, control](const void*) { control->HoldGone(); }),
                  .placed = control,
                  .progress = h.streamed ? reinterpret_cast<uint64_t*>(ring->region->data() +
                                                                       place.offset -
                                                                       kPlacedPrefixBytes)
                                         : nullptr};
    Arrived(shared_from_this(), std::make_shared<BlockDataHeader>(std::move(h)),
            std::move(landed), ep, absl::OkStatus());
  }

  // Takes a lent ring back: no more blocks placed in it are accepted.
  void TakeBack(uint64_t token, bool tell_sender) {
    std::shared_ptr<LentRing> ring;
    uint64_t handle = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = rings_.find(token);
      if (it == rings_.end()) return;
      ring = std::move(it->second);
      rings_.erase(it);
      handle = ring->failure_handle;
      std::erase_if(retired_, Expired);
      retired_.push_back(ring);  // (its memory goes with the last block in it)
    }
    if (std::shared_ptr<Endpoint> ep = ring->ep.lock()) {
      ep->RemoveFailureCallback(handle);
      if (tell_sender) {
        SendRelease(ep, kBlockRingReleaseMessage, {.token = token, .drop = true});
      }
    }
  }

  static void Arrived(const std::shared_ptr<Impl>& self, std::shared_ptr<BlockDataHeader> header,
                      Landed landed, std::shared_ptr<Endpoint> ep, absl::Status s) {
    if (!s.ok()) {  // partial data: discarded with the buffer
      self->Count(&Stats::aborted);
      self->Finish(ep, *header, std::move(landed), s);
      return;
    }
    if (header->size <= self->options_.inline_max_bytes) {  // still in cache; no hand-off
      bool run;
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        run = !self->stopped_;
        if (run) ++self->inline_running_;
      }
      if (run) {
        self->Verify(*header, std::move(landed), ep);
        std::lock_guard<std::mutex> lock(self->mu_);
        if (--self->inline_running_ == 0) self->inline_cv_.notify_all();
        return;
      }
    } else if (self->tasks_.Post([self, header, landed = std::move(landed), ep]() mutable {
                 // (moved, not copied: no other copy of the hold may outlive the ack, or the
                 // ring space would come back in a message of its own)
                 self->Verify(*header, std::move(landed), ep);
               })) {
      return;
    } else {
      landed = {};  // went with the task that was not run
    }
    // The receiver is shutting down: nobody will consume it.
    self->Finish(ep, *header, std::move(landed), absl::UnavailableError("receiver shut down"));
  }

  void Verify(const BlockDataHeader& h, Landed landed, const std::shared_ptr<Endpoint>& ep) {
    uint32_t crc = 0;
    if (landed.progress != nullptr) {
      absl::StatusOr<uint32_t> c = CrcAsWritten(h, landed, ep);
      if (!c.ok()) {
        Count(&Stats::aborted);
        Finish(ep, h, std::move(landed), c.status());
        return;
      }
      crc = *c;
    } else {
      crc = landed.crc.has_value() ? *landed.crc : Crc32c(landed.bytes.data(), h.size);
    }
    absl::Status status;
    const bool damaged = crc != h.crc32c;
    if (damaged) {
      Count(&Stats::checksum_failures);
      status = absl::DataLossError(absl::StrFormat(
          "block %s (transfer %d, %d bytes%s): checksum mismatch, received data has CRC-32C "
          "%08x, the sender's header says %08x",
          absl::CEscape(h.block_id.substr(0, 64)), h.seq, h.size,
          landed.placed ? ", placed in the sender's ring" : "", crc, h.crc32c));
    } else {
      status = consumer_(ReceivedBlock{.id = h.block_id,
                                       .crc32c = crc,
                                       .bytes = landed.bytes,
                                       .hold = landed.hold,
                                       .from = ep});
      std::lock_guard<std::mutex> lock(mu_);
      if (status.ok()) {
        ++stats_.blocks;
        stats_.bytes += h.size;
        if (landed.placed) ++stats_.placed;
        if (landed.crc.has_value()) ++stats_.pieced;
      } else {
        ++stats_.refused;
      }
    }
    Finish(ep, h, std::move(landed), status, /*retryable=*/damaged);
  }

  // Drops the receiver's own hold on the block and acknowledges it (giving its ring space back
  // with the ack when nobody else holds it).
  void Finish(const std::shared_ptr<Endpoint>& ep, const BlockDataHeader& h, Landed landed,
              const absl::Status& status, bool retryable = false) {
    AddPending(-static_cast<int64_t>(h.size), /*pooled=*/!h.placed.has_value());
    landed.hold.reset();
    std::optional<RingPlace> released;
    if (landed.placed) released = landed.placed->AckGoing();
    Reply(ep, h.seq, status, released, retryable);
  }

  void Count(uint64_t Stats::*field) {
    std::lock_guard<std::mutex> lock(mu_);
    ++(stats_.*field);
  }

  // Counts `size` more bytes of a payload block held, unless the receiver's pooled buffers
  // would then hold more than max_pending_bytes.
  absl::Status TakePending(uint64_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pooled_bytes_ + size > options_.max_pending_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "block of ", size, " bytes: the receiver holds ", pooled_bytes_,
          " bytes of blocks arriving or being consumed, its limit is ",
          options_.max_pending_bytes, "; try again"));
    }
    AddPendingLocked(static_cast<int64_t>(size), /*pooled=*/true);
    return absl::OkStatus();
  }

  // `pooled`: a payload block's bytes (in a pooled buffer), not a placed block's (in a ring).
  void AddPending(int64_t delta, bool pooled) {
    std::lock_guard<std::mutex> lock(mu_);
    AddPendingLocked(delta, pooled);
  }

  void AddPendingLocked(int64_t delta, bool pooled) {
    pending_bytes_ = static_cast<uint64_t>(static_cast<int64_t>(pending_bytes_) + delta);
    if (pooled) pooled_bytes_ = static_cast<uint64_t>(static_cast<int64_t>(pooled_bytes_) + delta);
    stats_.max_pending_bytes = std::max(stats_.max_pending_bytes, pending_bytes_);
  }

  Transport* transport_;
  const BlockReceiverOptions options_;
  BlockConsumer consumer_;
  std::shared_ptr<BufferPool<RegisteredBuffer>> pool_;
  mutable std::mutex mu_;
  Stats stats_;
  uint64_t pending_bytes_ = 0;
  uint64_t pooled_bytes_ = 0;  // of pending_bytes_, payload blocks': what max_pending_bytes bounds
  bool stopped_ = false;         // Shutdown began: no new consumer calls, no rings lent
  int inline_running_ = 0;       // consumer calls on the transport's thread under way
  std::condition_variable inline_cv_;
  std::condition_variable watch_cv_;  // wakes WatchStalls for Shutdown
  std::unordered_map<uint64_t, std::shared_ptr<LentRing>> rings_;  // by token
  std::vector<std::weak_ptr<LentRing>> retired_;  // taken back; count toward max_rings while held
  static bool Expired(const std::weak_ptr<LentRing>& r) { return r.expired(); }
  // Pieced blocks arriving, by sender connection and sequence number.
  absl::flat_hash_map<std::pair<const Endpoint*, uint64_t>, std::shared_ptr<Pieces>> pieces_;
  std::thread watcher_;  // WatchStalls, joined in Shutdown
  TaskQueue tasks_;      // last: joined first in the destructor
};

absl::StatusOr<std::unique_ptr<BlockReceiver>> BlockReceiver::Create(
    Transport* transport, BlockReceiverOptions options, BlockConsumer consumer) {
  if (transport == nullptr) return absl::InvalidArgumentError("BlockReceiver: null transport");
  if (!consumer) return absl::InvalidArgumentError("BlockReceiver: no consumer");
  if (absl::Status s = options.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("BlockReceiverOptions: ", s.message()));
  }
  auto impl = std::make_shared<Impl>(transport, options, std::move(consumer));
  InstallHandlers(transport, impl, Impl::Handlers());
  return std::unique_ptr<BlockReceiver>(new BlockReceiver(std::move(impl)));
}

BlockReceiver::~BlockReceiver() { impl_->Shutdown(); }

BlockReceiver::Stats BlockReceiver::stats() const { return impl_->stats(); }

std::string BlockReceiver::RenderMetrics() const { return impl_->RenderMetrics(); }

}  // namespace strata::transport
