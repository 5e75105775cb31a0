#include "transport/block_protocol.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

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
constexpr uint8_t kWireVersion = 1;
constexpr size_t kDataFixed = 4 + 1 + 1 + 2 + 8 + 8 + 4;  // magic ver pad id_len seq size crc
constexpr size_t kAckFixed = 4 + 1 + 1 + 2 + 8 + 4;       // magic ver pad msg_len seq code

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

}  // namespace

std::string EncodeBlockDataHeader(const BlockDataHeader& h) {
  std::string out;
  out.reserve(kDataFixed + h.block_id.size());
  Put<uint32_t>(out, kDataMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, 0);
  Put<uint16_t>(out, static_cast<uint16_t>(h.block_id.size()));
  Put<uint64_t>(out, h.seq);
  Put<uint64_t>(out, h.size);
  Put<uint32_t>(out, h.crc32c);
  out += h.block_id;
  return out;
}

absl::StatusOr<BlockDataHeader> DecodeBlockDataHeader(std::span<const uint8_t> b) {
  if (b.size() < kDataFixed) {
    return absl::InvalidArgumentError(
        absl::StrCat("block data header: ", b.size(), " bytes, needs at least ", kDataFixed));
  }
  const uint32_t magic = Get<uint32_t>(b.data());
  if (magic != kDataMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block data header: magic %08x, expected %08x", magic, kDataMagic));
  }
  if (b[4] != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("block data header: wire version ", b[4], ", this build speaks ",
                     kWireVersion));
  }
  if (b[5] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block data header: reserved byte is ", b[5], ", must be 0"));
  }
  const size_t id_len = Get<uint16_t>(b.data() + 6);
  if (id_len > kMaxBlockIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("block data header: block id of ", id_len,
                                                   " bytes exceeds ", kMaxBlockIdBytes));
  }
  if (b.size() != kDataFixed + id_len) {
    return absl::InvalidArgumentError(absl::StrCat("block data header: ", b.size(),
                                                   " bytes, but its block id length says ",
                                                   kDataFixed + id_len));
  }
  BlockDataHeader h;
  h.seq = Get<uint64_t>(b.data() + 8);
  h.size = Get<uint64_t>(b.data() + 16);
  h.crc32c = Get<uint32_t>(b.data() + 24);
  h.block_id.assign(reinterpret_cast<const char*>(b.data() + kDataFixed), id_len);
  return h;
}

std::string EncodeBlockAckHeader(const BlockAckHeader& h) {
  const absl::string_view msg = h.status.message().substr(0, kMaxAckMessageBytes);
  std::string out;
  out.reserve(kAckFixed + msg.size());
  Put<uint32_t>(out, kAckMagic);
  Put<uint8_t>(out, kWireVersion);
  Put<uint8_t>(out, 0);
  Put<uint16_t>(out, static_cast<uint16_t>(msg.size()));
  Put<uint64_t>(out, h.seq);
  Put<uint32_t>(out, static_cast<uint32_t>(h.status.code()));
  out.append(msg.data(), msg.size());
  return out;
}

absl::StatusOr<BlockAckHeader> DecodeBlockAckHeader(std::span<const uint8_t> b) {
  if (b.size() < kAckFixed) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ack header: ", b.size(), " bytes, needs at least ", kAckFixed));
  }
  if (Get<uint32_t>(b.data()) != kAckMagic) {
    return absl::InvalidArgumentError("block ack header: bad magic");
  }
  if (b[4] != kWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("block ack header: wire version ", b[4]));
  }
  if (b[5] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ack header: reserved byte is ", b[5], ", must be 0"));
  }
  const size_t msg_len = Get<uint16_t>(b.data() + 6);
  if (msg_len > kMaxAckMessageBytes || b.size() != kAckFixed + msg_len) {
    return absl::InvalidArgumentError(absl::StrCat("block ack header: ", b.size(),
                                                   " bytes with a message length of ", msg_len));
  }
  const uint32_t code = Get<uint32_t>(b.data() + 16);
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(absl::StrCat("block ack header: status code ", code));
  }
  BlockAckHeader h;
  h.seq = Get<uint64_t>(b.data() + 8);
  h.status = absl::Status(
      static_cast<absl::StatusCode>(code),
      absl::string_view(reinterpret_cast<const char*>(b.data() + kAckFixed), msg_len));
  return h;
}

// ---- receiver -----------------------------------------------------------------------------------

absl::Status BlockReceiverOptions::Validate() const {
  if (max_block_bytes == 0) return absl::InvalidArgumentError("max_block_bytes must be > 0");
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

void Reply(const std::shared_ptr<Endpoint>& ep, uint64_t seq, const absl::Status& status) {
  if (ep == nullptr) return;
  const std::string h = EncodeBlockAckHeader({.seq = seq, .status = status});
  ep->Send(kBlockAckMessage,
           std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()), {},
           absl::Seconds(30), [](absl::Status) {});
}

}  // namespace

class BlockReceiver::Impl : public std::enable_shared_from_this<BlockReceiver::Impl> {
 public:
  Impl(Transport* transport, BlockReceiverOptions options, BlockConsumer consumer)
      : transport_(transport),
        options_(options),
        consumer_(std::move(consumer)),
        pool_(BufferPool<RegisteredBuffer>::Create(options.pool_bytes)),
        tasks_(options.verify_threads) {}

  void OnData(IncomingMessage& m) {
    absl::StatusOr<BlockDataHeader> h = DecodeBlockDataHeader(m.header());
    if (!h.ok()) {
      Count(&Stats::malformed);
      return;  // no sequence number to answer to; the sender times out
    }
    std::shared_ptr<Endpoint> ep = m.endpoint();
    if (m.payload_size() != h->size) {
      Count(&Stats::malformed);
      Reply(ep, h->seq,
            absl::InvalidArgumentError(absl::StrCat("block ", h->seq, ": header says ", h->size,
                                                    " bytes, the message carries ",
                                                    m.payload_size())));
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
    absl::StatusOr<std::shared_ptr<RegisteredBuffer>> slot =
        AcquireRegistered(*pool_, *transport_, h->size);
    if (!slot.ok()) {
      Reply(ep, h->seq, slot.status());
      return;
    }
    AddPending(static_cast<int64_t>(h->size));
    auto self = shared_from_this();
    auto header = std::make_shared<BlockDataHeader>(std::move(*h));
    std::shared_ptr<RegisteredBuffer> buf = std::move(*slot);
    Destination dest{.bytes = std::span<uint8_t>(buf->buffer.data(), header->size),
                     .region = buf->region.get()};
    if (header->size == 0) {
      Arrived(self, header, buf, ep, absl::OkStatus());
      return;
    }
    m.Accept(dest, [self, header, buf, ep](absl::Status s) { Arrived(self, header, buf, ep, s); });
  }

  BlockReceiver::Stats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  std::string RenderMetrics() const {
    Stats st;
    uint64_t pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      st = stats_;
      pending = pending_bytes_;
    }
    std::string out;
    const std::pair<const char*, uint64_t> counters[] = {
        {"blocks", st.blocks},           {"bytes", st.bytes},
        {"refused", st.refused},         {"checksum_failures", st.checksum_failures},
        {"too_large", st.too_large},     {"malformed", st.malformed},
        {"aborted", st.aborted}};
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
    return out;
  }

  // After this no consumer call starts; those under way (queued or inline) finish first.
  void Shutdown() {
    transport_->SetHandler(kBlockDataMessage, nullptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    tasks_.Stop();
    std::unique_lock<std::mutex> lock(mu_);
    inline_cv_.wait(lock, [&] { return inline_running_ == 0; });
  }

 private:
  static void Arrived(const std::shared_ptr<Impl>& self, std::shared_ptr<BlockDataHeader> header,
                      std::shared_ptr<RegisteredBuffer> buf, std::shared_ptr<Endpoint> ep,
                      absl::Status s) {
    if (!s.ok()) {  // partial data: discarded with the buffer
      self->Count(&Stats::aborted);
      self->AddPending(-static_cast<int64_t>(header->size));
      Reply(ep, header->seq, s);
      return;
    }
    const uint64_t seq = header->seq;
    const int64_t size = static_cast<int64_t>(header->size);
    if (header->size <= self->options_.inline_max_bytes) {  // still in cache; no hand-off
      bool run;
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        run = !self->stopped_;
        if (run) ++self->inline_running_;
      }
      if (run) {
        self->Verify(*header, std::move(buf), ep);
        std::lock_guard<std::mutex> lock(self->mu_);
        if (--self->inline_running_ == 0) self->inline_cv_.notify_all();
        return;
      }
    } else if (self->tasks_.Post([self, header, buf, ep] { self->Verify(*header, buf, ep); })) {
      return;
    }
    self->AddPending(-size);  // the receiver is shutting down: nobody will consume it
    Reply(ep, seq, absl::UnavailableError("receiver shut down"));
  }

  void Verify(const BlockDataHeader& h, std::shared_ptr<RegisteredBuffer> buf,
              const std::shared_ptr<Endpoint>& ep) {
    const uint32_t crc = Crc32c(buf->buffer.data(), h.size);
    absl::Status status;
    if (crc != h.crc32c) {
      Count(&Stats::checksum_failures);
      status = absl::DataLossError(absl::StrFormat(
          "block %s (transfer %d, %d bytes): checksum mismatch, received data has CRC-32C %08x, "
          "the sender's header says %08x",
          absl::CEscape(h.block_id.substr(0, 64)), h.seq, h.size, crc, h.crc32c));
    } else {
      ReceivedBlock block{.id = h.block_id,
                          .crc32c = crc,
                          .bytes = std::span<const uint8_t>(buf->buffer.data(), h.size),
                          .hold = buf,
                          .from = ep};
      buf.reset();
      status = consumer_(std::move(block));
      std::lock_guard<std::mutex> lock(mu_);
      if (status.ok()) {
        ++stats_.blocks;
        stats_.bytes += h.size;
      } else {
        ++stats_.refused;
      }
    }
    AddPending(-static_cast<int64_t>(h.size));
    Reply(ep, h.seq, status);
  }

  void Count(uint64_t Stats::*field) {
    std::lock_guard<std::mutex> lock(mu_);
    ++(stats_.*field);
  }

  void AddPending(int64_t delta) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_bytes_ = static_cast<uint64_t>(static_cast<int64_t>(pending_bytes_) + delta);
    stats_.max_pending_bytes = std::max(stats_.max_pending_bytes, pending_bytes_);
  }

  Transport* transport_;
  const BlockReceiverOptions options_;
  BlockConsumer consumer_;
  std::shared_ptr<BufferPool<RegisteredBuffer>> pool_;
  mutable std::mutex mu_;
  Stats stats_;
  uint64_t pending_bytes_ = 0;
  bool stopped_ = false;         // Shutdown began: no new consumer calls
  int inline_running_ = 0;       // consumer calls on the transport's thread under way
  std::condition_variable inline_cv_;
  TaskThreads tasks_;  // last: joined first in the destructor
};

absl::StatusOr<std::unique_ptr<BlockReceiver>> BlockReceiver::Create(
    Transport* transport, BlockReceiverOptions options, BlockConsumer consumer) {
  if (transport == nullptr) return absl::InvalidArgumentError("BlockReceiver: null transport");
  if (!consumer) return absl::InvalidArgumentError("BlockReceiver: no consumer");
  if (absl::Status s = options.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("BlockReceiverOptions: ", s.message()));
  }
  auto impl = std::make_shared<Impl>(transport, options, std::move(consumer));
  std::weak_ptr<Impl> weak = impl;
  transport->SetHandler(kBlockDataMessage, [weak](IncomingMessage& m) {
    if (auto self = weak.lock()) self->OnData(m);
  });
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
  return absl::OkStatus();
}

struct Transfer::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status = absl::UnknownError("transfer not complete");
  std::weak_ptr<BlockSender::Impl> sender;
};

class BlockSender::Impl : public std::enable_shared_from_this<BlockSender::Impl> {
 public:
  Impl(Transport* transport, BlockSenderOptions options)
      : transport_(transport), options_(options), watchdog_([this] { Watchdog(); }) {}

  std::shared_ptr<Transfer> Send(const std::shared_ptr<Endpoint>& ep, absl::string_view block_id,
                                 Payload payload, const SendOptions& so,
                                 std::function<void(absl::Status)> done) {
    auto state = std::make_shared<Transfer::State>();
    state->sender = weak_from_this();
    const uint64_t seq = next_seq_.fetch_add(1) + 1;
    auto transfer = std::shared_ptr<Transfer>(new Transfer(state, seq));
    const absl::Duration timeout = so.timeout.value_or(options_.timeout);
    const absl::Time deadline = absl::Now() + timeout;
    auto fail_now = [&](absl::Status s) {
      Complete(state, std::move(done), std::move(s));
      return transfer;
    };
    if (ep == nullptr) return fail_now(absl::InvalidArgumentError("Send: null endpoint"));
    if (block_id.size() > kMaxBlockIdBytes) {
      return fail_now(absl::InvalidArgumentError(
          absl::StrCat("block id of ", block_id.size(), " bytes exceeds ", kMaxBlockIdBytes)));
    }
    const uint64_t size = payload.bytes.size();
    const std::string header = EncodeBlockDataHeader(
        {.seq = seq,
         .size = size,
         .crc32c = so.crc32c ? *so.crc32c : Crc32c(payload.bytes.data(), size),
         .block_id = std::string(block_id)});

    bool need_failure_callback = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      Peer& peer = peers_[ep.get()];
      if (peer.ep == nullptr) {
        peer.ep = ep;
        need_failure_callback = true;
      }
      ++peer.users;  // keeps the entry while this call waits
      const auto room = [&] {
        return shutting_down_ || !peer.failed.ok() || peer.in_flight == 0 ||
               peer.in_flight + size <= options_.max_bytes_in_flight;
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
      } else if (!peer.failed.ok()) {
        refuse = absl::UnavailableError(peer.failed.message());
      } else if (!room()) {
        refuse = absl::DeadlineExceededError(absl::StrCat(
            "block transfer ", seq, ": the peer's window (", options_.max_bytes_in_flight,
            " bytes in flight) did not open within ", absl::FormatDuration(timeout)));
      }
      if (!refuse.ok()) {
        --peer.users;
        MaybeDropPeerLocked(ep.get(), lock);
        lock.unlock();  // the caller's callback runs without the sender's lock
        return fail_now(std::move(refuse));
      }
      --peer.users;
      peer.in_flight += size;
      ++peer.pending;
      stats_.max_bytes_in_flight = std::max(stats_.max_bytes_in_flight, peer.in_flight);
      Pending& p = pending_[seq];
      p.ep = ep;
      p.size = size;
      p.state = state;
      p.done = std::move(done);
      p.deadline = deadline;
      p.start = absl::Now();
      deadlines_.emplace(deadline, seq);
    }
    watchdog_cv_.notify_one();

    const uint64_t tid = ep->Send(
        kBlockDataMessage,
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()), header.size()),
        payload, timeout, [weak = weak_from_this(), seq](absl::Status s) {
          if (auto self = weak.lock()) self->SendDone(seq, std::move(s));
        });
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(seq);
      if (it != pending_.end()) {
        it->second.backend_id = tid;
        it->second.posted = true;
        // Cancelled or timed out before the backend gave its id (not merely acknowledged early).
        cancel = it->second.cancel_requested && !it->second.send_done;
      }
    }
    if (cancel) ep->Cancel(tid);
    return transfer;
  }

  // Sets the outcome of `seq` if it has none (cancel, timeout).
  void Abort(uint64_t seq, absl::Status why) {
    std::shared_ptr<Endpoint> ep;
    uint64_t tid = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = pending_.find(seq);
      if (it == pending_.end() || it->second.outcome.has_value()) return;
      it->second.outcome = std::move(why);
      it->second.cancel_requested = true;
      if (it->second.send_done) {
        FinishLocked(it, lock);
        return;
      }
      if (it->second.posted) {
        ep = it->second.ep;
        tid = it->second.backend_id;
      }
    }
    if (ep != nullptr) ep->Cancel(tid);  // the backend completes the send; SendDone finishes
  }

  void OnAck(IncomingMessage& m) {
    absl::StatusOr<BlockAckHeader> h = DecodeBlockAckHeader(m.header());
    if (!h.ok()) return;  // a peer speaking garbage: the transfer times out
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(h->seq);
    if (it == pending_.end() || it->second.outcome.has_value()) {
      ++stats_.late_acks;
      return;
    }
    it->second.outcome = std::move(h->status);
    if (it->second.send_done) FinishLocked(it, lock);
  }

  void Shutdown() {
    transport_->SetHandler(kBlockAckMessage, nullptr);
    std::vector<uint64_t> seqs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutting_down_ = true;
      for (const auto& [seq, p] : pending_) seqs.push_back(seq);
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
    return stats_;
  }

  std::string RenderMetrics() const {
    const Stats st = stats();
    std::string out;
    const std::pair<const char*, uint64_t> counters[] = {
        {"blocks", st.sent}, {"bytes", st.bytes}, {"failures", st.failed},
        {"late_acks", st.late_acks}};
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
    std::shared_ptr<Endpoint> ep;
    uint64_t size = 0;
    std::shared_ptr<Transfer::State> state;
    std::function<void(absl::Status)> done;
    absl::Time deadline;
    absl::Time start;
    uint64_t backend_id = 0;
    bool posted = false;
    bool send_done = false;
    absl::Status send_status;
    std::optional<absl::Status> outcome;  // the ack's status, or why it was given up
    bool cancel_requested = false;        // Abort: the backend's send must be stopped
  };
  using PendingMap = std::unordered_map<uint64_t, Pending>;

  void SendDone(uint64_t seq, absl::Status s) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(seq);
    if (it == pending_.end()) return;
    it->second.send_done = true;
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
    peer->second.failed = absl::UnavailableError(
        absl::StrCat("peer ", peer->second.ep->peer(), " failed: ", s.message()));
    window_cv_.notify_all();
    std::vector<uint64_t> finished;
    for (auto& [seq, p] : pending_) {
      if (p.ep.get() != key || p.outcome.has_value()) continue;
      p.outcome = peer->second.failed;
      if (p.send_done) finished.push_back(seq);
    }
    for (uint64_t seq : finished) {
      auto it = pending_.find(seq);
      if (it != pending_.end()) FinishLocked(it, lock);  // relocks; iterators refetched
    }
  }

  // Completes a pending transfer whose send is done and whose outcome is known. Unlocks around
  // the user's callback and relocks.
  void FinishLocked(PendingMap::iterator it, std::unique_lock<std::mutex>& lock) {
    const uint64_t seq = it->first;
    Pending p = std::move(it->second);
    pending_.erase(it);
    auto range = deadlines_.equal_range(p.deadline);
    for (auto d = range.first; d != range.second; ++d) {
      if (d->second == seq) {
        deadlines_.erase(d);
        break;
      }
    }
    const absl::Status status = *p.outcome;
    if (status.ok()) {
      ++stats_.sent;
      stats_.bytes += p.size;
      latency_.Record(absl::ToDoubleSeconds(absl::Now() - p.start));
    } else {
      ++stats_.failed;
    }
    auto peer = peers_.find(p.ep.get());
    bool wake = true;
    if (peer != peers_.end()) {
      // Senders blocked on a full window are woken when it has drained to half (or is empty),
      // not on every ack: one wake-up per half window instead of two context switches per block.
      const uint64_t half = options_.max_bytes_in_flight / 2;
      const uint64_t before = peer->second.in_flight;
      peer->second.in_flight -= p.size;
      wake = peer->second.in_flight == 0 || (before > half && peer->second.in_flight <= half);
      --peer->second.pending;
      MaybeDropPeerLocked(p.ep.get(), lock);
    }
    if (wake) window_cv_.notify_all();
    if (pending_.empty()) idle_cv_.notify_all();
    lock.unlock();
    Complete(p.state, std::move(p.done), status);
    lock.lock();
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

  void Watchdog() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_watchdog_) {
      // Drop entries of transfers that have finished; fire the first that is due.
      while (!deadlines_.empty()) {
        auto first = deadlines_.begin();
        auto it = pending_.find(first->second);
        if (it == pending_.end() || it->second.outcome.has_value()) {
          deadlines_.erase(first);
          continue;
        }
        break;
      }
      if (deadlines_.empty()) {
        watchdog_cv_.wait(lock);
        continue;
      }
      const auto [when, seq] = *deadlines_.begin();
      if (absl::Now() < when) {
        watchdog_cv_.wait_until(lock, absl::ToChronoTime(when));
        continue;
      }
      deadlines_.erase(deadlines_.begin());
      lock.unlock();
      Abort(seq, absl::DeadlineExceededError(absl::StrCat(
                     "block transfer ", seq, " not acknowledged within its timeout")));
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
  Stats stats_;
  LatencyHistogram latency_;
  bool shutting_down_ = false;
  bool stop_watchdog_ = false;
  std::thread watchdog_;  // last: started after the members it uses
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
  if (auto sender = state_->sender.lock()) {
    sender->Abort(seq_, absl::CancelledError(absl::StrCat("block transfer ", seq_, " cancelled")));
  }
}

absl::StatusOr<std::unique_ptr<BlockSender>> BlockSender::Create(Transport* transport,
                                                                 BlockSenderOptions options) {
  if (transport == nullptr) return absl::InvalidArgumentError("BlockSender: null transport");
  if (absl::Status s = options.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("BlockSenderOptions: ", s.message()));
  }
  auto impl = std::make_shared<Impl>(transport, options);
  std::weak_ptr<Impl> weak = impl;
  transport->SetHandler(kBlockAckMessage, [weak](IncomingMessage& m) {
    if (auto self = weak.lock()) self->OnAck(m);
  });
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
