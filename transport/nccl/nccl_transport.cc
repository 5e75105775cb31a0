#include "transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/endian.h"
#include "transport/internal/failure_notifier.h"
#include "transport/internal/handler_table.h"

namespace strata::transport {
namespace {

constexpr absl::string_view kScheme = "nccl+";

// The host transport's message ids this transport uses.
constexpr uint16_t kDataId = 0;     // a user message
constexpr uint16_t kControlId = 1;  // set-up and the answers to device payloads

// A user message's host header: magic u32, user id u16, kind u8, zero u8, the receiver's link id
// u64, the sender's transfer number u64, the payload's size u64; then the user's header.
constexpr uint32_t kDataMagic = 0x314d434e;  // "NCM1"
constexpr size_t kDataPrefix = 32;
enum PayloadKind : uint8_t { kHostPayload = 0, kDevicePayload = 1 };

// A control message: magic u32, type u8, self u8, zero u16, a link id u64; then for kHello the
// two communicators' ids (connector to acceptor, acceptor to connector), for the others the
// transfer number u64. kHello names the connector's link; the others the recipient's.
constexpr uint32_t kControlMagic = 0x3143434e;  // "NCC1"
enum ControlType : uint8_t { kHello = 1, kClearToSend = 2, kDropped = 3, kReset = 4 };
constexpr size_t kControlPrefix = 16;
constexpr size_t kHelloSize = kControlPrefix + 2 * sizeof(ncclUniqueId);
constexpr size_t kAnswerSize = kControlPrefix + 8;

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

std::string NcclError(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') absl::StrAppend(&s, ": ", last);
  return s;
}

enum class Where { kHost, kThisDevice, kOtherDevice };

// Where `p` lives, as CUDA sees it. Memory CUDA does not know is host memory.
Where Locate(const void* p, int device) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return Where::kHost;
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return Where::kHost;
  return a.device == device ? Where::kThisDevice : Where::kOtherDevice;
}

// Runs `fn` with `device` current on this thread, then puts the caller's device back.
template <typename Fn>
auto OnDevice(int device, Fn fn) {
  int prev = -1;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device);
  auto result = fn();
  if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
  return result;
}

class Core;
class NcclEndpoint;

// One NCCL operation posted on a channel (or, on a self link, a send and its receive grouped),
// done once the channel's stream has passed the event recorded after it.
struct Post {
  enum Kind { kSend, kRecv, kSelf } kind = kSend;
  const void* src = nullptr;
  void* dst = nullptr;
  size_t size = 0;
  Completion send_done, recv_done;
  std::weak_ptr<NcclEndpoint> sender;  // kSend, kSelf: forgets the transfer once done
  uint64_t seq = 0;
  cudaEvent_t event = nullptr;
};

// One NCCL communicator carrying one direction of a link (both, on a self link).
struct Channel {
  // Set before the channel is shared; read-only after.
  ncclUniqueId uid{};
  int nranks = 2, rank = 0, peer = 1;
  bool sends = false, receives = false;
  // The worker thread's alone.
  enum class State { kNew, kInit, kWarmPosting, kWarm, kReady, kFailed } state = State::kNew;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t warm = nullptr;
  std::deque<Post> queue;     // waiting for the channel to be ready and free
  std::optional<Post> posting;  // its group returned ncclInProgress; no event recorded yet
  std::deque<Post> inflight;  // events recorded, in stream order
  std::string error;          // why it failed
};

// This side of a connection between two NCCL transports (or of a transport and itself).
struct Link {
  uint64_t local_id = 0, remote_id = 0;  // the connector's id is even, the acceptor's odd
  bool self = false;
  std::shared_ptr<Channel> out, in;  // the same channel on a self link
  absl::Time deadline;               // for set-up
  std::string peer;
  // Under Core::mu_.
  enum class State { kSettingUp, kReady, kFailed } state = State::kSettingUp;
  absl::Status failure;
  std::weak_ptr<NcclEndpoint> ep;
  std::map<uint64_t, absl::Status> verdicts;  // posted transfers cancelled or timed out
};

struct Job {
  enum Kind { kSetUp, kPost, kFail } kind = kSetUp;
  std::shared_ptr<Link> link;
  bool outbound = false;  // kPost: on the link's out channel (else its in channel)
  Post post;
  absl::Status status;     // kFail
  bool tell_peer = false;  // kFail: send kReset (the peer does not know yet)
  std::shared_ptr<Endpoint> host;  // kFail: where to tell it when the link's endpoint is gone
  std::vector<Completion> orphans;  // kFail: transfers of a destroyed endpoint, not yet posted
};

class NcclRegion final : public MemoryRegion {
 public:
  NcclRegion(uint8_t* data, size_t size, MemoryKind kind, std::unique_ptr<MemoryRegion> host,
             void* owned_device, int device)
      : MemoryRegion(data, size, kind),
        host_(std::move(host)),
        owned_device_(owned_device),
        device_(device) {}
  ~NcclRegion() override {
    if (owned_device_ != nullptr) OnDevice(device_, [&] { return cudaFree(owned_device_); });
  }
  absl::StatusOr<std::string> RemoteDescriptor() const override {
    return absl::UnimplementedError("the NCCL transport has no one-sided Put");
  }
  const MemoryRegion* host() const { return host_.get(); }

 private:
  std::unique_ptr<MemoryRegion> host_;  // a host region: the host transport's registration
  void* owned_device_;                  // Allocate's device memory
  int device_;
};

const MemoryRegion* HostRegionOf(const MemoryRegion* r) {
  auto* ours = dynamic_cast<const NcclRegion*>(r);
  return ours == nullptr ? nullptr : ours->host();
}

class Core : public std::enable_shared_from_this<Core> {
 public:
  // The host transport is owned by NcclTransport, which destroys it on its own thread after
  // Close(): the last reference to the Core may be dropped on the host transport's thread.
  explicit Core(NcclTransportOptions options)
      : options_(std::move(options)),
        host_(options_.host.get()),
        max_header_(host_->max_header_size() - kDataPrefix) {
    options_.host.reset();
    std::random_device rd;
    next_link_ = (static_cast<uint64_t>(rd()) << 32 | rd()) & ~uint64_t{0xffff};
  }

  void Start();
  void Close();

  int device() const { return options_.device; }
  Transport& host() const { return *host_; }
  size_t max_header() const { return max_header_; }

  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view address,
                                                    absl::Duration timeout);
  void SetHandler(uint16_t id, MessageHandler h) { handlers_.Set(id, std::move(h)); }

  void Enqueue(Job job);
  void Wake() {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    wake_ = true;
    jobs_cv_.notify_one();
  }

  // Everything below is for NcclEndpoint and NcclMessage.
  absl::Status LinkFailureIfFailed(const Link& link) {
    std::lock_guard<std::mutex> lock(mu_);
    return link.state == Link::State::kFailed ? link.failure : absl::OkStatus();
  }
  std::mutex mu_;
  std::multimap<absl::Time, std::pair<std::weak_ptr<NcclEndpoint>, uint64_t>> deadlines_;
  struct SelfRecv {
    void* dst;
    size_t size;
    Completion done;
  };
  std::map<std::pair<uint64_t, uint64_t>, SelfRecv> self_recvs_;  // (receiving link, transfer)

  // A device transfer cancelled or past its deadline after it was announced: completes it with
  // `verdict` (now, or when the reset stops its posted send) and resets its link.
  void ResetForTransfer(const std::shared_ptr<NcclEndpoint>& ep, uint64_t seq,
                        absl::Status verdict);
  void SendControl(Endpoint& host_ep, ControlType type, uint64_t link, uint64_t seq);

 private:
  void OnData(IncomingMessage& m);
  void OnControl(IncomingMessage& m);
  void Loop();
  bool Step(Channel& ch, const std::shared_ptr<Link>& owner, absl::Time now);
  void Issue(Channel& ch, Post& p);
  // Records the event after `p` on the channel's stream and moves it in flight.
  void Record(Channel& ch, Post& p);
  absl::Status LinkFailure(const Link& link) {
    std::lock_guard<std::mutex> lock(mu_);
    return link.failure.ok() ? absl::UnavailableError("the NCCL link failed") : link.failure;
  }
  void Finish(Post& p, const absl::Status& s, const Link* link);
  // Aborts the link's communicators, then completes everything on it with `why`; with
  // `tell_peer`, sends the peer kReset over the link endpoint's host connection (or over
  // `fallback`, that of an endpoint being destroyed).
  void FailLink(const std::shared_ptr<Link>& link, const absl::Status& why, bool tell_peer,
                Endpoint* fallback = nullptr);
  void MarkReady(const std::shared_ptr<Link>& link);
  cudaEvent_t GetEvent();

  NcclTransportOptions options_;  // less the host
  Transport* host_;
  size_t max_header_;
  internal::HandlerTable handlers_;
  std::thread worker_;

  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
  bool closing_ = false;  // under jobs_mu_
  bool wake_ = false;     // under jobs_mu_: look at the deadlines again

  // Under mu_.
  std::condition_variable link_cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Link>> links_;
  std::vector<std::shared_ptr<NcclEndpoint>> inbound_;  // endpoints peers connected to
  uint64_t next_link_ = 0;
  bool closed_ = false;

  // The worker's alone.
  std::vector<std::pair<std::shared_ptr<Channel>, std::weak_ptr<Link>>> channels_;
  std::vector<cudaEvent_t> free_events_;
  uint8_t* scratch_ = nullptr;  // the warm-ups' bytes (their values do not matter)
};

class NcclEndpoint final : public Endpoint, public std::enable_shared_from_this<NcclEndpoint> {
 public:
  NcclEndpoint(std::shared_ptr<Core> core, std::shared_ptr<Endpoint> host,
               std::shared_ptr<Link> link)
      : core_(std::move(core)), host_(std::move(host)), link_(std::move(link)) {}

  // Fails this endpoint's link when its host connection fails. Called once, after construction.
  void WatchHost() {
    std::weak_ptr<Core> core = core_;
    std::weak_ptr<Link> link = link_;
    host_failure_ = host_->OnFailure([core, link](const absl::Status& s) {
      auto c = core.lock();
      auto l = link.lock();
      if (c == nullptr || l == nullptr) return;
      Job j;
      j.kind = Job::kFail;
      j.link = l;
      j.status = absl::UnavailableError(
          absl::StrCat("the host connection of NCCL peer ", l->peer, " failed: ", s.message()));
      c->Enqueue(std::move(j));
    });
  }

  ~NcclEndpoint() override {
    host_->RemoveFailureCallback(host_failure_);
    Job j;  // nobody can use the link any more: give its communicators back
    j.kind = Job::kFail;
    j.link = link_;
    j.status = absl::UnavailableError(absl::StrCat("the endpoint to NCCL peer ", link_->peer,
                                                   " was closed"));
    j.tell_peer = true;
    j.host = host_;
    // No other thread reaches out_ now (they find this endpoint through weak pointers, which
    // have expired). Posted transfers complete with their channel.
    for (auto& [seq, o] : out_) {
      if (o.device && !o.posted && o.done) j.orphans.push_back(std::move(o.done));
    }
    core_->Enqueue(std::move(j));
  }

  uint64_t Send(uint16_t id, std::span<const uint8_t> header, Payload payload,
                absl::Duration timeout, Completion done) override;

  uint64_t Put(Payload, absl::string_view, uint64_t, absl::Duration, Completion done) override {
    done(absl::UnimplementedError("the NCCL transport has no one-sided Put; use Send"));
    return 0;
  }

  void Cancel(uint64_t transfer_id) override;
  absl::Status health() const override { return notifier_.health(); }
  uint64_t OnFailure(std::function<void(const absl::Status&)> fn) override {
    return notifier_.Add(std::move(fn));
  }
  void RemoveFailureCallback(uint64_t handle) override { notifier_.Remove(handle); }
  std::string peer() const override { return absl::StrCat(kScheme, host_->peer()); }
  std::string Describe() const override {
    return absl::StrCat("nccl", link_->self ? " (to itself)" : "", "; host: ", host_->Describe());
  }

  Endpoint& host_endpoint() const { return *host_; }
  Core& core() const { return *core_; }
  void Forget(uint64_t seq);
  const std::shared_ptr<Link>& link() const { return link_; }
  void Fail(const absl::Status& s) { notifier_.Fail(s); }

  // A transfer not yet complete. Under Core::mu_.
  struct Outgoing {
    bool device = false;
    const uint8_t* src = nullptr;
    size_t size = 0;
    Completion done;  // device, until posted
    bool posted = false;
    uint64_t host_id = 0;  // host payload: the host transport's transfer
    bool host_id_known = false;
    bool cancel = false;  // host payload: cancelled before its host id was known
  };
  std::map<uint64_t, Outgoing> out_;
  uint64_t next_seq_ = 0;

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<Endpoint> host_;
  std::shared_ptr<Link> link_;
  uint64_t host_failure_ = 0;
  internal::FailureNotifier notifier_;
};

uint64_t NcclEndpoint::Send(uint16_t id, std::span<const uint8_t> header, Payload payload,
                            absl::Duration timeout, Completion done) {
  if (absl::Status s = internal::CheckMessageId(id); !s.ok()) {
    done(s);
    return 0;
  }
  if (header.size() > core_->max_header()) {
    done(absl::InvalidArgumentError(absl::StrCat("header of ", header.size(),
                                                 " bytes; the NCCL transport takes at most ",
                                                 core_->max_header())));
    return 0;
  }
  const Where where =
      payload.bytes.empty() ? Where::kHost : Locate(payload.bytes.data(), core_->device());
  if (where == Where::kOtherDevice) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "the payload is memory of another CUDA device; this NCCL transport is on device ",
        core_->device())));
    return 0;
  }
  const bool device = where == Where::kThisDevice;
  uint64_t seq = 0;
  absl::Status failed;
  {
    // Checked under the lock FailLink takes, so no transfer is added to a failed link.
    std::lock_guard<std::mutex> lock(core_->mu_);
    if (link_->state == Link::State::kFailed) {
      failed = link_->failure;
    } else {
      seq = ++next_seq_;
      Outgoing& o = out_[seq];
      o.device = device;
      o.src = payload.bytes.data();
      o.size = payload.bytes.size();
      if (device) {
        o.done = std::move(done);
        if (timeout != absl::InfiniteDuration()) {
          core_->deadlines_.emplace(absl::Now() + timeout, std::make_pair(weak_from_this(), seq));
        }
      }
    }
  }
  if (!failed.ok()) {
    done(failed);
    return 0;
  }
  if (device && timeout != absl::InfiniteDuration()) core_->Wake();

  std::vector<uint8_t> msg(kDataPrefix + header.size());
  StoreLE<uint32_t>(msg.data(), kDataMagic);
  StoreLE<uint16_t>(msg.data() + 4, id);
  msg[6] = device ? kDevicePayload : kHostPayload;
  StoreLE<uint64_t>(msg.data() + 8, link_->remote_id);
  StoreLE<uint64_t>(msg.data() + 16, seq);
  StoreLE<uint64_t>(msg.data() + 24, payload.bytes.size());
  if (!header.empty()) std::memcpy(msg.data() + kDataPrefix, header.data(), header.size());

  std::weak_ptr<NcclEndpoint> self = weak_from_this();
  if (!device) {
    const uint64_t host_id = host_->Send(
        kDataId, msg, Payload{payload.bytes, HostRegionOf(payload.region)}, timeout,
        [self, seq, done = std::move(done)](absl::Status s) mutable {
          if (auto ep = self.lock()) ep->Forget(seq);
          done(std::move(s));
        });
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lock(core_->mu_);
      auto it = out_.find(seq);
      if (it != out_.end()) {
        it->second.host_id = host_id;
        it->second.host_id_known = true;
        cancel = it->second.cancel;
      }
    }
    if (cancel) host_->Cancel(host_id);
    return seq;
  }
  // A device payload: announce it; the receiver's answer (kClearToSend or kDropped) goes on.
  host_->Send(kDataId, msg, Payload{}, timeout, [self, seq](absl::Status s) {
    if (s.ok()) return;
    auto ep = self.lock();
    if (ep == nullptr) return;
    ep->core().ResetForTransfer(ep, seq, absl::Status(s.code(), absl::StrCat(
        "announcing a device payload failed: ", s.message())));
  });
  return seq;
}

void NcclEndpoint::Forget(uint64_t seq) {
  std::lock_guard<std::mutex> lock(core_->mu_);
  out_.erase(seq);
}

void NcclEndpoint::Cancel(uint64_t transfer_id) {
  uint64_t host_id = 0;
  bool host_cancel = false, device = false;
  {
    std::lock_guard<std::mutex> lock(core_->mu_);
    auto it = out_.find(transfer_id);
    if (it == out_.end()) return;  // finished (or never was)
    if (it->second.device) {
      device = true;
    } else if (it->second.host_id_known) {
      host_id = it->second.host_id;
      host_cancel = true;
    } else {
      it->second.cancel = true;  // Send cancels it once the host transport's id is known
    }
  }
  if (host_cancel) host_->Cancel(host_id);
  if (device) {
    core_->ResetForTransfer(shared_from_this(), transfer_id,
                            absl::CancelledError("NCCL transfer cancelled"));
  }
}

// A message arriving through the host transport, as the user's handler sees it.
class NcclMessage final : public IncomingMessage {
 public:
  NcclMessage(Core& core, IncomingMessage& host, std::shared_ptr<NcclEndpoint> ep,
              std::shared_ptr<Link> link, bool device, uint64_t seq, uint64_t size)
      : core_(core),
        host_(host),
        ep_(std::move(ep)),
        link_(std::move(link)),
        device_(device),
        seq_(seq),
        size_(size) {}

  std::span<const uint8_t> header() const override {
    return host_.header().subspan(kDataPrefix);
  }
  size_t payload_size() const override { return device_ ? size_ : host_.payload_size(); }
  std::shared_ptr<Endpoint> endpoint() const override { return ep_; }

  void Accept(Destination dest, Completion done) override {
    if (accepted_) {
      done(absl::FailedPreconditionError("Accept called twice"));
      return;
    }
    if (dest.bytes.size() != payload_size()) {
      done(absl::InvalidArgumentError(absl::StrCat("Accept: destination of ", dest.bytes.size(),
                                                   " bytes for a payload of ",
                                                   payload_size())));
      return;
    }
    const Where where =
        dest.bytes.empty() ? Where::kHost : Locate(dest.bytes.data(), core_.device());
    if (!device_) {
      if (where != Where::kHost) {
        done(absl::InvalidArgumentError(
            "Accept: this payload is host memory (it came over the host transport); its "
            "destination must be host memory too"));
        return;
      }
      accepted_ = true;
      host_.Accept(Destination{dest.bytes, HostRegionOf(dest.region)}, std::move(done));
      return;
    }
    if (where != Where::kThisDevice) {
      done(absl::InvalidArgumentError(absl::StrCat(
          "Accept: a device payload is received into memory of CUDA device ", core_.device(),
          "; the destination is ", where == Where::kHost ? "host memory" : "another device's")));
      return;
    }
    accepted_ = true;
    if (link_->self) {
      absl::Status failed;
      {
        std::lock_guard<std::mutex> lock(core_.mu_);
        if (link_->state == Link::State::kFailed) {
          failed = link_->failure;  // FailLink has run: nobody would complete it
        } else {
          core_.self_recvs_[{link_->local_id, seq_}] =
              Core::SelfRecv{dest.bytes.data(), dest.bytes.size(), std::move(done)};
        }
      }
      if (!failed.ok()) {
        done(failed);
        return;
      }
    } else {
      absl::Status failed = core_.LinkFailureIfFailed(*link_);
      if (!failed.ok()) {  // its sender has been told (kReset) or told this side
        done(failed);
        return;
      }
      Job j;
      j.kind = Job::kPost;
      j.link = link_;
      j.outbound = false;
      j.post.kind = Post::kRecv;
      j.post.dst = dest.bytes.data();
      j.post.size = dest.bytes.size();
      j.post.recv_done = std::move(done);
      core_.Enqueue(std::move(j));
    }
    // In the order the receives were queued: the sender posts its sends in this order.
    core_.SendControl(ep_->host_endpoint(), kClearToSend, link_->remote_id, seq_);
  }

  bool accepted() const { return accepted_; }

 private:
  Core& core_;
  IncomingMessage& host_;
  std::shared_ptr<NcclEndpoint> ep_;
  std::shared_ptr<Link> link_;
  bool device_;
  uint64_t seq_, size_;
  bool accepted_ = false;
};

void Core::Start() {
  std::weak_ptr<Core> weak = weak_from_this();
  host_->SetHandler(kDataId, [weak](IncomingMessage& m) {
    if (auto c = weak.lock()) c->OnData(m);
  });
  host_->SetHandler(kControlId, [weak](IncomingMessage& m) {
    if (auto c = weak.lock()) c->OnControl(m);
  });
  worker_ = std::thread([this] { Loop(); });
}

void Core::Close() {
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    closing_ = true;
    jobs_cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
  host_->SetHandler(kDataId, nullptr);
  host_->SetHandler(kControlId, nullptr);
  handlers_.Clear();
  std::vector<std::shared_ptr<NcclEndpoint>> inbound;
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbound.swap(inbound_);
  }
  // Their destructors enqueue jobs the closed worker completes at once.
}

void Core::Enqueue(Job job) {
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    if (!closing_) {
      jobs_.push_back(std::move(job));
      jobs_cv_.notify_one();
      return;
    }
  }
  // Shut down: a receive posted now completes at once; failures have already happened.
  const absl::Status gone = absl::UnavailableError("the NCCL transport shut down");
  if (job.kind == Job::kPost) {
    if (job.post.send_done) job.post.send_done(gone);
    if (job.post.recv_done) job.post.recv_done(gone);
  }
  for (Completion& done : job.orphans) done(gone);
}

void Core::SendControl(Endpoint& host_ep, ControlType type, uint64_t link, uint64_t seq) {
  uint8_t msg[kAnswerSize] = {};
  StoreLE<uint32_t>(msg, kControlMagic);
  msg[4] = type;
  StoreLE<uint64_t>(msg + 8, link);
  StoreLE<uint64_t>(msg + 16, seq);
  // A failure here fails the host connection, and with it the link.
  host_ep.Send(kControlId, msg, Payload{}, absl::InfiniteDuration(), [](absl::Status) {});
}

absl::StatusOr<std::shared_ptr<Endpoint>> Core::Connect(absl::string_view address,
                                                        absl::Duration timeout) {
  if (!absl::StartsWith(address, kScheme)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL transport address '", address, "' does not start with ", kScheme));
  }
  const absl::string_view host_address = address.substr(kScheme.size());
  const absl::Time start = absl::Now();
  auto host_ep = host_->Connect(host_address, timeout);
  if (!host_ep.ok()) return host_ep.status();

  auto link = std::make_shared<Link>();
  link->self = host_address == host_->address();
  link->peer = std::string(address);
  link->deadline = absl::Now() + options_.setup_timeout;
  ncclUniqueId ids[2] = {};
  for (int i = 0; i < (link->self ? 1 : 2); ++i) {
    if (ncclResult_t r = ncclGetUniqueId(&ids[i]); r != ncclSuccess) {
      return absl::UnavailableError(
          absl::StrCat("ncclGetUniqueId failed: ", NcclError(r, nullptr)));
    }
  }
  link->out = std::make_shared<Channel>();
  link->out->uid = ids[0];
  link->out->rank = 0;
  if (link->self) {
    link->out->nranks = 1;
    link->out->peer = 0;
    link->out->sends = link->out->receives = true;
    link->in = link->out;
  } else {
    link->out->sends = true;
    link->in = std::make_shared<Channel>();
    link->in->uid = ids[1];
    link->in->receives = true;
  }
  auto ep = std::make_shared<NcclEndpoint>(shared_from_this(), *std::move(host_ep), link);
  link->ep = ep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return absl::UnavailableError("the NCCL transport shut down");
    link->local_id = (next_link_ += 2);
    link->remote_id = link->local_id + 1;
    links_[link->local_id] = link;
  }
  ep->WatchHost();

  uint8_t hello[kHelloSize] = {};
  StoreLE<uint32_t>(hello, kControlMagic);
  hello[4] = kHello;
  hello[5] = link->self ? 1 : 0;
  StoreLE<uint64_t>(hello + 8, link->local_id);
  std::memcpy(hello + kControlPrefix, &ids[0], sizeof(ncclUniqueId));
  std::memcpy(hello + kControlPrefix + sizeof(ncclUniqueId), &ids[1], sizeof(ncclUniqueId));
  ep->host_endpoint().Send(kControlId, hello, Payload{}, timeout, [](absl::Status) {});

  Job j;
  j.kind = Job::kSetUp;
  j.link = link;
  Enqueue(std::move(j));

  const absl::Time deadline = start + timeout + options_.setup_timeout;
  std::unique_lock<std::mutex> lock(mu_);
  while (link->state == Link::State::kSettingUp && !closed_) {
    if (deadline == absl::InfiniteFuture()) {
      link_cv_.wait(lock);
    } else if (absl::Now() >= deadline) {
      break;
    } else {
      link_cv_.wait_for(lock, absl::ToChronoNanoseconds(deadline - absl::Now()));
    }
  }
  if (link->state == Link::State::kReady) return std::shared_ptr<Endpoint>(std::move(ep));
  absl::Status why = link->state == Link::State::kFailed
                         ? link->failure
                         : absl::UnavailableError(absl::StrCat(
                               "NCCL set-up with ", address, " did not finish within ",
                               absl::FormatDuration(deadline - start)));
  lock.unlock();
  return why;  // dropping `ep` resets the link
}

void Core::OnControl(IncomingMessage& m) {
  const std::span<const uint8_t> h = m.header();
  if (h.size() < kControlPrefix || LoadLE<uint32_t>(h.data()) != kControlMagic) return;
  const uint8_t type = h[4];
  const uint64_t link_id = LoadLE<uint64_t>(h.data() + 8);

  if (type == kHello) {
    if (h.size() != kHelloSize || (link_id & 1) != 0) return;
    const bool self = h[5] != 0;
    auto link = std::make_shared<Link>();
    link->local_id = link_id + 1;
    link->remote_id = link_id;
    link->self = self;
    link->deadline = absl::Now() + options_.setup_timeout;
    link->peer = absl::StrCat(kScheme, m.endpoint()->peer());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || links_.contains(link->local_id)) return;
      if (self) {
        auto it = links_.find(link_id);  // the connector's side: this transport's own
        if (it == links_.end()) return;
        link->out = link->in = it->second->out;
      }
    }
    if (!self) {
      link->in = std::make_shared<Channel>();
      std::memcpy(&link->in->uid, h.data() + kControlPrefix, sizeof(ncclUniqueId));
      link->in->rank = 1;
      link->in->peer = 0;
      link->in->receives = true;
      link->out = std::make_shared<Channel>();
      std::memcpy(&link->out->uid, h.data() + kControlPrefix + sizeof(ncclUniqueId),
                  sizeof(ncclUniqueId));
      link->out->rank = 1;
      link->out->peer = 0;
      link->out->sends = true;
    }
    auto ep = std::make_shared<NcclEndpoint>(shared_from_this(), m.endpoint(), link);
    link->ep = ep;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      links_[link->local_id] = link;
      inbound_.push_back(ep);
      if (self) {  // one channel, set up by the connector's side
        auto it = links_.find(link_id);
        if (it != links_.end() && it->second->state == Link::State::kReady) {
          link->state = Link::State::kReady;
        }
      }
    }
    ep->WatchHost();
    if (!self) {
      Job j;
      j.kind = Job::kSetUp;
      j.link = link;
      Enqueue(std::move(j));
    }
    return;
  }

  if (h.size() != kAnswerSize) return;
  const uint64_t seq = LoadLE<uint64_t>(h.data() + 16);
  std::shared_ptr<Link> link;
  std::shared_ptr<NcclEndpoint> ep;
  Completion dropped;
  std::optional<Job> post;
  bool broken = false;  // a self link's answer without its receive: cannot happen
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(link_id);
    if (it == links_.end()) return;  // gone: failed, or never was
    link = it->second;
    ep = link->ep.lock();
    if (type == kReset || ep == nullptr) {
      // handled below, outside the lock
    } else {
      auto o = ep->out_.find(seq);
      if (o == ep->out_.end() || !o->second.device || o->second.posted) return;
      if (type == kDropped) {
        dropped = std::move(o->second.done);
        ep->out_.erase(o);
      } else if (type == kClearToSend) {
        auto r = self_recvs_.end();
        if (link->self) {
          r = self_recvs_.find({link->remote_id, seq});  // Accept stores it before answering
          broken = r == self_recvs_.end();
        }
        if (!broken) {
          o->second.posted = true;
          Job j;
          j.kind = Job::kPost;
          j.link = link;
          j.outbound = true;
          j.post.kind = link->self ? Post::kSelf : Post::kSend;
          j.post.src = o->second.src;
          j.post.size = o->second.size;
          j.post.send_done = std::move(o->second.done);
          j.post.sender = ep;
          j.post.seq = seq;
          if (link->self) {
            j.post.dst = r->second.dst;
            j.post.recv_done = std::move(r->second.done);
            self_recvs_.erase(r);
          }
          post = std::move(j);
        }
      }
    }
  }
  if (dropped) dropped(absl::OkStatus());
  if (post) Enqueue(*std::move(post));
  if (type == kReset || broken) {
    Job j;
    j.kind = Job::kFail;
    j.link = link;
    j.status = absl::UnavailableError(
        type == kReset ? absl::StrCat("NCCL peer ", link->peer, " reset the link")
                       : absl::StrCat("NCCL link to ", link->peer,
                                      ": clear-to-send for a transfer with no receive"));
    Enqueue(std::move(j));
  }
}

void Core::OnData(IncomingMessage& m) {
  const std::span<const uint8_t> h = m.header();
  if (h.size() < kDataPrefix || LoadLE<uint32_t>(h.data()) != kDataMagic) return;
  const uint16_t id = LoadLE<uint16_t>(h.data() + 4);
  const uint8_t kind = h[6];
  if (kind != kHostPayload && kind != kDevicePayload) return;
  const bool device = kind == kDevicePayload;
  const uint64_t link_id = LoadLE<uint64_t>(h.data() + 8);
  const uint64_t seq = LoadLE<uint64_t>(h.data() + 16);
  const uint64_t size = LoadLE<uint64_t>(h.data() + 24);
  std::shared_ptr<Link> link;
  std::shared_ptr<NcclEndpoint> ep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(link_id);
    if (it != links_.end()) {
      link = it->second;
      ep = link->ep.lock();
    }
  }
  if (ep == nullptr || (device && m.payload_size() != 0)) {
    // No link (failed, or never was), its endpoint gone, or a malformed announcement: a device
    // payload's sender waits for an answer; tell it the link is gone.
    if (device) SendControl(*m.endpoint(), kReset, link_id ^ 1, seq);
    return;
  }
  NcclMessage msg(*this, m, ep, link, device, seq, size);
  if (std::shared_ptr<MessageHandler> handler = handlers_.Get(id)) (*handler)(msg);
  if (device && !msg.accepted()) SendControl(ep->host_endpoint(), kDropped, link->remote_id, seq);
}

void Core::ResetForTransfer(const std::shared_ptr<NcclEndpoint>& ep, uint64_t seq,
                            absl::Status verdict) {
  Completion done;
  const std::shared_ptr<Link>& link = ep->link();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ep->out_.find(seq);
    if (it == ep->out_.end() || !it->second.device) return;  // finished
    if (it->second.posted) {
      link->verdicts[seq] = verdict;  // completes when the reset has stopped its send
    } else {
      done = std::move(it->second.done);
      ep->out_.erase(it);
    }
  }
  if (done) done(verdict);
  Job j;
  j.kind = Job::kFail;
  j.link = link;
  j.status = absl::UnavailableError(absl::StrCat(
      "the NCCL link to ", link->peer, " was reset: transfer ", seq, " ended (",
      verdict.message(), ") after it was announced, and NCCL cannot recall a posted operation"));
  j.tell_peer = true;
  Enqueue(std::move(j));
}

cudaEvent_t Core::GetEvent() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) return nullptr;
  return e;
}

void Core::MarkReady(const std::shared_ptr<Link>& link) {
  std::lock_guard<std::mutex> lock(mu_);
  auto ready = [](const Link& l) {
    return l.out->state == Channel::State::kReady && l.in->state == Channel::State::kReady;
  };
  // Channel states are the worker's; this runs on the worker.
  if (link->state == Link::State::kSettingUp && ready(*link)) link->state = Link::State::kReady;
  if (link->self) {
    auto it = links_.find(link->local_id ^ 1);
    if (it != links_.end() && it->second->state == Link::State::kSettingUp) {
      it->second->state = Link::State::kReady;
    }
  }
  link_cv_.notify_all();
}

void Core::Finish(Post& p, const absl::Status& s, const Link* link) {
  if (p.event != nullptr) {
    free_events_.push_back(p.event);
    p.event = nullptr;
  }
  absl::Status send_status = s;
  if (auto ep = p.sender.lock(); ep != nullptr && (p.kind == Post::kSend || p.kind == Post::kSelf)) {
    std::lock_guard<std::mutex> lock(mu_);
    ep->out_.erase(p.seq);
    if (link != nullptr && !s.ok()) {
      auto v = ep->link()->verdicts.find(p.seq);
      if (v != ep->link()->verdicts.end()) {
        send_status = v->second;
        ep->link()->verdicts.erase(v);
      }
    }
  }
  if (p.send_done) std::exchange(p.send_done, nullptr)(send_status);
  if (p.recv_done) std::exchange(p.recv_done, nullptr)(s);
}

void Core::Issue(Channel& ch, Post& p) {
  ncclGroupStart();
  ncclResult_t r = ncclSuccess;
  if (p.kind == Post::kSend || p.kind == Post::kSelf) {
    r = ncclSend(p.src, p.size, ncclUint8, ch.peer, ch.comm, ch.stream);
  }
  if (r == ncclSuccess && (p.kind == Post::kRecv || p.kind == Post::kSelf)) {
    r = ncclRecv(p.dst, p.size, ncclUint8, ch.peer, ch.comm, ch.stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess) r = end;
  if (r == ncclInProgress) {
    ch.posting = std::move(p);
    return;
  }
  if (r != ncclSuccess) {
    ch.state = Channel::State::kFailed;
    ch.error = absl::StrCat(p.kind == Post::kRecv ? "ncclRecv" : "ncclSend", " failed: ",
                            NcclError(r, ch.comm));
    ch.posting = std::move(p);  // fails with the channel
    return;
  }
  Record(ch, p);
}

void Core::Record(Channel& ch, Post& p) {
  p.event = GetEvent();
  if (p.event == nullptr) {
    ch.state = Channel::State::kFailed;
    ch.error = "cudaEventCreate failed";
  } else if (const cudaError_t e = cudaEventRecord(p.event, ch.stream); e != cudaSuccess) {
    ch.state = Channel::State::kFailed;
    ch.error = absl::StrCat("cudaEventRecord failed: ", CudaError(e));
  }
  ch.inflight.push_back(std::move(p));  // failed or not: it completes with the channel
}

// Advances one channel. Returns whether it is busy (the worker should poll again soon). On an
// error it sets the channel kFailed with the reason, which the caller turns into the link's
// failure.
bool Core::Step(Channel& ch, const std::shared_ptr<Link>& owner, absl::Time now) {
  using S = Channel::State;
  auto fail = [&](std::string what) {
    ch.state = S::kFailed;
    ch.error = std::move(what);
    return false;
  };
  // NCCL's state of the communicator: ncclSuccess, ncclInProgress, or the error (then failed).
  auto comm_state = [&](const char* during) {
    ncclResult_t a = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(ch.comm, &a);
    if (r != ncclSuccess) a = r;
    if (a != ncclSuccess && a != ncclInProgress) {
      fail(absl::StrCat(during, ": ", NcclError(a, ch.comm)));
    }
    return a;
  };
  auto past_setup = [&](const char* during) {
    if (now <= owner->deadline) return true;
    return fail(absl::StrCat(during, " did not finish within ",
                             absl::FormatDuration(options_.setup_timeout)));
  };
  switch (ch.state) {
    case S::kNew:
    case S::kFailed:
      return false;
    case S::kInit:
    case S::kWarmPosting: {
      const bool init = ch.state == S::kInit;
      const ncclResult_t a = comm_state(init ? "ncclCommInitRank" : "the first send/recv");
      if (a == ncclInProgress) return past_setup(init ? "ncclCommInitRank" : "the first send/recv");
      if (a != ncclSuccess) return false;
      if (init) {
        // One byte each way that this channel carries: NCCL connects the pair now, not on the
        // first block.
        ncclGroupStart();
        if (ch.sends) ncclSend(scratch_, 1, ncclUint8, ch.peer, ch.comm, ch.stream);
        if (ch.receives) ncclRecv(scratch_ + 1, 1, ncclUint8, ch.peer, ch.comm, ch.stream);
        const ncclResult_t r = ncclGroupEnd();
        if (r == ncclInProgress) {
          ch.state = S::kWarmPosting;
          return true;
        }
        if (r != ncclSuccess) return fail(absl::StrCat("the first send/recv: ", NcclError(r, ch.comm)));
      }
      if (const cudaError_t e = cudaEventCreateWithFlags(&ch.warm, cudaEventDisableTiming);
          e != cudaSuccess) {
        return fail(absl::StrCat("cudaEventCreate failed: ", CudaError(e)));
      }
      if (const cudaError_t e = cudaEventRecord(ch.warm, ch.stream); e != cudaSuccess) {
        return fail(absl::StrCat("cudaEventRecord failed: ", CudaError(e)));
      }
      ch.state = S::kWarm;
      return true;
    }
    case S::kWarm: {
      const cudaError_t e = cudaEventQuery(ch.warm);
      if (e == cudaErrorNotReady) return past_setup("the first send/recv");
      if (e != cudaSuccess) return fail(absl::StrCat("the first send/recv: ", CudaError(e)));
      ch.state = S::kReady;
      MarkReady(owner);
      [[fallthrough]];
    }
    case S::kReady: {
      if (ch.posting) {
        const ncclResult_t a = comm_state("posting a send/recv");
        if (a == ncclInProgress) return true;
        if (a != ncclSuccess) return false;
        Post p = *std::move(ch.posting);
        ch.posting.reset();
        Record(ch, p);
        if (ch.state != S::kReady) return false;
      }
      while (!ch.posting && !ch.queue.empty() && ch.state == S::kReady) {
        Post p = std::move(ch.queue.front());
        ch.queue.pop_front();
        Issue(ch, p);
      }
      if (ch.state != S::kReady) return false;
      while (!ch.inflight.empty()) {
        const cudaError_t e = cudaEventQuery(ch.inflight.front().event);
        if (e == cudaErrorNotReady) break;
        if (e != cudaSuccess) return fail(absl::StrCat("a send/recv: ", CudaError(e)));
        Post p = std::move(ch.inflight.front());
        ch.inflight.pop_front();
        Finish(p, absl::OkStatus(), nullptr);
      }
      if (ch.inflight.empty() && !ch.posting) return false;
      // Operations wait on the peer: NCCL reports a peer's failure here.
      return comm_state("a send/recv") != ncclSuccess ? ch.state == S::kReady : true;
    }
  }
  return false;
}

void Core::FailLink(const std::shared_ptr<Link>& link, const absl::Status& why, bool tell_peer,
                    Endpoint* fallback) {
  std::vector<std::shared_ptr<Link>> links = {link};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (link->self) {
      auto it = links_.find(link->local_id ^ 1);
      if (it != links_.end() && it->second->out == link->out) links.push_back(it->second);
    }
  }
  // Stop the communicators first: nothing may complete while the GPU still reads or writes.
  std::vector<Post> dead;
  std::vector<std::shared_ptr<Channel>> channels = {link->out};
  if (link->in != link->out) channels.push_back(link->in);
  for (const auto& ch : channels) {
    if (ch->comm != nullptr) {
      (void)ncclCommAbort(ch->comm);
      ch->comm = nullptr;
    }
    if (ch->stream != nullptr) {
      (void)cudaStreamSynchronize(ch->stream);
      (void)cudaStreamDestroy(ch->stream);
      ch->stream = nullptr;
    }
    if (ch->warm != nullptr) {
      (void)cudaEventDestroy(ch->warm);
      ch->warm = nullptr;
    }
    if (ch->posting) dead.push_back(*std::move(ch->posting));
    ch->posting.reset();
    for (auto& p : ch->inflight) dead.push_back(std::move(p));
    for (auto& p : ch->queue) dead.push_back(std::move(p));
    ch->inflight.clear();
    ch->queue.clear();
    ch->state = Channel::State::kFailed;
  }
  std::erase_if(channels_, [&](const auto& c) {
    return c.first == link->out || c.first == link->in;
  });

  std::vector<std::pair<Completion, absl::Status>> dones;
  std::vector<std::shared_ptr<NcclEndpoint>> eps, drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& l : links) {
      const bool first = l->state != Link::State::kFailed;
      l->state = Link::State::kFailed;
      if (first) l->failure = why;
      auto it = links_.find(l->local_id);
      if (it != links_.end() && it->second == l) links_.erase(it);
      if (auto ep = l->ep.lock()) {
        for (auto o = ep->out_.begin(); o != ep->out_.end();) {
          if (o->second.device && !o->second.posted) {
            dones.emplace_back(std::move(o->second.done), why);
            o = ep->out_.erase(o);
          } else {
            ++o;
          }
        }
        std::erase_if(inbound_, [&](const auto& e) {
          if (e != ep) return false;
          drop.push_back(e);
          return true;
        });
        eps.push_back(std::move(ep));
      }
      for (auto r = self_recvs_.begin(); r != self_recvs_.end();) {
        if (r->first.first == l->local_id) {
          dones.emplace_back(std::move(r->second.done), why);
          r = self_recvs_.erase(r);
        } else {
          ++r;
        }
      }
    }
    link_cv_.notify_all();
  }
  if (tell_peer && !link->self) {
    Endpoint* host_ep = eps.empty() ? fallback : &eps.front()->host_endpoint();
    if (host_ep != nullptr) SendControl(*host_ep, kReset, link->remote_id, 0);
  }
  for (Post& p : dead) Finish(p, why, link.get());
  for (auto& [done, s] : dones) {
    if (done) done(s);
  }
  for (const auto& ep : eps) ep->Fail(why);
  eps.clear();
  drop.clear();  // their destructors enqueue kFail for a failed link: a no-op
}

void Core::Loop() {
  for (;;) {
    // Every time: a user's completion, run on this thread, may have switched devices.
    (void)cudaSetDevice(options_.device);
    std::deque<Job> jobs;
    bool closing;
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      jobs.swap(jobs_);
      closing = closing_;
      wake_ = false;
    }
    const absl::Time now = absl::Now();
    std::vector<std::pair<std::shared_ptr<NcclEndpoint>, uint64_t>> due;
    absl::Time next_deadline = absl::InfiniteFuture();
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
        auto& [ep, seq] = deadlines_.begin()->second;
        if (auto e = ep.lock()) due.emplace_back(std::move(e), seq);
        deadlines_.erase(deadlines_.begin());
      }
      if (!deadlines_.empty()) next_deadline = deadlines_.begin()->first;
    }
    for (auto& [ep, seq] : due) {
      ResetForTransfer(ep, seq, absl::DeadlineExceededError("NCCL transfer timed out"));
    }
    due.clear();

    for (Job& j : jobs) {
      const std::shared_ptr<Link>& link = j.link;
      switch (j.kind) {
        case Job::kSetUp: {
          std::vector<std::shared_ptr<Channel>> chans = {link->out};
          if (link->in != link->out) chans.push_back(link->in);
          for (const auto& ch : chans) {
            if (ch->state != Channel::State::kNew) continue;
            ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
            config.blocking = 0;
            cudaError_t e = cudaStreamCreateWithFlags(&ch->stream, cudaStreamNonBlocking);
            // cudaMalloc once per transport: cudaFree waits for the whole device, which a
            // link's failure must not.
            if (e == cudaSuccess && scratch_ == nullptr) e = cudaMalloc(&scratch_, 2);
            ncclResult_t r = ncclSuccess;
            if (e == cudaSuccess) {
              r = ncclCommInitRankConfig(&ch->comm, ch->nranks, ch->uid, ch->rank, &config);
            }
            if (e != cudaSuccess || (r != ncclSuccess && r != ncclInProgress)) {
              const std::string what = e != cudaSuccess
                                           ? CudaError(e)
                                           : absl::StrCat("ncclCommInitRank: ",
                                                          NcclError(r, ch->comm));
              FailLink(link, absl::UnavailableError(absl::StrCat(
                                 "NCCL set-up with ", link->peer, " failed: ", what)),
                       /*tell_peer=*/true);
              break;
            }
            ch->state = Channel::State::kInit;
            channels_.emplace_back(ch, link);
          }
          break;
        }
        case Job::kPost: {
          std::shared_ptr<Channel> ch = j.outbound ? link->out : link->in;
          if (ch->state == Channel::State::kFailed) {
            Finish(j.post, LinkFailure(*link), link.get());
          } else {
            ch->queue.push_back(std::move(j.post));
          }
          break;
        }
        case Job::kFail: {
          if (LinkFailureIfFailed(*link).ok()) FailLink(link, j.status, j.tell_peer, j.host.get());
          for (Completion& done : j.orphans) done(j.status);
          break;
        }
      }
    }
    jobs.clear();

    if (closing) {
      std::vector<std::shared_ptr<Link>> all;
      {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        for (auto& [id, l] : links_) all.push_back(l);
        link_cv_.notify_all();
      }
      for (const auto& l : all) {
        FailLink(l, absl::UnavailableError("the NCCL transport shut down"), /*tell_peer=*/true);
      }
      for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
      free_events_.clear();
      if (scratch_ != nullptr) (void)cudaFree(scratch_);
      scratch_ = nullptr;
      return;
    }

    bool busy = false;
    const absl::Time step_now = absl::Now();
    for (size_t i = 0; i < channels_.size(); ++i) {
      auto [ch, weak_link] = channels_[i];
      std::shared_ptr<Link> owner = weak_link.lock();
      if (owner == nullptr) continue;
      busy |= Step(*ch, owner, step_now);
      if (ch->state == Channel::State::kFailed) {
        FailLink(owner,
                 absl::UnavailableError(absl::StrCat("NCCL link with ", owner->peer, " failed: ",
                                                     ch->error)),
                 /*tell_peer=*/true);
        i = static_cast<size_t>(-1);  // channels_ changed; start over
      }
    }

    std::unique_lock<std::mutex> lock(jobs_mu_);
    if (!jobs_.empty() || closing_ || wake_) continue;
    if (busy) {
      jobs_cv_.wait_for(lock, std::chrono::microseconds(20));
    } else if (next_deadline == absl::InfiniteFuture()) {
      jobs_cv_.wait(lock);
    } else {
      jobs_cv_.wait_for(lock, absl::ToChronoNanoseconds(next_deadline - absl::Now()));
    }
  }
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::shared_ptr<Transport> host, std::shared_ptr<Core> core)
      : host_(std::move(host)), core_(std::move(core)) {
    caps_.backend = "nccl";
    caps_.one_sided = false;
    caps_.device_memory = true;
    caps_.cross_process = core_->host().capabilities().cross_process;
    caps_.maps_peer_memory = false;
  }
  // Closes the core, then destroys the host transport here (members go in reverse order).
  ~NcclTransport() override { core_->Close(); }

  const Capabilities& capabilities() const override { return caps_; }
  std::string address() const override {
    return absl::StrCat(kScheme, core_->host().address());
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* data, size_t size,
                                                         MemoryKind kind) override {
    if (data == nullptr || size == 0) {
      return absl::InvalidArgumentError("Register: empty region");
    }
    if (kind == MemoryKind::kHost) {
      auto host = core_->host().Register(data, size, kind);
      if (!host.ok()) return host.status();
      return std::unique_ptr<MemoryRegion>(std::make_unique<NcclRegion>(
          static_cast<uint8_t*>(data), size, kind, *std::move(host), nullptr, core_->device()));
    }
    if (Locate(data, core_->device()) != Where::kThisDevice) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Register: %p is not memory of CUDA device %d", data, core_->device()));
    }
    return std::unique_ptr<MemoryRegion>(std::make_unique<NcclRegion>(
        static_cast<uint8_t*>(data), size, kind, nullptr, nullptr, core_->device()));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t size, MemoryKind kind) override {
    if (size == 0) return absl::InvalidArgumentError("Allocate: empty region");
    if (kind == MemoryKind::kHost) {
      auto host = core_->host().Allocate(size, kind);
      if (!host.ok()) return host.status();
      uint8_t* data = (*host)->data();
      return std::unique_ptr<MemoryRegion>(std::make_unique<NcclRegion>(
          data, size, kind, *std::move(host), nullptr, core_->device()));
    }
    void* p = nullptr;
    const cudaError_t e = OnDevice(core_->device(), [&] { return cudaMalloc(&p, size); });
    if (e != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("Allocate: cudaMalloc of ", size,
                                                       " bytes failed: ", CudaError(e)));
    }
    return std::unique_ptr<MemoryRegion>(std::make_unique<NcclRegion>(
        static_cast<uint8_t*>(p), size, kind, nullptr, p, core_->device()));
  }

  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view address,
                                                    absl::Duration timeout) override {
    return core_->Connect(address, timeout);
  }
  void SetHandler(uint16_t id, MessageHandler handler) override {
    core_->SetHandler(id, std::move(handler));
  }
  size_t max_header_size() const override { return core_->max_header(); }

 private:
  std::shared_ptr<Transport> host_;
  std::shared_ptr<Core> core_;
  Capabilities caps_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(NcclTransportOptions options) {
  if (options.host == nullptr) {
    return absl::InvalidArgumentError("NcclTransportOptions::host is required");
  }
  if (options.host->max_header_size() < kHelloSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the host transport takes headers of at most ", options.host->max_header_size(),
        " bytes; the NCCL transport needs ", kHelloSize));
  }
  if (options.setup_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NcclTransportOptions::setup_timeout must be positive");
  }
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("the NCCL transport needs a CUDA device: ", CudaError(e)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", options.device,
                                                   " does not exist (this machine has ", count,
                                                   ")"));
  }
  std::shared_ptr<Transport> host = options.host;
  auto core = std::make_shared<Core>(std::move(options));
  core->Start();
  return std::unique_ptr<Transport>(
      std::make_unique<NcclTransport>(std::move(host), std::move(core)));
}

std::string NcclVersion() {
  int v = 0;
  if (ncclResult_t r = ncclGetVersion(&v); r != ncclSuccess) {
    return absl::StrCat("unknown (", ncclGetErrorString(r), ")");
  }
  return absl::StrCat(v / 10000, ".", v % 10000 / 100, ".", v % 100);
}

}  // namespace strata::transport
