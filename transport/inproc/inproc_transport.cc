#include "transport/inproc/inproc_transport.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/aligned_buffer.h"
#include "transport/internal/failure_notifier.h"
#include "transport/internal/handler_table.h"

namespace strata::transport {
namespace {

constexpr absl::string_view kScheme = "inproc://";
constexpr size_t kMaxHeader = 64 * 1024;

class Core;
class InprocEndpoint;

// Names -> live transports of this process.
struct Registry {
  std::mutex mu;
  std::unordered_map<std::string, std::weak_ptr<Core>> cores;
  uint64_t next_anonymous = 0;
  static Registry& Get() {
    static Registry* r = new Registry;  // never destroyed: transports may outlive statics
    return *r;
  }
};

// A delivery's state, shared by the queue entry and the sender's endpoint (for Cancel).
struct DeliveryState {
  std::mutex mu;
  bool started = false;   // the receiving thread took it
  bool finished = false;  // its completion ran
  Completion done;

  // Completes it CANCELLED unless the receiving thread has taken it (then it finishes on its own
  // once the copy is done). Checked and marked in one step, so the payload is never read after
  // the completion.
  bool TryCancel(absl::Status why) { return Complete(std::move(why), /*unless_started=*/true); }

  // Runs the completion once; false if it already ran.
  bool Finish(absl::Status s) { return Complete(std::move(s), /*unless_started=*/false); }

 private:
  bool Complete(absl::Status s, bool unless_started) {
    Completion fn;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished || (unless_started && started)) return false;
      finished = true;
      fn = std::move(done);
    }
    fn(std::move(s));
    return true;
  }
};

struct Delivery {
  uint16_t id = 0;
  std::vector<uint8_t> header;
  std::span<const uint8_t> payload;
  std::shared_ptr<Endpoint> reply;  // the receiver's endpoint back to the sender
  absl::Time deadline;
  std::shared_ptr<DeliveryState> state;
};

class InprocRegion final : public MemoryRegion {
 public:
  InprocRegion(uint8_t* data, size_t size, std::weak_ptr<Core> core, uint64_t id,
               AlignedBuffer owned = AlignedBuffer())
      : MemoryRegion(data, size, MemoryKind::kHost),
        core_(std::move(core)),
        id_(id),
        owned_(std::move(owned)) {}
  ~InprocRegion() override;
  absl::StatusOr<std::string> RemoteDescriptor() const override;

 private:
  std::weak_ptr<Core> core_;
  uint64_t id_;
  AlignedBuffer owned_;  // Allocate's memory
};

// A transport's shared state: handlers, the delivery queue and thread, registered regions.
class Core : public std::enable_shared_from_this<Core> {
 public:
  explicit Core(std::string name) : name_(std::move(name)) {}

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }

  const std::string& name() const { return name_; }

  // Queues a delivery; once closed, fails it with UNAVAILABLE instead.
  void Enqueue(Delivery d) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!closed_) {
        queue_.push_back(std::move(d));
        cv_.notify_one();
        return;
      }
    }
    d.state->Finish(absl::UnavailableError(absl::StrCat("inproc peer ", name_, " shut down")));
  }

  void SetHandler(uint16_t id, MessageHandler h) { handlers_.Set(id, std::move(h)); }

  // The endpoint for replies to `peer`, made on first use.
  std::shared_ptr<Endpoint> ReplyEndpoint(const std::shared_ptr<Core>& peer);

  void TrackInbound(std::weak_ptr<InprocEndpoint> ep) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(inbound_, [](const auto& w) { return w.expired(); });
    inbound_.push_back(std::move(ep));
  }

  uint64_t AddRegion(uint8_t* data, size_t size) {
    std::unique_lock<std::shared_mutex> lock(regions_mu_);
    const uint64_t id = ++next_region_;
    regions_[id] = {data, size};
    return id;
  }
  void RemoveRegion(uint64_t id) {
    std::unique_lock<std::shared_mutex> lock(regions_mu_);
    regions_.erase(id);
  }
  absl::Status WriteRegion(uint64_t id, uint64_t offset, std::span<const uint8_t> bytes) {
    std::shared_lock<std::shared_mutex> lock(regions_mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Put: region ", id, " is not registered with inproc peer ", name_));
    }
    if (offset > it->second.second || bytes.size() > it->second.second - offset) {
      return absl::OutOfRangeError(absl::StrCat("Put: ", bytes.size(), " bytes at offset ", offset,
                                                " overrun the peer's region of ",
                                                it->second.second, " bytes"));
    }
    if (!bytes.empty()) std::memcpy(it->second.first + offset, bytes.data(), bytes.size());
    return absl::OkStatus();
  }

  // Fails what is queued and every endpoint that points here or from here; joins the thread.
  void Close();

 private:
  void Loop();

  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Delivery> queue_;
  bool closed_ = false;
  internal::HandlerTable handlers_;
  std::unordered_map<std::string, std::shared_ptr<InprocEndpoint>> replies_;
  std::vector<std::weak_ptr<InprocEndpoint>> inbound_;
  std::thread thread_;

  std::shared_mutex regions_mu_;
  std::map<uint64_t, std::pair<uint8_t*, size_t>> regions_;
  uint64_t next_region_ = 0;
};

class InprocEndpoint final : public Endpoint, public std::enable_shared_from_this<InprocEndpoint> {
 public:
  InprocEndpoint(std::weak_ptr<Core> self, std::weak_ptr<Core> target, std::string target_name)
      : self_(std::move(self)), target_(std::move(target)), target_name_(std::move(target_name)) {}

  uint64_t Send(uint16_t id, std::span<const uint8_t> header, Payload payload,
                absl::Duration timeout, Completion done) override {
    const uint64_t tid = next_tid_.fetch_add(1) + 1;
    if (absl::Status h = health(); !h.ok()) {
      done(h);
      return tid;
    }
    if (header.size() > kMaxHeader) {
      done(absl::InvalidArgumentError(
          absl::StrCat("header of ", header.size(), " bytes exceeds ", kMaxHeader)));
      return tid;
    }
    if (absl::Status bad = internal::CheckMessageId(id); !bad.ok()) {
      done(std::move(bad));
      return tid;
    }
    std::shared_ptr<Core> target = target_.lock();
    std::shared_ptr<Core> self = self_.lock();
    if (target == nullptr || self == nullptr) {
      done(absl::UnavailableError(absl::StrCat("inproc peer ", target_name_, " is gone")));
      return tid;
    }
    auto state = std::make_shared<DeliveryState>();
    std::weak_ptr<InprocEndpoint> weak = weak_from_this();
    state->done = [weak, tid, done = std::move(done)](absl::Status s) {
      if (auto ep = weak.lock()) ep->Forget(tid);
      done(std::move(s));
    };
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_[tid] = state;
    }
    Delivery d{.id = id,
               .header = std::vector<uint8_t>(header.begin(), header.end()),
               .payload = payload.bytes,
               .reply = target->ReplyEndpoint(self),
               .deadline = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture()
                                                               : absl::Now() + timeout,
               .state = state};
    target->Enqueue(std::move(d));
    return tid;
  }

  uint64_t Put(Payload payload, absl::string_view remote, uint64_t remote_offset,
               absl::Duration, Completion done) override {
    const uint64_t tid = next_tid_.fetch_add(1) + 1;
    if (absl::Status h = health(); !h.ok()) {
      done(h);
      return tid;
    }
    // remote: "inproc:<region id>@<transport name>"
    std::vector<absl::string_view> parts = absl::StrSplit(remote, absl::MaxSplits('@', 1));
    uint64_t region = 0;
    if (parts.size() != 2 || !absl::StartsWith(parts[0], "inproc:") ||
        !absl::SimpleAtoi(parts[0].substr(7), &region)) {
      done(absl::InvalidArgumentError(
          absl::StrCat("Put: '", remote, "' is not an inproc region descriptor")));
      return tid;
    }
    if (parts[1] != target_name_) {
      done(absl::InvalidArgumentError(absl::StrCat("Put: the region belongs to ", parts[1],
                                                   ", this endpoint goes to ", target_name_)));
      return tid;
    }
    std::shared_ptr<Core> target = target_.lock();
    if (target == nullptr) {
      done(absl::UnavailableError(absl::StrCat("inproc peer ", target_name_, " is gone")));
      return tid;
    }
    done(target->WriteRegion(region, remote_offset, payload.bytes));
    return tid;
  }

  void Cancel(uint64_t tid) override {
    std::shared_ptr<DeliveryState> state;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(tid);
      if (it == live_.end()) return;
      state = it->second;
    }
    state->TryCancel(absl::CancelledError(absl::StrCat("transfer ", tid, " cancelled")));
  }

  absl::Status health() const override { return notifier_.health(); }
  uint64_t OnFailure(std::function<void(const absl::Status&)> fn) override {
    return notifier_.Add(std::move(fn));
  }
  void RemoveFailureCallback(uint64_t handle) override { notifier_.Remove(handle); }
  std::string peer() const override { return absl::StrCat(kScheme, target_name_); }

  void Fail(absl::Status why) { notifier_.Fail(std::move(why)); }
  bool Targets(const std::shared_ptr<Core>& core) const { return target_.lock() == core; }

 private:
  void Forget(uint64_t tid) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(tid);
  }

  std::weak_ptr<Core> self_;
  std::weak_ptr<Core> target_;
  const std::string target_name_;
  std::atomic<uint64_t> next_tid_{0};
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<DeliveryState>> live_;
  internal::FailureNotifier notifier_;
};

std::shared_ptr<Endpoint> Core::ReplyEndpoint(const std::shared_ptr<Core>& peer) {
  std::shared_ptr<InprocEndpoint> ep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = replies_[peer->name()];
    // A cached endpoint to an earlier transport of the same name is dead: replace it.
    if (slot != nullptr && slot->health().ok() && slot->Targets(peer)) return slot;
    slot = std::make_shared<InprocEndpoint>(weak_from_this(), peer, peer->name());
    ep = slot;
  }
  peer->TrackInbound(ep);
  return ep;
}

class InprocMessage final : public IncomingMessage {
 public:
  explicit InprocMessage(Delivery& d) : d_(d) {}
  std::span<const uint8_t> header() const override { return d_.header; }
  size_t payload_size() const override { return d_.payload.size(); }
  std::shared_ptr<Endpoint> endpoint() const override { return d_.reply; }
  void Accept(Destination dest, Completion done) override {
    if (accepted_) {
      done(absl::FailedPreconditionError("Accept called twice"));
      return;
    }
    accepted_ = true;
    if (dest.bytes.size() != d_.payload.size()) {
      done(absl::InvalidArgumentError(absl::StrCat("Accept: destination of ", dest.bytes.size(),
                                                   " bytes for a payload of ",
                                                   d_.payload.size())));
      return;
    }
    if (!d_.payload.empty()) std::memcpy(dest.bytes.data(), d_.payload.data(), d_.payload.size());
    done(absl::OkStatus());
  }

 private:
  Delivery& d_;
  bool accepted_ = false;
};

void Core::Loop() {
  for (;;) {
    Delivery d;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;
      d = std::move(queue_.front());
      queue_.pop_front();
    }
    std::shared_ptr<MessageHandler> handler = handlers_.Get(d.id);
    {
      std::lock_guard<std::mutex> lock(d.state->mu);
      if (d.state->finished) continue;  // cancelled while queued
      d.state->started = true;
    }
    if (absl::Now() > d.deadline) {
      d.state->Finish(absl::DeadlineExceededError("inproc message not delivered within its timeout"));
      continue;
    }
    if (handler != nullptr) {
      InprocMessage m(d);
      (*handler)(m);
    }
    d.state->Finish(absl::OkStatus());  // like a network send: done once delivered
  }
}

void Core::Close() {
  std::deque<Delivery> queued;
  std::unordered_map<std::string, std::shared_ptr<InprocEndpoint>> replies;
  std::vector<std::weak_ptr<InprocEndpoint>> inbound;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    queued.swap(queue_);
    replies.swap(replies_);
    inbound.swap(inbound_);
  }
  handlers_.Clear();
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  const absl::Status gone = absl::UnavailableError(absl::StrCat("inproc peer ", name_, " shut down"));
  for (Delivery& d : queued) d.state->Finish(gone);
  for (auto& w : inbound) {
    if (auto ep = w.lock()) ep->Fail(gone);
  }
  for (auto& [name, ep] : replies) {
    ep->Fail(absl::UnavailableError(absl::StrCat("inproc transport ", name_, " shut down")));
  }
}

InprocRegion::~InprocRegion() {
  if (auto core = core_.lock()) core->RemoveRegion(id_);
}

absl::StatusOr<std::string> InprocRegion::RemoteDescriptor() const {
  auto core = core_.lock();
  if (core == nullptr) return absl::FailedPreconditionError("the transport is gone");
  return absl::StrCat("inproc:", id_, "@", core->name());
}

class InprocTransport final : public Transport {
 public:
  explicit InprocTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {
    caps_.backend = "inproc";
    caps_.one_sided = true;
  }
  ~InprocTransport() override {
    {
      Registry& r = Registry::Get();
      std::lock_guard<std::mutex> lock(r.mu);
      r.cores.erase(core_->name());
    }
    std::vector<std::weak_ptr<InprocEndpoint>> outbound;
    {
      std::lock_guard<std::mutex> lock(mu_);
      outbound.swap(outbound_);
    }
    for (auto& weak : outbound) {
      auto ep = weak.lock();
      if (ep == nullptr) continue;
      ep->Fail(absl::UnavailableError(absl::StrCat("inproc transport ", core_->name(),
                                                   " shut down")));
    }
    core_->Close();
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::string address() const override { return absl::StrCat(kScheme, core_->name()); }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* data, size_t size,
                                                         MemoryKind kind) override {
    if (kind != MemoryKind::kHost) {
      return absl::UnimplementedError("the inproc transport registers host memory only");
    }
    if (data == nullptr || size == 0) {
      return absl::InvalidArgumentError("Register: empty region");
    }
    auto* p = static_cast<uint8_t*>(data);
    return std::unique_ptr<MemoryRegion>(
        new InprocRegion(p, size, core_, core_->AddRegion(p, size)));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t size, MemoryKind kind) override {
    if (kind != MemoryKind::kHost) {
      return absl::UnimplementedError("the inproc transport registers host memory only");
    }
    if (size == 0) return absl::InvalidArgumentError("Allocate: empty region");
    AlignedBuffer buf = AlignedBuffer::Uninitialized(size);
    uint8_t* p = buf.data();
    return std::unique_ptr<MemoryRegion>(
        new InprocRegion(p, size, core_, core_->AddRegion(p, size), std::move(buf)));
  }

  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view address,
                                                    absl::Duration) override {
    if (!absl::StartsWith(address, kScheme) || address.size() == kScheme.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", address, "' is not an inproc address (inproc://NAME)"));
    }
    const std::string name(address.substr(kScheme.size()));
    std::shared_ptr<Core> target;
    {
      Registry& r = Registry::Get();
      std::lock_guard<std::mutex> lock(r.mu);
      auto it = r.cores.find(name);
      if (it != r.cores.end()) target = it->second.lock();
    }
    if (target == nullptr) {
      return absl::UnavailableError(absl::StrCat("no inproc transport named '", name, "'"));
    }
    auto ep = std::make_shared<InprocEndpoint>(core_, target, name);
    target->TrackInbound(ep);
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(outbound_, [](const auto& w) { return w.expired(); });
    outbound_.push_back(ep);
    return std::shared_ptr<Endpoint>(ep);
  }

  void SetHandler(uint16_t id, MessageHandler handler) override {
    core_->SetHandler(id, std::move(handler));
  }

  size_t max_header_size() const override { return kMaxHeader; }

 private:
  std::shared_ptr<Core> core_;
  Capabilities caps_;
  std::mutex mu_;
  std::vector<std::weak_ptr<InprocEndpoint>> outbound_;  // failed when this transport goes
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(InprocTransportOptions options) {
  Registry& r = Registry::Get();
  std::shared_ptr<Core> core;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    std::string name = options.name;
    if (name.empty()) {
      do {
        name = absl::StrCat("inproc-", ++r.next_anonymous);
      } while (r.cores.contains(name) && !r.cores[name].expired());
    }
    auto it = r.cores.find(name);
    if (it != r.cores.end() && !it->second.expired()) {
      return absl::AlreadyExistsError(absl::StrCat("an inproc transport named '", name,
                                                   "' exists"));
    }
    core = std::make_shared<Core>(name);
    r.cores[name] = core;
  }
  core->Start();
  return std::unique_ptr<Transport>(new InprocTransport(std::move(core)));
}

}  // namespace strata::transport
