// The block protocol's sending side: BlockSender and its Transfers, which ship blocks to a
// BlockReceiver (as payload, in pieces, or placed in a ring it lends) and retry, time out, cancel.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/metrics.h"
#include "transport/block_protocol.h"
#include "transport/internal/block_common.h"
#include "transport/internal/sender_ring.h"
#include "transport/internal/timer_queue.h"

namespace strata::transport {

using internal::HandlerList;
using internal::InstallHandlers;
using internal::SenderRing;
using internal::SendMessage;
using internal::SendRelease;
using internal::UninstallHandlers;

namespace {

// Streamed placement: progress published per chunk (the receiver gives up on a sender that has
// not advanced for BlockReceiverOptions::stall_timeout).
constexpr uint64_t kStreamChunk = 128 << 10;
// A sender refused a ring because the receiver lends all it may asks again after this long.
constexpr absl::Duration kAskAgainAfter = absl::Seconds(1);

// Orders the stores before it (memcpy's non-temporal ones included) before those after it, as
// seen from another process mapping the same memory.
void StoreFence() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#elif defined(__aarch64__)
  asm volatile("dmb ishst" ::: "memory");
#else
  __sync_synchronize();
#endif
}

}  // namespace

absl::Status BlockSenderOptions::Validate() const {
  if (max_bytes_in_flight == 0) {
    return absl::InvalidArgumentError("max_bytes_in_flight must be > 0");
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout must be positive");
  }
  if (piece_bytes != 0 && piece_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("piece_bytes must be 0 (never) or at least 4096, got ", piece_bytes));
  }
  if (reclaim_after < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reclaim_after must not be negative");
  }
  if (max_attempts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_attempts must be >= 1, got ", max_attempts));
  }
  if (retry_backoff < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("retry_backoff must not be negative");
  }
  return absl::OkStatus();
}

struct Transfer::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status = absl::UnknownError("transfer not complete");
  std::weak_ptr<BlockSender::Impl> sender;
  // Under the sender's mutex: the current attempt's sequence number, and whether Cancel was called.
  uint64_t seq = 0;
  bool cancelled = false;
};

class BlockSender::Impl : public std::enable_shared_from_this<BlockSender::Impl> {
  // A block on its way, over all its attempts.
  struct Job {
    std::shared_ptr<Endpoint> ep;
    std::string block_id;
    Payload payload;
    uint32_t crc32c = 0;
    absl::Time deadline;
    int attempt = 1;
    std::shared_ptr<Transfer::State> state;
    std::function<void(absl::Status)> done;
    absl::Status last;  // why the previous attempt failed
  };

 public:
  Impl(Transport* transport, BlockSenderOptions options)
      : transport_(transport),
        options_(options),
        watchdog_([this] { Watchdog(); }),
        retrier_([this] { Retrier(); }) {}

  static HandlerList<Impl> Handlers() {
    return {{kBlockAckMessage, &Impl::OnAck},
            {kBlockRingGrantMessage, &Impl::OnGrant},
            {kBlockRingReleaseMessage, &Impl::OnRelease}};
  }

  std::shared_ptr<Transfer> Send(const std::shared_ptr<Endpoint>& ep, absl::string_view block_id,
                                 Payload payload, const SendOptions& so,
                                 std::function<void(absl::Status)> done) {
    auto state = std::make_shared<Transfer::State>();
    state->sender = weak_from_this();
    // Attempt refuses these before it sends anything: do not read the payload for them.
    const bool refused = ep == nullptr || block_id.size() > kMaxBlockIdBytes;
    const uint64_t seq = Attempt(Job{
        .ep = ep,
        .block_id = std::string(block_id),
        .payload = payload,
        .crc32c = so.crc32c    ? *so.crc32c
                  : refused    ? 0
                               : Crc32c(payload.bytes.data(), payload.bytes.size()),
        .deadline = absl::Now() + so.timeout.value_or(options_.timeout),
        .state = state,
        .done = std::move(done),
        .last = absl::OkStatus()});
    return std::shared_ptr<Transfer>(new Transfer(state, seq));
  }

  // Sends a block (once: a retry is another attempt); returns the attempt's sequence number. A
  // later attempt does not wait for room in the peer's window: its transfer kept its room
  // (FinishLocked), so the retry thread never waits behind one peer's window.
  //
  // Its steps: under the lock, admit it to the peer's window (AdmitLocked), choose where it goes
  // (PlaceLocked) and register it as pending (RegisterLocked); then, without the lock, swap the
  // peer's ring if asked (SwapRings), copy a placed block (CopyBeforeHeader), post its messages
  // (PostMessages), stream a streamed block's bytes (StreamIntoRing), and hand the posted sends
  // to whatever outcome came meanwhile (EndPosting).
  uint64_t Attempt(Job job) {
    const uint64_t seq = next_seq_.fetch_add(1) + 1;
    const bool holds_room = job.attempt > 1;
    if (job.ep == nullptr) {
      return FailAttempt(seq, std::move(job), absl::InvalidArgumentError("Send: null endpoint"));
    }
    if (job.block_id.size() > kMaxBlockIdBytes) {
      const size_t n = job.block_id.size();
      return FailAttempt(seq, std::move(job),
                         absl::InvalidArgumentError(
                             absl::StrCat("block id of ", n, " bytes exceeds ", kMaxBlockIdBytes)));
    }
    const std::shared_ptr<Endpoint> ep = job.ep;
    Payload payload = job.payload;
    const uint64_t size = payload.bytes.size();
    const uint8_t* const src = payload.bytes.data();
    // What is left of the transfer's time (a later attempt's; the watchdog ends it at the
    // deadline).
    const absl::Duration timeout = std::max(job.deadline - absl::Now(), absl::Nanoseconds(1));
    Plan plan{.header = {.seq = seq, .size = size, .crc32c = job.crc32c, .block_id = job.block_id}};
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (absl::Status refused = AdmitLocked(seq, job, holds_room, timeout, lock); !refused.ok()) {
        lock.unlock();  // the caller's callback runs without the sender's lock
        return FailAttempt(seq, std::move(job), std::move(refused));
      }
      PlaceLocked(seq, ep, &plan);
      RegisterLocked(seq, std::move(job), holds_room, plan);
    }
    watchdog_cv_.notify_one();
    SwapRings(ep, plan);
    CopyBeforeHeader(plan, src, &payload);
    std::vector<uint64_t> tids;
    const uint64_t posted_to = PostMessages(seq, ep, plan.header, payload, timeout, &tids);
    if (plan.header.streamed) StreamIntoRing(seq, plan, src);
    EndPosting(seq, ep, plan.header, posted_to, tids);
    return seq;
  }

 private:
  // What an attempt decided under the lock, for what it does after.
  struct Plan {
    BlockDataHeader header;  // the block's header, placement and pieces included
    std::shared_ptr<SenderRing> ring = nullptr;  // where the block goes, if placed
    std::shared_ptr<SenderRing> ask = nullptr;   // a ring to ask the peer for
    std::shared_ptr<SenderRing> replaced =
        nullptr;  // a ring (or refusal) to forget: `ask` replaces it
  };

  // An attempt refused before anything was sent: the transfer completes with `why`.
  uint64_t FailAttempt(uint64_t seq, Job job, absl::Status why) {
    if (job.attempt > 1) {  // a first attempt that fails at once is not counted, as before
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.failed;
    }
    Complete(job.state, std::move(job.done), Attempted(why, job.attempt));
    return seq;
  }

  // Registers the attempt with its peer (the first with a peer installs its failure callback)
  // and waits, until the transfer's deadline, for room in the peer's window. Returns why the
  // attempt may not go (shut down, cancelled, the peer failed, no room in time, no time left),
  // having then given back what the transfer held; OK when it may.
  absl::Status AdmitLocked(uint64_t seq, const Job& job, bool holds_room, absl::Duration timeout,
                           std::unique_lock<std::mutex>& lock) {
    const std::shared_ptr<Endpoint>& ep = job.ep;
    const uint64_t size = job.payload.bytes.size();
    job.state->seq = seq;
    Peer& peer = peers_[ep.get()];
    const bool need_failure_callback = peer.ep == nullptr;
    if (need_failure_callback) peer.ep = ep;
    ++peer.users;  // keeps the entry while this call waits
    const auto room = [&] {
      return holds_room || shutting_down_ || job.state->cancelled || !peer.failed.ok() ||
             peer.in_flight == 0 || peer.in_flight + size <= options_.max_bytes_in_flight;
    };
    if (need_failure_callback) {
      lock.unlock();
      const uint64_t handle =
          ep->OnFailure([weak = weak_from_this(), key = ep.get()](const absl::Status& s) {
            if (auto self = weak.lock()) self->PeerFailed(key, s);
          });
      lock.lock();
      peer.failure_handle = handle;
    }
    while (!room()) {
      if (window_cv_.wait_until(lock, absl::ToChronoTime(job.deadline)) ==
              std::cv_status::timeout &&
          !room()) {
        break;
      }
    }
    absl::Status refuse;
    if (shutting_down_) {
      refuse = absl::CancelledError("block sender shut down");
    } else if (job.state->cancelled) {
      refuse = absl::CancelledError(absl::StrCat("block transfer ", seq, " cancelled"));
    } else if (!peer.failed.ok()) {
      refuse = absl::UnavailableError(peer.failed.message());
    } else if (!room()) {
      refuse = absl::DeadlineExceededError(absl::StrCat(
          "block transfer ", seq, ": the peer's window (", options_.max_bytes_in_flight,
          " bytes in flight) did not open within ", absl::FormatDuration(timeout)));
    } else if (holds_room && job.deadline <= absl::Now()) {
      refuse = absl::DeadlineExceededError(absl::StrCat(
          "block transfer ", seq, ": no time left to send again after: ", job.last.message()));
    }
    --peer.users;
    if (!refuse.ok()) {
      if (holds_room) {
        ReleaseRoomLocked(ep.get(), size, lock);
      } else {
        MaybeDropPeerLocked(ep.get(), lock);
      }
    }
    return refuse;
  }

  // Where the block goes: placed in the peer's ring when the transport maps peer memory, the
  // block is large enough and the ring has room (the ring is renewed when only space presumed
  // lost keeps the block out; a ring is asked for where there is none, or a refusal has expired);
  // else as payload, in pieces when larger than a piece.
  void PlaceLocked(uint64_t seq, const std::shared_ptr<Endpoint>& ep, Plan* plan) {
    BlockDataHeader& h = plan->header;
    const uint64_t size = h.size;
    const bool may_place = options_.placement_min_bytes > 0 &&
                           size >= options_.placement_min_bytes &&
                           transport_->capabilities().maps_peer_memory;
    if (may_place) {
      std::shared_ptr<SenderRing>& r = rings_by_ep_[ep.get()];
      if (r != nullptr && r->ep.lock() != ep) {  // an earlier endpoint's, at the same address
        rings_.erase(r->token);
        r = nullptr;
      }
      if (r != nullptr && r->state == SenderRing::State::kRefused &&
          absl::Now() >= r->ask_again) {  // refused for now: ask again
        plan->replaced = std::move(r);
        rings_.erase(plan->replaced->token);
      }
      if (r != nullptr && r->state == SenderRing::State::kReady) {
        if (std::optional<uint64_t> at = r->Allocate(size, seq)) {
          h.placed = RingPlace{.token = r->token, .offset = *at};
          h.streamed = options_.stream_min_bytes > 0 && size >= options_.stream_min_bytes;
          if (h.streamed) r->CopyStarted(*at);  // copied after the header
          ++r->unsettled;
          plan->ring = r;
        } else if (r->unsettled == 0 &&
                   r->FitsIfReclaimed(size, absl::Now() - options_.reclaim_after)) {
          // What keeps this block out is space presumed lost (doubtful, sender_ring.h): return
          // the ring and ask for a new one. (The receiver keeps the old one's memory while
          // blocks in it are used, and refuses headers that name it.)
          plan->replaced = std::move(r);
          rings_.erase(plan->replaced->token);
          ++stats_.rings_renewed;
        }
      }
      if (r == nullptr) {
        r = std::make_shared<SenderRing>();
        r->token = NewTokenLocked();
        r->ep = ep;
        rings_[r->token] = r;
        plan->ask = r;
      }
    }
    // A block going as payload and larger than a piece goes in pieces: the header with the
    // first, then the rest in order (each its own message, checked by the receiver as it lands).
    h.pieced = plan->ring == nullptr && options_.piece_bytes > 0 && size > options_.piece_bytes;
  }

  // The attempt is pending: its bytes in the peer's window (a later attempt's already are), its
  // deadline with the watchdog.
  void RegisterLocked(uint64_t seq, Job job, bool holds_room, const Plan& plan) {
    const uint64_t size = plan.header.size;
    Peer& peer = peers_[job.ep.get()];
    if (!holds_room) {
      peer.in_flight += size;
      ++peer.pending;
    }
    stats_.max_bytes_in_flight = std::max(stats_.max_bytes_in_flight, peer.in_flight);
    const absl::Time deadline = job.deadline;
    Pending& p = pending_[seq];
    p.size = size;
    p.placed = plan.ring != nullptr;
    if (p.placed) p.place = *plan.header.placed;
    p.copying = plan.header.streamed;
    p.pieced = plan.header.pieced;
    p.job = std::move(job);
    p.start = absl::Now();
    deadlines_.Add(deadline, seq);
  }

  // Forgets the ring (or refusal) the attempt replaced, giving a lent one back, and asks for the
  // new one.
  void SwapRings(const std::shared_ptr<Endpoint>& ep, const Plan& plan) {
    if (plan.replaced != nullptr) {
      ep->RemoveFailureCallback(plan.replaced->failure_handle);
      if (plan.replaced->state == SenderRing::State::kReady) {
        SendRelease(ep, kBlockRingReturnMessage, {.token = plan.replaced->token, .drop = true});
      }
    }
    if (plan.ask != nullptr) AskForRing(ep, plan.ask);
  }

  // The one copy of a placed block goes straight into the receiver's memory (mapped while we hold
  // the endpoint): all of it before the header; a streamed one after it (StreamIntoRing), its
  // progress word zeroed here. The messages then carry no payload.
  static void CopyBeforeHeader(const Plan& plan, const uint8_t* src, Payload* payload) {
    if (plan.ring == nullptr) return;
    *payload = {};
    uint8_t* place = plan.ring->mem.data() + plan.header.placed->offset;
    if (plan.header.streamed) {
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(place - kPlacedPrefixBytes))
          .store(0, std::memory_order_release);
    } else {
      std::memcpy(place, src, plan.header.size);
      StoreFence();
    }
  }

  // Posts the header (with the payload, or its first piece) and a pieced block's further pieces,
  // until the outcome is known; returns where posting stopped (the size when all went). `tids`
  // gets the backend's ids of the sends.
  uint64_t PostMessages(uint64_t seq, const std::shared_ptr<Endpoint>& ep, const BlockDataHeader& h,
                        const Payload& payload, absl::Duration timeout,
                        std::vector<uint64_t>* tids) {
    auto post = [&](uint16_t id, const std::string& header, Payload part) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++pending_.at(seq).sends_left;  // (the entry stays while `posting`)
      }
      tids->push_back(ep->Send(
          id,
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()), header.size()),
          part, timeout, [weak = weak_from_this(), seq](absl::Status s) {
            if (auto self = weak.lock()) self->SendDone(seq, std::move(s));
          }));
    };
    auto piece = [&](uint64_t at, uint64_t n) {
      return Payload{.bytes = payload.bytes.subspan(at, n), .region = payload.region};
    };
    post(kBlockDataMessage, EncodeBlockDataHeader(h),
         h.pieced ? piece(0, options_.piece_bytes) : payload);
    if (!h.pieced) return h.size;
    uint64_t posted_to = options_.piece_bytes;
    for (; posted_to < h.size && !OutcomeKnown(seq); posted_to += options_.piece_bytes) {
      post(kBlockPieceMessage, EncodeBlockPieceHeader({.seq = seq, .offset = posted_to}),
           piece(posted_to, std::min(options_.piece_bytes, h.size - posted_to)));
    }
    return posted_to;
  }

  // A streamed block's bytes, chunk by chunk behind the progress word. The transfer cannot
  // complete, nor its space come back, until this copy has stopped (`copying`): the caller's
  // payload and the ring stay untouched after completion. An outcome arriving meanwhile (the
  // receiver gave up, cancel, timeout) stops it early.
  void StreamIntoRing(uint64_t seq, const Plan& plan, const uint8_t* src) {
    const uint64_t size = plan.header.size;
    uint8_t* place = plan.ring->mem.data() + plan.header.placed->offset;
    std::atomic_ref<uint64_t> progress(*reinterpret_cast<uint64_t*>(place - kPlacedPrefixBytes));
    for (uint64_t done = 0; done < size;) {
      const uint64_t n = std::min<uint64_t>(kStreamChunk, size - done);
      std::memcpy(place + done, src + done, n);
      done += n;
      StoreFence();
      progress.store(done, std::memory_order_release);
      if (done < size && OutcomeKnown(seq)) break;
    }
    CopyDone(seq, plan.ring, plan.header.placed->offset);
  }

  // Posting is over: the sends' ids go to the pending entry, and an outcome that came meanwhile
  // finishes the transfer (cancelling its sends if it was cancelled or timed out while they were
  // under way). Posting stopped early (failed, cancelled, timed out: the rest stays here) or what
  // was posted is being cancelled: the receiver lets a pieced block go.
  void EndPosting(uint64_t seq, const std::shared_ptr<Endpoint>& ep, const BlockDataHeader& h,
                  uint64_t posted_to, const std::vector<uint64_t>& tids) {
    bool cancel = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = pending_.find(seq);
      if (it != pending_.end()) {
        it->second.backend_ids = tids;
        it->second.posting = false;
        cancel = it->second.cancel_requested && it->second.sends_left > 0;
        if (it->second.outcome.has_value()) FinishLocked(it, lock);
      }
    }
    if (cancel) {
      for (uint64_t tid : tids) ep->Cancel(tid);
    }
    if (h.pieced && (posted_to < h.size || cancel)) Abandon(ep, seq, posted_to);
  }

 public:
  // Transfer::Cancel: the current attempt, or the transfer waiting for its next one.
  void Cancel(Transfer::State& state) {
    uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      state.cancelled = true;  // (an attempt starting now, or waiting for room, sees it)
      seq = state.seq;
    }
    window_cv_.notify_all();
    Abort(seq, absl::CancelledError(absl::StrCat("block transfer ", seq, " cancelled")));
  }

  // Sets the outcome of `seq` if it has none (cancel, timeout), or completes the transfer that
  // waits to be sent again after it.
  void Abort(uint64_t seq, absl::Status why) {
    std::shared_ptr<Endpoint> ep;
    std::vector<uint64_t> tids;
    bool pieced = false;
    uint64_t size = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = pending_.find(seq);
      if (it == pending_.end()) {
        auto q = queued_.find(seq);
        if (q == queued_.end()) return;
        Job job = std::move(q->second);
        queued_.erase(q);
        ++stats_.failed;
        ReleaseRoomLocked(job.ep.get(), job.payload.bytes.size(), lock);
        lock.unlock();
        Complete(job.state, std::move(job.done), Attempted(why, job.attempt));
        return;
      }
      if (it->second.outcome.has_value()) return;
      it->second.outcome = std::move(why);
      it->second.cancel_requested = true;
      if (it->second.sends_done()) {
        FinishLocked(it, lock);
        return;
      }
      if (!it->second.posting) {
        ep = it->second.job.ep;
        tids = it->second.backend_ids;
        pieced = it->second.pieced;
        size = it->second.size;
      }
    }
    // The backend completes the sends (cancelling a finished one does nothing); SendDone finishes.
    for (uint64_t tid : tids) ep->Cancel(tid);
    // A backend may drop a cancelled piece without a word (inproc does): the receiver would wait
    // for it until the connection goes.
    if (pieced) Abandon(ep, seq, size);
  }

  void OnAck(IncomingMessage& m) {
    absl::StatusOr<BlockAckHeader> h = DecodeBlockAckHeader(m.header());
    if (!h.ok()) return;  // a peer speaking garbage: the transfer times out
    std::unique_lock<std::mutex> lock(mu_);
    if (h->released) FreeRingSpaceLocked(h->released->token, {h->released->offset});
    auto it = pending_.find(h->seq);
    if (it != pending_.end()) it->second.answered = true;
    if (it == pending_.end() || it->second.outcome.has_value()) {
      ++stats_.late_acks;
      return;
    }
    it->second.outcome = std::move(h->status);
    it->second.retryable = h->retryable;
    FinishLocked(it, lock);
  }

  // The receiver lends a ring (map it) or refuses (send blocks as payload to that peer).
  void OnGrant(IncomingMessage& m) {
    absl::StatusOr<RingGrant> g = DecodeRingGrant(m.header());
    if (!g.ok()) return;
    std::shared_ptr<SenderRing> ring;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = rings_.find(g->token);
      if (it != rings_.end() && it->second->state == SenderRing::State::kRequested) {
        ring = it->second;
      }
    }
    std::shared_ptr<Endpoint> ep = ring != nullptr ? ring->ep.lock() : nullptr;
    if (ep == nullptr) {  // not asked for (any more): give it back
      if (g->code == absl::StatusCode::kOk) {
        SendRelease(m.endpoint(), kBlockRingReturnMessage, {.token = g->token, .drop = true});
      }
      return;
    }
    absl::StatusOr<std::span<uint8_t>> mem = absl::UnavailableError("refused");
    if (g->code == absl::StatusCode::kOk) mem = ep->Map(g->descriptor);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (mem.ok() && !shutting_down_) {
        ring->Lend(*mem);
        return;
      }
      // The entry stays: not asked again, or, where the receiver lends all the rings it may
      // (they free as their blocks go), not before kAskAgainAfter.
      ring->state = SenderRing::State::kRefused;
      if (g->code == absl::StatusCode::kResourceExhausted) {
        ring->ask_again = absl::Now() + kAskAgainAfter;
      }
    }
    if (g->code == absl::StatusCode::kOk) {  // lent but not mappable (another host): return it
      SendRelease(ep, kBlockRingReturnMessage, {.token = g->token, .drop = true});
    }
  }

  // Ring space the receiver is done with, or the whole ring taken back.
  void OnRelease(IncomingMessage& m) {
    absl::StatusOr<RingRelease> r = DecodeRingRelease(m.header());
    if (!r.ok()) return;
    std::shared_ptr<SenderRing> dropped;
    uint64_t handle = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!r->drop) {
        FreeRingSpaceLocked(r->token, r->offsets);
        return;
      }
      dropped = DropRingLocked(r->token);
      if (dropped == nullptr) return;
      handle = dropped->failure_handle;
    }
    if (std::shared_ptr<Endpoint> ep = dropped->ep.lock()) ep->RemoveFailureCallback(handle);
  }

  void Shutdown() {
    UninstallHandlers(transport_, Handlers());
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutting_down_ = true;
    }
    window_cv_.notify_all();
    retry_cv_.notify_all();
    retrier_.join();  // no attempt starts after this
    std::map<uint64_t, Job> queued;
    {
      std::unique_lock<std::mutex> lock(mu_);
      queued.swap(queued_);
      stats_.failed += queued.size();
      for (auto& [seq, job] : queued) {
        ReleaseRoomLocked(job.ep.get(), job.payload.bytes.size(), lock);
      }
    }
    for (auto& [seq, job] : queued) {
      Complete(job.state, std::move(job.done),
               Attempted(absl::CancelledError("block sender shut down"), job.attempt));
    }
    std::vector<uint64_t> seqs;
    struct Returning {
      std::weak_ptr<Endpoint> ep;
      uint64_t token, failure_handle;
      bool lent;
    };
    std::vector<Returning> rings;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutting_down_ = true;
      for (const auto& [seq, p] : pending_) seqs.push_back(seq);
      for (const auto& [token, ring] : rings_) {
        rings.push_back({ring->ep, token, ring->failure_handle,
                         ring->state != SenderRing::State::kRefused});
      }
      rings_.clear();
      rings_by_ep_.clear();
    }
    for (const Returning& r : rings) {  // give the rings back
      std::shared_ptr<Endpoint> ep = r.ep.lock();
      if (ep == nullptr) continue;
      ep->RemoveFailureCallback(r.failure_handle);
      if (r.lent) SendRelease(ep, kBlockRingReturnMessage, {.token = r.token, .drop = true});
    }
    window_cv_.notify_all();
    for (uint64_t seq : seqs) Abort(seq, absl::CancelledError("block sender shut down"));
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait(lock, [&] { return pending_.empty(); });
      stop_watchdog_ = true;
    }
    watchdog_cv_.notify_all();
    watchdog_.join();
  }

  BlockSender::Stats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    Stats st = stats_;
    for (const auto& [token, ring] : rings_) st.rings += ring->state == SenderRing::State::kReady;
    return st;
  }

  std::string RenderMetrics() const {
    const Stats st = stats();
    std::string out;
    const std::pair<const char*, uint64_t> counters[] = {
        {"blocks", st.sent}, {"bytes", st.bytes}, {"failures", st.failed},
        {"late_acks", st.late_acks}, {"placed_blocks", st.placed}, {"retries", st.retries},
        {"rings_renewed", st.rings_renewed}};
    for (const auto& [name, v] : counters) {
      RenderMetric(absl::StrCat("strata_transport_sent_", name, "_total"), "counter",
                   absl::StrCat("block sender: ", name), static_cast<double>(v), &out);
    }
    RenderMetric("strata_transport_sent_max_bytes_in_flight", "gauge",
                 "most unacknowledged bytes to one peer at once",
                 static_cast<double>(st.max_bytes_in_flight), &out);
    latency_.Render("strata_transport_block_transfer_seconds", "", true,
                    "Send to acknowledgement, successful transfers", &out);
    return out;
  }

 private:
  struct Peer {
    std::shared_ptr<Endpoint> ep;
    uint64_t in_flight = 0;
    size_t pending = 0;
    size_t users = 0;
    uint64_t failure_handle = 0;
    absl::Status failed;
  };
  struct Pending {
    Job job;  // the transfer (its caller's state and callback; all another attempt needs)
    uint64_t size = 0;
    bool placed = false;
    RingPlace place;        // where, if placed
    bool answered = false;  // the receiver's ack came (in time or not)
    absl::Time start;
    std::vector<uint64_t> backend_ids;  // the block's messages (header, pieces), once posted
    bool copying = false;  // a streamed block still being copied into the ring
    bool pieced = false;   // sent in pieces
    bool posting = true;   // Send is still posting its messages
    uint32_t sends_left = 0;  // messages posted whose sends have not completed
    bool sends_done() const { return !posting && sends_left == 0; }
    std::optional<absl::Status> outcome;  // the ack's status, or why it was given up
    bool retryable = false;               // the ack says sending again may succeed
    bool cancel_requested = false;        // Abort: the backend's send must be stopped
  };
  using PendingMap = std::unordered_map<uint64_t, Pending>;

  // Tells the receiver that a pieced block's pieces from `at` on will not come.
  static void Abandon(const std::shared_ptr<Endpoint>& ep, uint64_t seq, uint64_t at) {
    SendMessage(ep, kBlockPieceMessage,
                EncodeBlockPieceHeader({.seq = seq, .offset = at, .abandoned = true}),
                [](absl::Status) {});
  }

  bool OutcomeKnown(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(seq);
    return it == pending_.end() || it->second.outcome.has_value();
  }

  // A streamed block's copy has stopped: its space may come back, the transfer may complete.
  void CopyDone(uint64_t seq, const std::shared_ptr<SenderRing>& ring, uint64_t offset) {
    std::unique_lock<std::mutex> lock(mu_);
    ring->CopyStopped(offset);
    auto it = pending_.find(seq);
    if (it == pending_.end()) return;
    it->second.copying = false;
    if (it->second.outcome.has_value()) FinishLocked(it, lock);
  }


  void SendDone(uint64_t seq, absl::Status s) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(seq);
    if (it == pending_.end()) return;
    --it->second.sends_left;
    if (!s.ok() && !it->second.outcome.has_value()) {
      it->second.outcome = s.code() == absl::StatusCode::kCancelled ||
                                   s.code() == absl::StatusCode::kDeadlineExceeded ||
                                   s.code() == absl::StatusCode::kInvalidArgument
                               ? s
                               : absl::UnavailableError(s.message());
    }
    if (it->second.outcome.has_value()) FinishLocked(it, lock);
  }

  void PeerFailed(Endpoint* key, const absl::Status& s) {
    std::unique_lock<std::mutex> lock(mu_);
    auto peer = peers_.find(key);
    if (peer == peers_.end()) return;
    const absl::Status failed = peer->second.failed = absl::UnavailableError(
        absl::StrCat("peer ", peer->second.ep->peer(), " failed: ", s.message()));
    window_cv_.notify_all();
    std::vector<uint64_t> finished;
    for (auto& [seq, p] : pending_) {
      if (p.job.ep.get() != key || p.outcome.has_value()) continue;
      p.outcome = failed;
      if (p.sends_done()) finished.push_back(seq);
    }
    // Transfers waiting to be sent again to this peer fail now, not at their next attempt.
    std::vector<Job> waiting;
    for (auto q = queued_.begin(); q != queued_.end();) {
      if (q->second.ep.get() != key) {
        ++q;
        continue;
      }
      waiting.push_back(std::move(q->second));
      q = queued_.erase(q);
      ++stats_.failed;
    }
    for (uint64_t seq : finished) {
      auto it = pending_.find(seq);
      if (it != pending_.end()) FinishLocked(it, lock);  // relocks; iterators refetched
    }
    for (const Job& job : waiting) ReleaseRoomLocked(key, job.payload.bytes.size(), lock);
    lock.unlock();
    for (Job& job : waiting) {
      Complete(job.state, std::move(job.done),
               absl::UnavailableError(absl::StrCat(failed.message(),
                                                   " (while the block waited to be sent again "
                                                   "after: ",
                                                   job.last.message(), ")")));
    }
  }

  // Completes a pending transfer whose outcome is known once its sends are done and its copy
  // has stopped (else SendDone, Send or CopyDone calls again). Unlocks around the user's
  // callback and relocks.
  void FinishLocked(PendingMap::iterator it, std::unique_lock<std::mutex>& lock) {
    if (it->second.copying || !it->second.sends_done()) return;
    const uint64_t seq = it->first;
    Pending p = std::move(it->second);
    pending_.erase(it);
    deadlines_.Remove(p.job.deadline, seq);
    if (p.placed) {
      if (auto r = rings_.find(p.place.token); r != rings_.end()) {
        SenderRing& ring = *r->second;
        --ring.unsettled;
        if (!p.answered) ring.Unanswered(p.place.offset, seq, absl::Now());
      }
    }
    const absl::Status status = *p.outcome;
    // The receiver refused it only for now, and there is time for another attempt: it waits in
    // queued_ (the retry thread sends it again).
    const absl::Time again =
        absl::Now() + options_.retry_backoff * (int64_t{1} << std::min(p.job.attempt - 1, 20));
    const auto peer = peers_.find(p.job.ep.get());
    const bool retry = !status.ok() && p.retryable && p.job.attempt < options_.max_attempts &&
                       !shutting_down_ && !p.job.state->cancelled && again < p.job.deadline &&
                       (peer == peers_.end() || peer->second.failed.ok());  // (failed: no use)
    const int attempt = p.job.attempt;
    const std::shared_ptr<Endpoint> ep = p.job.ep;
    if (retry) {
      Job& queued = queued_[seq] = std::move(p.job);
      queued.last = status;
      retry_times_.Add(again, seq);
      retry_cv_.notify_one();
    } else if (status.ok()) {
      ++stats_.sent;
      stats_.bytes += p.size;
      if (p.placed) ++stats_.placed;
      latency_.Record(absl::ToDoubleSeconds(absl::Now() - p.start));
    } else {
      ++stats_.failed;
    }
    // A transfer to be sent again keeps its room in the window: its next attempt need not wait
    // for room (nor the retry thread with it), and a receiver that refused it for want of room
    // thereby slows its sender.
    if (!retry) ReleaseRoomLocked(ep.get(), p.size, lock);
    if (pending_.empty()) idle_cv_.notify_all();
    if (retry) return;
    lock.unlock();
    Complete(p.job.state, std::move(p.job.done), Attempted(status, attempt));
    lock.lock();
  }

  // A failure of a transfer's later attempt says which it was.
  static absl::Status Attempted(const absl::Status& s, int attempt) {
    if (s.ok() || attempt == 1) return s;
    return absl::Status(s.code(), absl::StrCat(s.message(), " (attempt ", attempt, ")"));
  }

  // The retry thread: sends queued transfers again when their time comes. A damaged block is
  // first checked against the CRC-32C it was sent with: bytes that no longer match it (a wrong
  // SendOptions::crc32c, a buffer changed after Send) would only be damaged again.
  void Retrier() {
    const auto queued = [this](uint64_t seq) { return queued_.contains(seq); };  // not cancelled
    std::unique_lock<std::mutex> lock(mu_);
    while (!shutting_down_) {
      const std::optional<uint64_t> seq = retry_times_.TakeDue(queued, retry_cv_, lock);
      if (!seq.has_value()) continue;
      auto q = queued_.find(*seq);
      Job job = std::move(q->second);
      queued_.erase(q);
      lock.unlock();
      const Payload& pl = job.payload;
      if (job.last.code() == absl::StatusCode::kDataLoss &&
          (pl.region == nullptr || pl.region->kind() == MemoryKind::kHost) &&
          Crc32c(pl.bytes.data(), pl.bytes.size()) != job.crc32c) {
        {
          std::unique_lock<std::mutex> relock(mu_);
          ++stats_.failed;
          ReleaseRoomLocked(job.ep.get(), pl.bytes.size(), relock);
        }
        Complete(job.state, std::move(job.done),
                 Attempted(absl::DataLossError(absl::StrCat(
                               job.last.message(),
                               "; not sent again: the sender's bytes do not match that CRC-32C "
                               "either (a wrong SendOptions::crc32c, or bytes changed after Send)")),
                           job.attempt));
      } else {
        {
          std::lock_guard<std::mutex> relock(mu_);
          ++stats_.retries;
        }
        ++job.attempt;
        Attempt(std::move(job));
      }
      lock.lock();
    }
  }

  // A transfer (pending or queued) is over: its bytes leave the peer's window. Senders blocked on
  // a full window are woken when it has drained to half (or is empty), not on every ack: one
  // wake-up per half window instead of two context switches per block.
  void ReleaseRoomLocked(Endpoint* key, uint64_t size, std::unique_lock<std::mutex>& lock) {
    auto peer = peers_.find(key);
    bool wake = true;
    if (peer != peers_.end()) {
      const uint64_t half = options_.max_bytes_in_flight / 2;
      const uint64_t before = peer->second.in_flight;
      peer->second.in_flight -= size;
      wake = peer->second.in_flight == 0 || (before > half && peer->second.in_flight <= half);
      --peer->second.pending;
      MaybeDropPeerLocked(key, lock);
    }
    if (wake) window_cv_.notify_all();
  }

  // Forgets a peer with nothing pending (and nobody waiting on its window), so that endpoints are
  // not kept alive by the sender. Unlocks around RemoveFailureCallback.
  void MaybeDropPeerLocked(Endpoint* key, std::unique_lock<std::mutex>& lock) {
    auto peer = peers_.find(key);
    if (peer == peers_.end() || peer->second.pending != 0 || peer->second.users != 0) return;
    std::shared_ptr<Endpoint> ep = std::move(peer->second.ep);
    const uint64_t handle = peer->second.failure_handle;
    peers_.erase(peer);
    lock.unlock();
    ep->RemoveFailureCallback(handle);
    lock.lock();
  }

  static void Complete(const std::shared_ptr<Transfer::State>& state,
                       std::function<void(absl::Status)> done, absl::Status status) {
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->done = true;
      state->status = status;
    }
    state->cv.notify_all();
    if (done) done(std::move(status));
  }

  uint64_t NewTokenLocked() {
    if (token_base_ == 0) token_base_ = (uint64_t{std::random_device{}()} << 32) | 1;
    return token_base_ + (++tokens_made_ << 1);
  }

  // Asks the peer for a ring (the answer comes to OnGrant); the ring goes when the peer fails.
  void AskForRing(const std::shared_ptr<Endpoint>& ep, const std::shared_ptr<SenderRing>& ring) {
    const uint64_t handle =
        ep->OnFailure([weak = weak_from_this(), token = ring->token](const absl::Status&) {
          if (auto self = weak.lock()) {
            std::lock_guard<std::mutex> lock(self->mu_);
            self->DropRingLocked(token);
          }
        });
    {
      std::lock_guard<std::mutex> lock(mu_);
      ring->failure_handle = handle;
    }
    SendMessage(ep, kBlockRingRequestMessage, EncodeRingRequest({.token = ring->token}),
                [weak = weak_from_this(), token = ring->token](absl::Status s) {
                  if (s.ok()) return;
                  if (auto self = weak.lock()) {  // not delivered: no placement to this peer
                    std::lock_guard<std::mutex> lock(self->mu_);
                    if (auto it = self->rings_.find(token); it != self->rings_.end()) {
                      it->second->state = SenderRing::State::kRefused;
                    }
                  }
                });
  }

  // Forgets a ring: blocks to that peer go as payload until a new one is lent. (Its mapping
  // stays valid for a Send still copying into it: that copy's header is refused by the receiver.)
  std::shared_ptr<SenderRing> DropRingLocked(uint64_t token) {
    auto it = rings_.find(token);
    if (it == rings_.end()) return nullptr;
    std::shared_ptr<SenderRing> ring = std::move(it->second);
    rings_.erase(it);
    for (auto e = rings_by_ep_.begin(); e != rings_by_ep_.end(); ++e) {
      if (e->second == ring) {
        rings_by_ep_.erase(e);
        break;
      }
    }
    return ring;
  }

  void FreeRingSpaceLocked(uint64_t token, const std::vector<uint64_t>& offsets) {
    auto it = rings_.find(token);
    if (it == rings_.end()) return;
    for (uint64_t at : offsets) it->second->Release(at);
  }

  // Fires the deadlines of transfers not finished by then.
  void Watchdog() {
    const auto unfinished = [this](uint64_t seq) {
      auto it = pending_.find(seq);
      return it != pending_.end() && !it->second.outcome.has_value();
    };
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_watchdog_) {
      const std::optional<uint64_t> seq = deadlines_.TakeDue(unfinished, watchdog_cv_, lock);
      if (!seq.has_value()) continue;
      lock.unlock();
      Abort(*seq, absl::DeadlineExceededError(absl::StrCat(
                      "block transfer ", *seq, " not acknowledged within its timeout")));
      lock.lock();
    }
  }

  // Set at construction.
  Transport* transport_;
  const BlockSenderOptions options_;
  std::atomic<uint64_t> next_seq_{0};  // the last attempt's sequence number
  LatencyHistogram latency_;           // thread-safe itself

  // mu_ guards everything below it but the threads. It is never held while the sender calls out:
  // the caller's callbacks (Complete), the endpoint's OnFailure and RemoveFailureCallback, and
  // sends (the backend may call SendDone on the calling thread).
  mutable std::mutex mu_;
  // Transfers: an attempt in progress (posted, or being posted) by its sequence number, and the
  // deadlines of those not finished (the watchdog's); transfers waiting to be sent again, by
  // their failed attempt's number, and when (the retry thread's; entries of cancelled ones linger).
  PendingMap pending_;
  internal::TimerQueue deadlines_;
  std::map<uint64_t, Job> queued_;
  internal::TimerQueue retry_times_;
  // Peers: each one's window (bytes in flight) and failure; the rings they lent, by token and by
  // endpoint, and the tokens' source.
  std::unordered_map<Endpoint*, Peer> peers_;
  std::unordered_map<uint64_t, std::shared_ptr<SenderRing>> rings_;
  std::unordered_map<Endpoint*, std::shared_ptr<SenderRing>> rings_by_ep_;
  uint64_t token_base_ = 0;
  uint64_t tokens_made_ = 0;
  Stats stats_;
  bool shutting_down_ = false;
  bool stop_watchdog_ = false;
  // Waits under mu_: for room in a peer's window (Attempt), for no transfer pending (Shutdown),
  // for the next deadline (Watchdog) and the next retry (Retrier).
  std::condition_variable window_cv_;
  std::condition_variable idle_cv_;
  std::condition_variable watchdog_cv_;
  std::condition_variable retry_cv_;

  std::thread watchdog_;  // last: started after the members they use
  std::thread retrier_;
};

absl::Status Transfer::Wait() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool Transfer::WaitFor(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                             [&] { return state_->done; });
}

bool Transfer::done() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

absl::Status Transfer::status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

void Transfer::Cancel() {
  if (auto sender = state_->sender.lock()) sender->Cancel(*state_);
}

absl::StatusOr<std::unique_ptr<BlockSender>> BlockSender::Create(Transport* transport,
                                                                 BlockSenderOptions options) {
  if (transport == nullptr) return absl::InvalidArgumentError("BlockSender: null transport");
  if (absl::Status s = options.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("BlockSenderOptions: ", s.message()));
  }
  auto impl = std::make_shared<Impl>(transport, options);
  InstallHandlers(transport, impl, Impl::Handlers());
  return std::unique_ptr<BlockSender>(new BlockSender(std::move(impl)));
}

BlockSender::~BlockSender() { impl_->Shutdown(); }

std::shared_ptr<Transfer> BlockSender::Send(const std::shared_ptr<Endpoint>& peer,
                                            absl::string_view block_id, Payload payload,
                                            SendOptions options,
                                            std::function<void(absl::Status)> done) {
  return impl_->Send(peer, block_id, payload, options, std::move(done));
}

BlockSender::Stats BlockSender::stats() const { return impl_->stats(); }

std::string BlockSender::RenderMetrics() const { return impl_->RenderMetrics(); }

}  // namespace strata::transport
