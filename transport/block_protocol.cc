#include "transport/block_protocol.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "common/aligned_buffer.h"
#include "common/buffer_pool.h"
#include "common/crc32c.h"
#include "common/metrics.h"
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
// Streamed placement: progress published per chunk (the receiver gives up on a sender that has
// not advanced for BlockReceiverOptions::stall_timeout).
constexpr uint64_t kStreamChunk = 128 << 10;
// A sender refused a ring because the receiver lends all it may asks again after this long.
constexpr absl::Duration kAskAgainAfter = absl::Seconds(1);
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

void SpinPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

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

// ---- receiver -----------------------------------------------------------------------------------

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

namespace {

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

// A few threads running queued tasks in order of arrival.
class TaskThreads {
 public:
  explicit TaskThreads(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~TaskThreads() { Stop(); }

  // False once stopped (the task is not run).
  bool Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return false;
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
    return true;
  }

  // Runs what is queued, then joins.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// A protocol side's message handlers: installed from one list and uninstalled from the same.
template <typename Impl>
using HandlerList = std::vector<std::pair<uint16_t, void (Impl::*)(IncomingMessage&)>>;

template <typename Impl>
void InstallHandlers(Transport* transport, const std::shared_ptr<Impl>& impl,
                     const HandlerList<Impl>& handlers) {
  for (const auto& [id, method] : handlers) {
    transport->SetHandler(id, [weak = std::weak_ptr<Impl>(impl), method](IncomingMessage& m) {
      if (auto self = weak.lock()) ((*self).*method)(m);
    });
  }
}

template <typename Impl>
void UninstallHandlers(Transport* transport, const HandlerList<Impl>& handlers) {
  for (const auto& [id, method] : handlers) transport->SetHandler(id, nullptr);
}

template <typename Fn>
void SendMessage(const std::shared_ptr<Endpoint>& ep, uint16_t id, const std::string& h,
                 Fn done) {
  ep->Send(id, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()),
           {}, absl::Seconds(30), std::move(done));
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

void SendRelease(const std::shared_ptr<Endpoint>& ep, uint16_t id, RingRelease r) {
  if (ep == nullptr) return;
  SendMessage(ep, id, EncodeRingRelease(r), [](absl::Status) {});
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
  TaskThreads tasks_;    // last: joined first in the destructor
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

// ---- sender -------------------------------------------------------------------------------------

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
  uint64_t Attempt(Job job) {
    const uint64_t seq = next_seq_.fetch_add(1) + 1;
    const bool holds_room = job.attempt > 1;
    const std::shared_ptr<Endpoint> ep = job.ep;
    const absl::Time deadline = job.deadline;
    // What is left of the transfer's time (a later attempt's; the watchdog ends it at the deadline).
    const absl::Duration timeout = std::max(deadline - absl::Now(), absl::Nanoseconds(1));
    auto fail_now = [&](absl::Status s) {  // (called without mu_)
      if (job.attempt > 1) {  // a first attempt that fails at once is not counted, as before
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.failed;
      }
      Complete(job.state, std::move(job.done), Attempted(s, job.attempt));
      return seq;
    };
    if (ep == nullptr) return fail_now(absl::InvalidArgumentError("Send: null endpoint"));
    if (job.block_id.size() > kMaxBlockIdBytes) {
      return fail_now(absl::InvalidArgumentError(absl::StrCat(
          "block id of ", job.block_id.size(), " bytes exceeds ", kMaxBlockIdBytes)));
    }
    Payload payload = job.payload;
    const uint64_t size = payload.bytes.size();
    const uint8_t* const src = payload.bytes.data();
    BlockDataHeader header_fields{
        .seq = seq, .size = size, .crc32c = job.crc32c, .block_id = job.block_id};
    const bool may_place = options_.placement_min_bytes > 0 &&
                           size >= options_.placement_min_bytes &&
                           transport_->capabilities().maps_peer_memory;
    std::shared_ptr<SenderRing> ring;  // where the block goes, if placed
    std::shared_ptr<SenderRing> ask;   // a ring to ask the peer for
    std::shared_ptr<SenderRing> replaced;  // a ring (or refusal) to forget: `ask` replaces it

    bool need_failure_callback = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      job.state->seq = seq;
      Peer& peer = peers_[ep.get()];
      if (peer.ep == nullptr) {
        peer.ep = ep;
        need_failure_callback = true;
      }
      ++peer.users;  // keeps the entry while this call waits
      const auto room = [&] {
        return holds_room || shutting_down_ || job.state->cancelled || !peer.failed.ok() ||
               peer.in_flight == 0 || peer.in_flight + size <= options_.max_bytes_in_flight;
      };
      if (need_failure_callback) {
        lock.unlock();
        const uint64_t handle = ep->OnFailure(
            [weak = weak_from_this(), key = ep.get()](const absl::Status& s) {
              if (auto self = weak.lock()) self->PeerFailed(key, s);
            });
        lock.lock();
        peer.failure_handle = handle;
      }
      while (!room()) {
        if (window_cv_.wait_until(lock, absl::ToChronoTime(deadline)) ==
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
      } else if (holds_room && deadline <= absl::Now()) {
        refuse = absl::DeadlineExceededError(absl::StrCat(
            "block transfer ", seq, ": no time left to send again after: ", job.last.message()));
      }
      if (!refuse.ok()) {
        --peer.users;
        if (holds_room) {
          ReleaseRoomLocked(ep.get(), size, lock);
        } else {
          MaybeDropPeerLocked(ep.get(), lock);
        }
        lock.unlock();  // the caller's callback runs without the sender's lock
        return fail_now(std::move(refuse));
      }
      --peer.users;
      if (may_place) {
        std::shared_ptr<SenderRing>& r = rings_by_ep_[ep.get()];
        if (r != nullptr && r->ep.lock() != ep) {  // an earlier endpoint's, at the same address
          rings_.erase(r->token);
          r = nullptr;
        }
        if (r != nullptr && r->state == SenderRing::State::kRefused &&
            absl::Now() >= r->ask_again) {  // refused for now: ask again
          replaced = std::move(r);
          rings_.erase(replaced->token);
        }
        if (r != nullptr && r->state == SenderRing::State::kReady) {
          if (std::optional<uint64_t> at = r->Allocate(size, seq)) {
            header_fields.placed = RingPlace{.token = r->token, .offset = *at};
            header_fields.streamed =
                options_.stream_min_bytes > 0 && size >= options_.stream_min_bytes;
            if (header_fields.streamed) r->copying[*at] = false;  // copied after the header
            ++r->unsettled;
            ring = r;
          } else if (r->unsettled == 0 &&
                     r->FitsIfReclaimed(size, absl::Now() - options_.reclaim_after)) {
            // What keeps this block out is space presumed lost (SenderRing::doubtful): return
            // the ring and ask for a new one. (The receiver keeps the old one's memory while
            // blocks in it are used, and refuses headers that name it.)
            replaced = std::move(r);
            rings_.erase(replaced->token);
            ++stats_.rings_renewed;
          }
        }
        if (r == nullptr) {
          r = std::make_shared<SenderRing>();
          r->token = NewTokenLocked();
          r->ep = ep;
          rings_[r->token] = r;
          ask = r;
        }
      }
      // A block going as payload and larger than a piece goes in pieces: the header with the
      // first, then the rest in order (each its own message, checked by the receiver as it lands).
      header_fields.pieced =
          ring == nullptr && options_.piece_bytes > 0 && size > options_.piece_bytes;
      if (!holds_room) {
        peer.in_flight += size;
        ++peer.pending;
      }
      stats_.max_bytes_in_flight = std::max(stats_.max_bytes_in_flight, peer.in_flight);
      Pending& p = pending_[seq];
      p.size = size;
      p.placed = ring != nullptr;
      if (p.placed) p.place = *header_fields.placed;
      p.copying = header_fields.streamed;
      p.pieced = header_fields.pieced;
      p.job = std::move(job);  // (ep and deadline are copies)
      p.start = absl::Now();
      deadlines_.emplace(deadline, seq);
    }
    watchdog_cv_.notify_one();
    if (replaced != nullptr) {
      ep->RemoveFailureCallback(replaced->failure_handle);
      if (replaced->state == SenderRing::State::kReady) {
        SendRelease(ep, kBlockRingReturnMessage, {.token = replaced->token, .drop = true});
      }
    }
    if (ask != nullptr) AskForRing(ep, ask);
    // The one copy goes straight into the receiver's memory (mapped while we hold `ep`): all of
    // it before the header, or, streamed, after it, chunk by chunk behind the progress word.
    uint8_t* place = ring != nullptr ? ring->mem.data() + header_fields.placed->offset : nullptr;
    std::optional<std::atomic_ref<uint64_t>> progress;
    if (place != nullptr) {
      payload = {};
      if (header_fields.streamed) {
        progress.emplace(*reinterpret_cast<uint64_t*>(place - kPlacedPrefixBytes));
        progress->store(0, std::memory_order_release);
      } else {
        std::memcpy(place, src, size);
        StoreFence();
      }
    }
    std::vector<uint64_t> tids;
    auto post = [&](uint16_t id, const std::string& h, Payload part) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++pending_.at(seq).sends_left;  // (the entry stays while `posting`)
      }
      tids.push_back(ep->Send(
          id, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()),
          part, timeout, [weak = weak_from_this(), seq](absl::Status s) {
            if (auto self = weak.lock()) self->SendDone(seq, std::move(s));
          }));
    };
    auto piece = [&](uint64_t at, uint64_t n) {
      return Payload{.bytes = payload.bytes.subspan(at, n), .region = payload.region};
    };
    post(kBlockDataMessage, EncodeBlockDataHeader(header_fields),
         header_fields.pieced ? piece(0, options_.piece_bytes) : payload);
    uint64_t posted_to = size;  // where a pieced block's posting stopped
    if (header_fields.pieced) {
      posted_to = options_.piece_bytes;
      for (; posted_to < size && !OutcomeKnown(seq); posted_to += options_.piece_bytes) {
        post(kBlockPieceMessage, EncodeBlockPieceHeader({.seq = seq, .offset = posted_to}),
             piece(posted_to, std::min(options_.piece_bytes, size - posted_to)));
      }
    }
    if (progress.has_value()) {
      // The transfer cannot complete, nor its space come back, until this copy has stopped
      // (`copying`): the caller's payload and the ring stay untouched after completion. An
      // outcome arriving meanwhile (the receiver gave up, cancel, timeout) stops it early.
      for (uint64_t done = 0; done < size;) {
        const uint64_t n = std::min<uint64_t>(kStreamChunk, size - done);
        std::memcpy(place + done, src + done, n);
        done += n;
        StoreFence();
        progress->store(done, std::memory_order_release);
        if (done < size && OutcomeKnown(seq)) break;
      }
      CopyDone(seq, ring, header_fields.placed->offset);
    }
    bool cancel = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = pending_.find(seq);
      if (it != pending_.end()) {
        it->second.backend_ids = tids;
        it->second.posting = false;
        // Cancelled or timed out while posting, with sends still under way.
        cancel = it->second.cancel_requested && it->second.sends_left > 0;
        if (it->second.outcome.has_value()) FinishLocked(it, lock);
      }
    }
    if (cancel) {
      for (uint64_t tid : tids) ep->Cancel(tid);
    }
    // Posting stopped early (failed, cancelled, timed out: the rest stays here) or what was
    // posted is being cancelled: the receiver lets the block go.
    if (header_fields.pieced && (posted_to < size || cancel)) Abandon(ep, seq, posted_to);
    return seq;
  }

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
        ring->mem = *mem;
        ring->free[0] = mem->size();
        ring->state = SenderRing::State::kReady;
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
  // A ring of a same-host receiver's memory, lent to this sender (see block_protocol.h).
  struct SenderRing {
    enum class State { kRequested, kReady, kRefused };
    uint64_t token = 0;
    std::weak_ptr<Endpoint> ep;
    State state = State::kRequested;
    std::span<uint8_t> mem;                       // mapped while the endpoint is held
    std::map<uint64_t, uint64_t> free;            // offset -> bytes, coalesced
    struct Used {
      uint64_t bytes, seq;  // the space taken (with the progress word), and whose
    };
    std::unordered_map<uint64_t, Used> used;  // offset -> placed and not given back
    // Streamed blocks still being written -> given back meanwhile (freed when the copy stops).
    std::unordered_map<uint64_t, bool> copying;
    // Placed blocks whose transfer is not complete, and the offsets of blocks whose transfer
    // completed without the receiver's answer (timed out, cancelled, the header's send failed),
    // with when: if the header never arrived, nothing gives their space back; if it did, a
    // release still may.
    size_t unsettled = 0;
    std::unordered_map<uint64_t, absl::Time> doubtful;
    absl::Time ask_again = absl::InfiniteFuture();  // kRefused: when to ask again
    uint64_t failure_handle = 0;

    // The mapping goes with the last holder (the sender's maps, or a Send still copying).
    ~SenderRing() {
      if (mem.empty()) return;
      if (std::shared_ptr<Endpoint> e = ep.lock()) e->Unmap(mem.data());
    }

    // Lowest free space of `size` bytes (256-byte aligned): blocks given back quickly are
    // followed by blocks in the same, cache-warm, memory.
    // Returns the block's offset; its progress word is the kPlacedPrefixBytes before it.
    static uint64_t Need(uint64_t size) {
      return (kPlacedPrefixBytes + std::max<uint64_t>(size, 1) + 255) / 256 * 256;
    }
    std::optional<uint64_t> Allocate(uint64_t size, uint64_t seq) {
      const uint64_t need = Need(size);
      for (auto it = free.begin(); it != free.end(); ++it) {
        if (it->second < need) continue;
        const uint64_t at = it->first;
        const uint64_t left = it->second - need;
        free.erase(it);
        if (left > 0) free[at + need] = left;
        used[at + kPlacedPrefixBytes] = {.bytes = need, .seq = seq};
        return at + kPlacedPrefixBytes;
      }
      return std::nullopt;
    }

    // Whether `size` bytes would fit if the space of blocks doubtful since before `before` came
    // back (false if there is none).
    bool FitsIfReclaimed(uint64_t size, absl::Time before) const {
      std::map<uint64_t, uint64_t> space = free;
      bool any = false;
      for (const auto& [offset, since] : doubtful) {
        if (since > before) continue;
        space[offset - kPlacedPrefixBytes] = used.at(offset).bytes;
        any = true;
      }
      uint64_t run_start = 0, run = 0;
      for (const auto& [at, len] : space) {  // longest run of adjacent extents
        if (run == 0 || at != run_start + run) {
          run_start = at;
          run = 0;
        }
        run += len;
        if (any && run >= Need(size)) return true;
      }
      return false;
    }

    // False for an offset that is not placed (a confused or stale peer): ignored. Space still
    // being written is freed when its copy stops.
    bool Release(uint64_t offset) {
      if (auto c = copying.find(offset); c != copying.end()) {
        c->second = true;
        return true;
      }
      auto u = used.find(offset);
      if (u == used.end()) return false;
      uint64_t start = offset - kPlacedPrefixBytes, len = u->second.bytes;
      used.erase(u);
      doubtful.erase(offset);
      auto next = free.find(start + len);
      if (next != free.end()) {
        len += next->second;
        free.erase(next);
      }
      auto after = free.lower_bound(start);
      if (after != free.begin()) {
        auto prev = std::prev(after);
        if (prev->first + prev->second == start) {
          start = prev->first;
          len += prev->second;
          free.erase(prev);
        }
      }
      free[start] = len;
      return true;
    }
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
    if (auto c = ring->copying.find(offset); c != ring->copying.end()) {
      const bool released = c->second;
      ring->copying.erase(c);
      if (released) ring->Release(offset);
    }
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
    auto range = deadlines_.equal_range(p.job.deadline);
    for (auto d = range.first; d != range.second; ++d) {
      if (d->second == seq) {
        deadlines_.erase(d);
        break;
      }
    }
    if (p.placed) {
      if (auto r = rings_.find(p.place.token); r != rings_.end()) {
        SenderRing& ring = *r->second;
        --ring.unsettled;
        auto u = ring.used.find(p.place.offset);
        if (!p.answered && u != ring.used.end() && u->second.seq == seq) {
          ring.doubtful[p.place.offset] = absl::Now();
        }
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
      retry_times_.emplace(again, seq);
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
      const std::optional<uint64_t> seq = TakeDueLocked(retry_times_, queued, retry_cv_, lock);
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

  // Waits on `cv` until the first of `timers` still `live` (the others are dropped) is due, and
  // takes it; nullopt when woken before then (the caller checks why, and calls again).
  static std::optional<uint64_t> TakeDueLocked(std::multimap<absl::Time, uint64_t>& timers,
                                               const std::function<bool(uint64_t)>& live,
                                               std::condition_variable& cv,
                                               std::unique_lock<std::mutex>& lock) {
    while (!timers.empty() && !live(timers.begin()->second)) timers.erase(timers.begin());
    if (timers.empty()) {
      cv.wait(lock);
      return std::nullopt;
    }
    const auto [when, seq] = *timers.begin();
    if (absl::Now() < when) {
      cv.wait_until(lock, absl::ToChronoTime(when));
      return std::nullopt;
    }
    timers.erase(timers.begin());
    return seq;
  }

  // Fires the deadlines of transfers not finished by then.
  void Watchdog() {
    const auto unfinished = [this](uint64_t seq) {
      auto it = pending_.find(seq);
      return it != pending_.end() && !it->second.outcome.has_value();
    };
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_watchdog_) {
      const std::optional<uint64_t> seq = TakeDueLocked(deadlines_, unfinished, watchdog_cv_, lock);
      if (!seq.has_value()) continue;
      lock.unlock();
      Abort(*seq, absl::DeadlineExceededError(absl::StrCat(
                      "block transfer ", *seq, " not acknowledged within its timeout")));
      lock.lock();
    }
  }

  Transport* transport_;
  const BlockSenderOptions options_;
  std::atomic<uint64_t> next_seq_{0};
  mutable std::mutex mu_;
  std::condition_variable window_cv_;
  std::condition_variable idle_cv_;
  std::condition_variable watchdog_cv_;
  PendingMap pending_;
  std::multimap<absl::Time, uint64_t> deadlines_;
  std::unordered_map<Endpoint*, Peer> peers_;
  std::unordered_map<uint64_t, std::shared_ptr<SenderRing>> rings_;       // by token
  std::unordered_map<Endpoint*, std::shared_ptr<SenderRing>> rings_by_ep_;
  uint64_t token_base_ = 0;
  uint64_t tokens_made_ = 0;
  Stats stats_;
  LatencyHistogram latency_;
  bool shutting_down_ = false;
  bool stop_watchdog_ = false;
  std::map<uint64_t, Job> queued_;                  // to be sent again, by the failed attempt's seq
  std::multimap<absl::Time, uint64_t> retry_times_;  // when (entries of cancelled ones linger)
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
