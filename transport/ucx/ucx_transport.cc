#include "transport/ucx/ucx_transport.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "transport/internal/failure_notifier.h"
#include "transport/internal/handler_table.h"

namespace strata::transport {
namespace {

constexpr absl::string_view kScheme = "ucx://";
// What a listener's error says when its port is taken (CreateUcxTransportWaitingForPort waits
// on it).
constexpr absl::string_view kPortInUse = "the port is in use";
// Message ids the transport itself uses (connection handshake).
// Connecting: the client's connection-manager endpoint (socket address, the liveness channel)
// carries kHello{nonce}; the server answers kHelloAck{nonce, token, its worker address}. The
// client then opens a data endpoint to that worker address (UCX chooses its lanes as for any
// worker-address endpoint: single-copy shared memory between processes of one host, RDMA
// between hosts) and sends kDataHello{token, nonce} on it; the server ties the data endpoint
// to the connection by the token and answers kDataHelloAck{nonce}.
// Every message id Send accepts (kMaxMessageId) has a UCX handler from the start (ours drops a
// message nobody handles): UCX 1.13 can crash on an active message with a reply endpoint for an
// id without one (seen in ucp_am_handler_reply, for a peer that never installed the id).
constexpr uint16_t kHelloId = 0xfff0;
constexpr uint16_t kHelloAckId = 0xfff1;
constexpr uint16_t kDataHelloId = 0xfff2;
constexpr uint16_t kDataHelloAckId = 0xfff3;
constexpr uint32_t kRegionMagic = 0x52584355;  // "UCXR"

// The one adapter from UCX status to absl::Status.
absl::Status FromUcs(ucs_status_t s, absl::string_view what) {
  if (s == UCS_OK) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(s));
  switch (s) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_UNSUPPORTED:
      return absl::UnimplementedError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    default:
      return absl::UnavailableError(msg);  // unreachable, reset, rejected, endpoint timeout, I/O
  }
}

class Engine;

struct RecvOp {
  Engine* engine;
  Completion done;
  void* request = nullptr;  // UCX request while the payload is arriving
};

struct Op {
  uint64_t tid = 0;
  std::vector<uint8_t> header;
  Payload payload;
  Completion done;
  void* request = nullptr;           // UCX request while outstanding
  void* ctx = nullptr;               // its OpContext (UCX's user data), freed with it
  std::optional<absl::Status> why;   // reported instead of UCX's error (cancel, timeout, reset)
  absl::Time deadline = absl::InfiniteFuture();
  bool is_put = false;
  ucp_rkey_h rkey = nullptr;         // Put: released on completion
  std::string remote;                // Put: the descriptor
  uint64_t remote_offset = 0;
};

struct OpContext;  // a posted operation's UCX user data (defined with DoSend)

class UcxEndpoint final : public Endpoint, public std::enable_shared_from_this<UcxEndpoint> {
 public:
  UcxEndpoint(std::weak_ptr<Engine> engine, std::string peer)
      : engine_(std::move(engine)), peer_(std::move(peer)) {}
  ~UcxEndpoint() override;

  uint64_t Send(uint16_t id, std::span<const uint8_t> header, Payload payload,
                absl::Duration timeout, Completion done) override;
  uint64_t Put(Payload payload, absl::string_view remote, uint64_t remote_offset,
               absl::Duration timeout, Completion done) override;
  absl::StatusOr<std::span<uint8_t>> Map(absl::string_view remote) override;
  void Unmap(const uint8_t* base) override;
  void Cancel(uint64_t tid) override;
  absl::Status health() const override { return notifier_.health(); }
  uint64_t OnFailure(std::function<void(const absl::Status&)> fn) override {
    return notifier_.Add(std::move(fn));
  }
  void RemoveFailureCallback(uint64_t handle) override { notifier_.Remove(handle); }
  std::string peer() const override { return peer_; }
  std::string Describe() const override;

  // Progress-thread state. `ep` is the connection-manager endpoint (liveness, handshake);
  // `data_ep` carries the messages once the handshake is done.
  ucp_ep_h ep = nullptr;
  ucp_ep_h data_ep = nullptr;
  ucp_ep_h send_ep() const { return data_ep != nullptr ? data_ep : ep; }
  std::unordered_map<uint64_t, Op*> ops;
  internal::FailureNotifier notifier_;
  // Remote keys behind Map's mappings: released when the endpoint is destroyed (releasing one
  // detaches the peer's memory, which a caller holding the endpoint may still be writing) or
  // when the transport shuts down.
  std::vector<std::pair<const uint8_t*, ucp_rkey_h>> mapped_rkeys;  // by mapping address

 private:
  uint64_t Post(Op* op, uint16_t id, absl::Duration timeout);

  std::weak_ptr<Engine> engine_;
  const std::string peer_;
  std::atomic<uint64_t> next_tid_{0};
};

class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(uint8_t* data, size_t size, std::shared_ptr<Engine> engine, ucp_mem_h memh)
      : MemoryRegion(data, size, MemoryKind::kHost), engine_(std::move(engine)), memh_(memh) {}
  ~UcxRegion() override;
  absl::StatusOr<std::string> RemoteDescriptor() const override;
  ucp_mem_h memh() const { return memh_; }

 private:
  std::shared_ptr<Engine> engine_;  // keeps the UCP context alive
  ucp_mem_h memh_;
};

ucp_mem_h MemhOf(const MemoryRegion* region) {
  const auto* r = dynamic_cast<const UcxRegion*>(region);
  return r == nullptr ? nullptr : r->memh();
}

// The UCP context and worker, and the thread that drives them.
class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(UcxTransportOptions options) : options_(std::move(options)) {}
  ~Engine() {
    if (listener_ != nullptr) ucp_listener_destroy(listener_);  // only if never started
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  absl::Status Init() {
    ucp_config_t* config = nullptr;
    if (absl::Status s = FromUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
        !s.ok()) {
      return s;
    }
    if (!options_.tls.empty()) {
      if (absl::Status s = FromUcs(ucp_config_modify(config, "TLS", options_.tls.c_str()),
                                   absl::StrCat("UCX_TLS=", options_.tls));
          !s.ok()) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(s.message());
      }
    }
    // Settings for same-host peers, when shared memory may be used:
    //  - MM_ERROR_HANDLING=y: shared-memory transports take part in endpoints with peer error
    //    handling (which every endpoint here has) only when told to; without it same-host peers
    //    talk over loopback TCP.
    //  - TCP PUT_ENABLE=n: otherwise UCX 1.13 makes TCP the endpoint's RMA lane and moves every
    //    rendezvous payload over loopback TCP instead of shared memory (see docs/transport.md).
    //    Between hosts, rendezvous over TCP then runs as pipelined active messages instead.
    // Then the caller's own settings, which win.
    const bool may_use_shm = options_.tls.empty() || absl::StrContains(options_.tls, "posix") ||
                             absl::StrContains(options_.tls, "sysv") ||
                             absl::StrContains(options_.tls, "sm") ||
                             absl::StrContains(options_.tls, "all");
    std::vector<std::pair<std::string, std::string>> settings;
    if (may_use_shm) {
      settings.emplace_back("MM_ERROR_HANDLING", "y");
      // (UCX_TCP_PUT_ENABLE; through ucp_config_modify the key is the field's name alone.)
      settings.emplace_back("PUT_ENABLE", "n");
    }
    for (const auto& kv : options_.ucx_config) settings.push_back(kv);
    for (const auto& [key, value] : settings) {
      if (ucs_status_t st = ucp_config_modify(config, key.c_str(), value.c_str()); st != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(absl::StrCat("UCX setting ", key, "=", value, ": ",
                                                       ucs_status_string(st)));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                        UCP_PARAM_FIELD_NAME;
    // WAKEUP: the progress thread sleeps on UCX's event fd instead of polling when idle.
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;  // memory is registered from callers' threads
    params.name = "strata";
    ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return FromUcs(st, "ucp_init");

    ucp_context_attr_t cattr{};
    cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context_, &cattr) == UCS_OK) {
      device_memory_ = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    }

    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
    if (absl::Status s = FromUcs(ucp_worker_create(context_, &wparams, &worker_),
                                 "ucp_worker_create");
        !s.ok()) {
      return s;
    }
    for (uint16_t id : {kHelloId, kHelloAckId, kDataHelloId, kDataHelloAckId}) RegisterAm(id);
    for (uint16_t id = 0; id <= kMaxMessageId; ++id) RegisterAm(id);
    if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;  // then: timed sleeps
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    STRATA_RETURN_IF_ERROR(
        FromUcs(ucp_worker_get_address(worker_, &addr, &addr_len), "ucp_worker_get_address"));
    worker_address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(worker_, addr);

    if (!options_.listen_host.empty()) {
      STRATA_RETURN_IF_ERROR(Listen());
    }
    return absl::OkStatus();
  }

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }

  // Runs `cmd` on the progress thread (inline if called there). False once stopped.
  bool Post(std::function<void()> cmd) {
    if (OnProgressThread()) {
      cmd();
      return true;
    }
    return PostQueued(std::move(cmd));
  }

  // Wakes the progress thread from its sleep (UCX's event fd, or the condition variable). Under
  // mu_: while sleeping_ is set the thread is in its sleep, so the worker cannot be destroyed
  // under the signal.
  void WakeLocked() {
    if (!sleeping_) return;
    if (efd_ >= 0) {
      ucp_worker_signal(worker_);
    } else {
      cv_.notify_one();
    }
  }

  // Runs `cmd` on the progress thread and waits for it.
  bool Run(std::function<void()> cmd) {
    if (OnProgressThread()) {
      cmd();
      return true;
    }
    std::mutex m;
    std::condition_variable c;
    bool ran = false;
    const bool posted = Post([&] {
      cmd();
      std::lock_guard<std::mutex> lock(m);
      ran = true;
      c.notify_all();
    });
    if (!posted) return false;
    std::unique_lock<std::mutex> lock(m);
    c.wait(lock, [&] { return ran; });
    return true;
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      WakeLocked();
    }
    if (thread_.joinable()) thread_.join();
  }

  ucp_context_h context() const { return context_; }
  bool device_memory() const { return device_memory_; }
  const std::string& address() const { return address_; }

  void SetHandler(uint16_t id, MessageHandler h) { handlers_.Set(id, std::move(h)); }

  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view address,
                                                    absl::Duration timeout);

  // ---- progress thread ----
  void DoSend(const std::shared_ptr<UcxEndpoint>& ep, Op* op, uint16_t id);
  void DoPut(const std::shared_ptr<UcxEndpoint>& ep, Op* op);
  // A posted send or put UCX now holds: found by id (cancel) and by deadline (timeout).
  void Track(const std::shared_ptr<UcxEndpoint>& ep, Op* op, void* request, OpContext* ctx);
  void DoCancel(const std::shared_ptr<UcxEndpoint>& ep, uint64_t tid, absl::Status why);
  void Finish(const std::shared_ptr<UcxEndpoint>& ep, Op* op, absl::Status s);
  void CloseEndpoint(const std::shared_ptr<UcxEndpoint>& ep, absl::Status why);
  ucp_worker_h worker() const { return worker_; }
  void TrackRecv(RecvOp* op) { recvs_.insert(op); }
  void TrackMapped(ucp_rkey_h k) { mapped_rkeys_.insert(k); }
  void ReleaseMapped(ucp_rkey_h k) {
    if (mapped_rkeys_.erase(k) > 0) ucp_rkey_destroy(k);
  }
  // Like Post, but always through the queue: for calls that may come from inside a UCX callback
  // and must not make UCP calls there (progress, endpoint close).
  bool PostQueued(std::function<void()> cmd) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    commands_.push_back(std::move(cmd));
    WakeLocked();
    return true;
  }
  void FinishRecv(RecvOp* op, absl::Status s) {
    recvs_.erase(op);
    Completion fn = std::move(op->done);
    delete op;
    fn(std::move(s));
  }

 private:
  friend class UcxEndpoint;
  struct AmArg {
    Engine* engine;
    uint16_t id;
  };

  bool OnProgressThread() const { return std::this_thread::get_id() == progress_id_.load(); }

  absl::Status Listen() {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(options_.listen_port);
    if (int rc = getaddrinfo(options_.listen_host.c_str(), port.c_str(), &hints, &res); rc != 0) {
      return absl::InvalidArgumentError(absl::StrCat("listen address ", options_.listen_host,
                                                     ": ", gai_strerror(rc)));
    }
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = res->ai_addr;
    lp.sockaddr.addrlen = res->ai_addrlen;
    lp.conn_handler.cb = &Engine::OnConnRequest;
    lp.conn_handler.arg = this;
    ucs_status_t st = ucp_listener_create(worker_, &lp, &listener_);
    freeaddrinfo(res);
    if (st != UCS_OK) {
      if (st == UCS_ERR_BUSY) {  // bind: EADDRINUSE (UCX sets no SO_REUSEADDR on listeners)
        return absl::UnavailableError(absl::StrCat(
            "listen on ", options_.listen_host, ":", port, ": ", kPortInUse,
            " (another process listens there, or the connections of a previous one are in "
            "TIME_WAIT for up to a minute)"));
      }
      return FromUcs(st, absl::StrCat("listen on ", options_.listen_host, ":", port));
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    STRATA_RETURN_IF_ERROR(FromUcs(ucp_listener_query(listener_, &attr), "ucp_listener_query"));
    uint16_t bound = 0;
    if (attr.sockaddr.ss_family == AF_INET) {
      bound = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
    } else if (attr.sockaddr.ss_family == AF_INET6) {
      bound = ntohs(reinterpret_cast<const sockaddr_in6*>(&attr.sockaddr)->sin6_port);
    }
    const bool v6 = absl::StrContains(options_.listen_host, ':');
    address_ = absl::StrCat(kScheme, v6 ? "[" : "", options_.listen_host, v6 ? "]" : "", ":",
                            bound);
    return absl::OkStatus();
  }

  void RegisterAm(uint16_t id) {
    auto& arg = am_args_[id];
    if (arg == nullptr) arg = std::make_unique<AmArg>(AmArg{this, id});
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = id;
    p.cb = &Engine::OnAm;
    p.arg = arg.get();
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    ucp_worker_set_am_recv_handler(worker_, &p);
  }

  static void OnConnRequest(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Engine*>(arg);
    std::string peer = "ucx://(unknown)";
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(req, &attr) == UCS_OK) {
      char host[NI_MAXHOST], port[NI_MAXSERV];
      if (getnameinfo(reinterpret_cast<const sockaddr*>(&attr.client_address),
                      sizeof(attr.client_address), host, sizeof(host), port, sizeof(port),
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
        peer = absl::StrCat(kScheme, host, ":", port);
      }
    }
    auto ep = std::make_shared<UcxEndpoint>(self->weak_from_this(), peer);
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = req;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Engine::OnEpError;
    p.err_handler.arg = self;
    if (ucp_ep_create(self->worker_, &p, &ep->ep) != UCS_OK) return;
    self->eps_[ep->ep] = ep;
  }

  static void OnEpError(void* arg, ucp_ep_h h, ucs_status_t status) {
    auto* self = static_cast<Engine*>(arg);
    auto it = self->eps_.find(h);
    if (it == self->eps_.end()) return;
    std::shared_ptr<UcxEndpoint> ep = it->second;
    // Closing inside UCX's callback is not allowed; the loop closes it next.
    self->to_close_.emplace_back(
        ep, FromUcs(status, absl::StrCat("connection to ", ep->peer())));
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);

  void Loop();
  void CheckDeadlines();
  void Shutdown();

  const UcxTransportOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  bool device_memory_ = false;
  std::string address_;
  std::thread thread_;
  std::atomic<std::thread::id> progress_id_{};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  bool stopping_ = false;
  bool sleeping_ = false;  // the progress thread is (about to be) asleep: Post must wake it
  int efd_ = -1;           // UCX's event fd (owned by the worker)

  internal::HandlerTable handlers_;

  // Progress thread only.
  std::unordered_map<uint16_t, std::unique_ptr<AmArg>> am_args_;
  std::unordered_map<ucp_ep_h, std::shared_ptr<UcxEndpoint>> eps_;
  std::vector<std::pair<std::shared_ptr<UcxEndpoint>, absl::Status>> to_close_;
  std::vector<void*> closing_;  // ucp_ep_close_nbx requests
  std::unordered_set<RecvOp*> recvs_;  // payloads being received
  std::unordered_set<ucp_rkey_h> mapped_rkeys_;  // behind Endpoint::Map's mappings
  std::unordered_set<Op*> live_ops_;   // sends and puts UCX holds
  std::multimap<absl::Time, std::pair<std::weak_ptr<UcxEndpoint>, uint64_t>> deadlines_;
  absl::Time next_deadline_check_ = absl::InfinitePast();
  struct ConnectWait {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<absl::Status> result;
    void Set(absl::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      if (!result) result = std::move(s);
      cv.notify_all();
    }
  };
  struct Connecting {  // a client connection in its handshake, and its Connect call
    std::shared_ptr<UcxEndpoint> ep;
    std::shared_ptr<ConnectWait> wait;
  };
  std::unordered_map<uint64_t, Connecting> connecting_;                    // client, by nonce
  std::unordered_map<uint64_t, std::weak_ptr<UcxEndpoint>> accepting_;     // server, by token
  uint64_t next_nonce_ = 0;
  std::string worker_address_;

  // Sends a handshake message (payload-free) on `h`; the bytes are kept until it completes.
  void SendControl(ucp_ep_h h, uint16_t id, std::string bytes) {
    auto* copy = new std::string(std::move(bytes));
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.user_data = copy;
    p.cb.send = [](void* request, ucs_status_t, void* user) {
      ucp_request_free(request);
      delete static_cast<std::string*>(user);
    };
    ucs_status_ptr_t r = ucp_am_send_nbx(h, id, copy->data(), copy->size(), nullptr, 0, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) delete copy;
  }
  void OnHandshake(uint16_t id, std::span<const uint8_t> h, ucp_ep_h reply_ep,
                   const std::shared_ptr<UcxEndpoint>& ep);
};

// A message from UCX, for the handler.
class UcxMessage final : public IncomingMessage {
 public:
  UcxMessage(Engine* engine, std::span<const uint8_t> header, void* data, size_t length,
             bool rndv, std::shared_ptr<Endpoint> ep)
      : engine_(engine), header_(header), data_(data), length_(length), rndv_(rndv),
        ep_(std::move(ep)) {}
  std::span<const uint8_t> header() const override { return header_; }
  size_t payload_size() const override { return length_; }
  std::shared_ptr<Endpoint> endpoint() const override { return ep_; }
  bool accepted() const { return accepted_; }

  void Accept(Destination dest, Completion done) override {
    if (accepted_) {
      done(absl::FailedPreconditionError("Accept called twice"));
      return;
    }
    if (dest.bytes.size() != length_) {
      done(absl::InvalidArgumentError(absl::StrCat(
          "Accept: destination of ", dest.bytes.size(), " bytes for a payload of ", length_)));
      return;
    }
    accepted_ = true;
    if (!rndv_) {
      if (length_ > 0) std::memcpy(dest.bytes.data(), data_, length_);
      done(absl::OkStatus());
      return;
    }
    auto* cb = new RecvOp{engine_, std::move(done)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user) {
      auto* op = static_cast<RecvOp*>(user);
      ucp_request_free(request);
      op->engine->FinishRecv(op, FromUcs(status, "receiving a message's payload"));
    };
    p.user_data = cb;
    if (ucp_mem_h memh = MemhOf(dest.region); memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    ucs_status_ptr_t r =
        ucp_am_recv_data_nbx(engine_->worker(), data_, dest.bytes.data(), length_, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      Completion fn = std::move(cb->done);
      delete cb;
      fn(FromUcs(UCS_PTR_STATUS(r), "receiving a message's payload"));
    } else {
      cb->request = r;
      engine_->TrackRecv(cb);
    }
  }

 private:
  Engine* engine_;
  std::span<const uint8_t> header_;
  void* data_;
  size_t length_;
  bool rndv_;
  std::shared_ptr<Endpoint> ep_;
  bool accepted_ = false;
};

ucs_status_t Engine::OnAm(void* arg, const void* header, size_t header_length, void* data,
                          size_t length, const ucp_am_recv_param_t* param) {
  auto* a = static_cast<AmArg*>(arg);
  Engine* self = a->engine;
  std::shared_ptr<UcxEndpoint> ep;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && param->reply_ep != nullptr) {
    auto it = self->eps_.find(param->reply_ep);
    if (it != self->eps_.end()) ep = it->second;
  }
  const auto hdr = std::span<const uint8_t>(static_cast<const uint8_t*>(header), header_length);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;

  if (a->id >= kHelloId) {
    if (rndv) return UCS_ERR_INVALID_PARAM;  // handshakes carry no payload
    self->OnHandshake(a->id, hdr,
                      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep
                                                                            : nullptr,
                      ep);
    return UCS_OK;
  }

  std::shared_ptr<MessageHandler> handler = self->handlers_.Get(a->id);
  if (handler == nullptr) {
    return rndv ? UCS_ERR_UNSUPPORTED : UCS_OK;  // nobody listens: the sender learns it
  }
  UcxMessage m(self, hdr, data, length, rndv, ep);
  (*handler)(m);
  return UCS_OK;  // a rendezvous not accepted is dropped; an accepted one is already receiving
}

namespace {
template <typename T>
void AppendPod(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
bool ReadPod(std::span<const uint8_t> h, size_t at, T* v) {
  if (h.size() < at + sizeof(T)) return false;
  std::memcpy(v, h.data() + at, sizeof(T));
  return true;
}
}  // namespace

void Engine::OnHandshake(uint16_t id, std::span<const uint8_t> h, ucp_ep_h reply_ep,
                         const std::shared_ptr<UcxEndpoint>& ep) {
  uint64_t a = 0, b = 0;
  switch (id) {
    case kHelloId: {  // server, on the connection-manager endpoint
      if (ep == nullptr || ep->ep == nullptr || !ReadPod(h, 0, &a)) return;
      const uint64_t token = (static_cast<uint64_t>(getpid()) << 32) ^ ++next_nonce_ ^
                             reinterpret_cast<uintptr_t>(ep.get());
      accepting_[token] = ep;
      std::string ack;
      AppendPod(ack, a);
      AppendPod(ack, token);
      ack += worker_address_;
      SendControl(ep->ep, kHelloAckId, std::move(ack));
      return;
    }
    case kHelloAckId: {  // client: open the data endpoint
      if (!ReadPod(h, 0, &a) || !ReadPod(h, 8, &b) || h.size() <= 16) return;
      auto it = connecting_.find(a);
      if (it == connecting_.end()) return;
      std::shared_ptr<UcxEndpoint> conn = it->second.ep;
      ucp_ep_params_t p{};
      p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                     UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.address = reinterpret_cast<const ucp_address_t*>(h.data() + 16);
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = &Engine::OnEpError;
      p.err_handler.arg = this;
      if (ucs_status_t st = ucp_ep_create(worker_, &p, &conn->data_ep); st != UCS_OK) {
        conn->data_ep = nullptr;
        it->second.wait->Set(FromUcs(st, "opening the data endpoint"));
        return;
      }
      eps_[conn->data_ep] = conn;
      std::string hello;
      AppendPod(hello, b);
      AppendPod(hello, a);
      SendControl(conn->data_ep, kDataHelloId, std::move(hello));
      return;
    }
    case kDataHelloId: {  // server, on the new data endpoint (UCX made it): tie it by the token
      if (reply_ep == nullptr || !ReadPod(h, 0, &a) || !ReadPod(h, 8, &b)) return;
      auto it = accepting_.find(a);
      if (it == accepting_.end()) return;
      std::shared_ptr<UcxEndpoint> conn = it->second.lock();
      accepting_.erase(it);
      if (conn == nullptr || conn->ep == nullptr) return;
      conn->data_ep = reply_ep;
      eps_[reply_ep] = conn;
      std::string ack;
      AppendPod(ack, b);
      SendControl(reply_ep, kDataHelloAckId, std::move(ack));
      return;
    }
    case kDataHelloAckId: {  // client: connected
      if (!ReadPod(h, 0, &a)) return;
      auto it = connecting_.find(a);
      if (it != connecting_.end()) {
        it->second.wait->Set(absl::OkStatus());
        connecting_.erase(it);
      }
      return;
    }
    default:
      return;
  }
}

void Engine::Loop() {
  progress_id_.store(std::this_thread::get_id());
  absl::Time last_activity = absl::Now();
  absl::Duration sleep = absl::Microseconds(50);
  int busy_rounds = 0;
  bool idle_since_known = false;
  for (;;) {
    std::deque<std::function<void()>> cmds;
    bool stop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cmds.swap(commands_);
      stop = stopping_;
    }
    for (auto& c : cmds) c();
    if (stop) {
      Shutdown();
      progress_id_.store(std::thread::id{});
      return;
    }
    unsigned n = 0;
    for (int i = 0; i < 16; ++i) n += ucp_worker_progress(worker_);
    if (!to_close_.empty()) {
      auto closing = std::move(to_close_);
      to_close_.clear();
      for (auto& [ep, why] : closing) CloseEndpoint(ep, why);
    }
    if ((n > 0 || !cmds.empty()) && ++busy_rounds < 64) {
      idle_since_known = false;  // busy: skip the clock (it costs more than a progress call)
      continue;
    }
    busy_rounds = 0;
    const absl::Time now = absl::Now();
    if (now >= next_deadline_check_) {
      CheckDeadlines();
      std::erase_if(closing_, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
      next_deadline_check_ = now + absl::Milliseconds(1);
    }
    if (n > 0 || !cmds.empty() || !idle_since_known) {
      last_activity = now;
      idle_since_known = n == 0 && cmds.empty();
      sleep = absl::Microseconds(50);
      continue;
    }
    if (now - last_activity < options_.busy_poll) {
      // Polling, but idle: let a thread with work (the caller copying a block, a verify thread)
      // have this core if it shares it. Costs one syscall when the core is free.
      sched_yield();
      continue;
    }
    // Idle: sleep until UCX has an event, a command arrives (Post signals), or the next
    // deadline check is due.
    if (efd_ >= 0) {
      const ucs_status_t armed = ucp_worker_arm(worker_);
      if (armed == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress them
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!commands_.empty() || stopping_) continue;
        sleeping_ = true;
      }
      int timeout_ms = 100;
      if (!deadlines_.empty()) {
        const int64_t ms = absl::ToInt64Milliseconds(deadlines_.begin()->first - now) + 1;
        timeout_ms = static_cast<int>(std::clamp<int64_t>(ms, 1, 100));
      }
      pollfd pfd{.fd = efd_, .events = POLLIN, .revents = 0};
      poll(&pfd, 1, armed == UCS_OK ? timeout_ms : 1);
      std::lock_guard<std::mutex> lock(mu_);
      sleeping_ = false;
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (commands_.empty() && !stopping_) {
      sleeping_ = true;
      cv_.wait_for(lock, absl::ToChronoNanoseconds(sleep));
      sleeping_ = false;
      sleep = std::min(sleep * 2, absl::Milliseconds(1));
    }
  }
}

void Engine::CheckDeadlines() {
  const absl::Time now = absl::Now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    auto [weak, tid] = deadlines_.begin()->second;
    deadlines_.erase(deadlines_.begin());
    if (auto ep = weak.lock()) {
      DoCancel(ep, tid,
               absl::DeadlineExceededError(absl::StrCat("transfer ", tid, " to ", ep->peer(),
                                                        " did not complete within its timeout")));
    }
  }
}

void Engine::Finish(const std::shared_ptr<UcxEndpoint>& ep, Op* op, absl::Status s) {
  if (ep != nullptr) ep->ops.erase(op->tid);
  live_ops_.erase(op);
  if (op->rkey != nullptr) ucp_rkey_destroy(op->rkey);
  if (!s.ok() && op->why.has_value()) s = *op->why;
  Completion done = std::move(op->done);
  delete op;
  done(std::move(s));
}

struct OpContext {
  std::weak_ptr<UcxEndpoint> ep;
  Op* op;
  Engine* engine;
};

void Engine::DoSend(const std::shared_ptr<UcxEndpoint>& ep, Op* op, uint16_t id) {
  if (ep->ep == nullptr) {
    absl::Status h = ep->health();
    Finish(nullptr, op, h.ok() ? absl::UnavailableError("endpoint closed") : h);
    return;
  }
  auto* ctx = new OpContext{ep, op, this};
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  p.user_data = ctx;
  p.cb.send = [](void* request, ucs_status_t status, void* user) {
    auto* c = static_cast<OpContext*>(user);
    ucp_request_free(request);
    c->engine->Finish(c->ep.lock(), c->op, FromUcs(status, "send"));
    delete c;
  };
  if (ucp_mem_h memh = MemhOf(op->payload.region); memh != nullptr) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  ucs_status_ptr_t r =
      ucp_am_send_nbx(ep->send_ep(), id, op->header.data(), op->header.size(), op->payload.bytes.data(),
                      op->payload.bytes.size(), &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    delete ctx;
    Finish(nullptr, op, FromUcs(UCS_PTR_STATUS(r), absl::StrCat("send to ", ep->peer())));
    return;
  }
  Track(ep, op, r, ctx);
}

// A UCX region descriptor (UcxRegion::RemoteDescriptor): magic u32, address u64, size u64, packed
// remote key.
struct RegionDescriptor {
  uint64_t addr = 0;
  uint64_t size = 0;
  const void* packed_rkey = nullptr;
};

absl::StatusOr<RegionDescriptor> ParseRegionDescriptor(absl::string_view d, const char* what) {
  constexpr size_t kFixed = 4 + 8 + 8;
  uint32_t magic = 0;
  if (d.size() > kFixed) std::memcpy(&magic, d.data(), 4);
  if (d.size() <= kFixed || magic != kRegionMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a UCX region descriptor (", d.size(), " bytes)"));
  }
  RegionDescriptor r;
  std::memcpy(&r.addr, d.data() + 4, 8);
  std::memcpy(&r.size, d.data() + 12, 8);
  r.packed_rkey = d.data() + kFixed;
  return r;
}

void Engine::Track(const std::shared_ptr<UcxEndpoint>& ep, Op* op, void* request,
                   OpContext* ctx) {
  op->request = request;
  op->ctx = ctx;
  ep->ops[op->tid] = op;
  live_ops_.insert(op);
  if (op->deadline != absl::InfiniteFuture()) {
    deadlines_.emplace(op->deadline, std::make_pair(std::weak_ptr<UcxEndpoint>(ep), op->tid));
  }
}

void Engine::DoPut(const std::shared_ptr<UcxEndpoint>& ep, Op* op) {
  if (ep->ep == nullptr) {
    absl::Status h = ep->health();
    Finish(nullptr, op, h.ok() ? absl::UnavailableError("endpoint closed") : h);
    return;
  }
  absl::StatusOr<RegionDescriptor> desc = ParseRegionDescriptor(op->remote, "Put");
  if (!desc.ok()) {
    Finish(nullptr, op, desc.status());
    return;
  }
  const uint64_t addr = desc->addr;
  const uint64_t size = desc->size;
  const uint64_t len = op->payload.bytes.size();
  if (op->remote_offset > size || len > size - op->remote_offset) {
    Finish(nullptr, op,
           absl::OutOfRangeError(absl::StrCat("Put: ", len, " bytes at offset ", op->remote_offset,
                                              " overrun the peer's region of ", size, " bytes")));
    return;
  }
  if (ucs_status_t st = ucp_ep_rkey_unpack(ep->send_ep(), desc->packed_rkey, &op->rkey);
      st != UCS_OK) {
    Finish(nullptr, op, FromUcs(st, "Put: unpacking the remote key"));
    return;
  }
  ucp_request_param_t pp{};
  pp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  pp.cb.send = [](void* request, ucs_status_t, void*) { ucp_request_free(request); };
  if (ucp_mem_h memh = MemhOf(op->payload.region); memh != nullptr) {
    pp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    pp.memh = memh;
  }
  ucs_status_ptr_t r = ucp_put_nbx(ep->send_ep(), op->payload.bytes.data(), len,
                                   addr + op->remote_offset, op->rkey, &pp);
  if (UCS_PTR_IS_ERR(r)) {
    Finish(nullptr, op, FromUcs(UCS_PTR_STATUS(r), "Put"));
    return;
  }
  // Remote completion: a flush of the endpoint completes once the put is in the peer's memory.
  auto* ctx = new OpContext{ep, op, this};
  ucp_request_param_t fp{};
  fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  fp.user_data = ctx;
  fp.cb.send = [](void* request, ucs_status_t status, void* user) {
    auto* c = static_cast<OpContext*>(user);
    ucp_request_free(request);
    c->engine->Finish(c->ep.lock(), c->op, FromUcs(status, "Put"));
    delete c;
  };
  ucs_status_ptr_t f = ucp_ep_flush_nbx(ep->send_ep(), &fp);
  if (f == nullptr || UCS_PTR_IS_ERR(f)) {
    delete ctx;
    Finish(nullptr, op, FromUcs(UCS_PTR_STATUS(f), "Put"));
    return;
  }
  Track(ep, op, f, ctx);
}

void Engine::DoCancel(const std::shared_ptr<UcxEndpoint>& ep, uint64_t tid, absl::Status why) {
  auto it = ep->ops.find(tid);
  if (it == ep->ops.end()) return;
  Op* op = it->second;
  op->why = why;
  ucp_request_cancel(worker_, op->request);
  // UCX cannot recall every send (a rendezvous under way); give it a moment to finish or cancel.
  const absl::Time until = absl::Now() + absl::Milliseconds(1);
  while (ep->ops.contains(tid) && absl::Now() < until) ucp_worker_progress(worker_);
  if (!ep->ops.contains(tid)) return;
  CloseEndpoint(ep, absl::UnavailableError(absl::StrCat(
                        "connection to ", ep->peer(), " reset: transfer ", tid,
                        " was stopped (", why.message(), ") while its payload was moving")));
}

void Engine::CloseEndpoint(const std::shared_ptr<UcxEndpoint>& ep, absl::Status why) {
  if (ep->ep == nullptr) return;
  ucp_ep_h h = ep->ep;
  ucp_ep_h data = ep->data_ep;
  ep->ep = nullptr;
  ep->data_ep = nullptr;
  for (auto& [tid, op] : ep->ops) {
    if (!op->why.has_value()) op->why = why;
  }
  ep->notifier_.Fail(why);
  // Outstanding requests complete (with errors) as the worker progresses; their callbacks hold
  // the endpoint weakly, so it need not stay in eps_.
  for (ucp_ep_h e : {data, h}) {
    if (e == nullptr) continue;
    eps_.erase(e);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(e, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing_.push_back(r);
  }
  for (auto it = connecting_.begin(); it != connecting_.end();) {
    it = it->second.ep == ep ? connecting_.erase(it) : std::next(it);
  }
  for (auto it = accepting_.begin(); it != accepting_.end();) {
    auto conn = it->second.lock();
    it = (conn == nullptr || conn == ep) ? accepting_.erase(it) : std::next(it);
  }
}

void Engine::Shutdown() {
  std::vector<std::shared_ptr<UcxEndpoint>> eps;
  for (auto& [h, ep] : eps_) eps.push_back(ep);
  for (auto& ep : eps) CloseEndpoint(ep, absl::UnavailableError("UCX transport shut down"));
  for (auto& [nonce, c] : connecting_) {
    c.wait->Set(absl::UnavailableError("UCX transport shut down"));
  }
  connecting_.clear();
  // Ask UCX to give back what it still holds; its callbacks complete them as it progresses.
  for (RecvOp* r : std::vector<RecvOp*>(recvs_.begin(), recvs_.end())) {
    if (r->request != nullptr) ucp_request_cancel(worker_, r->request);
  }
  for (Op* op : std::vector<Op*>(live_ops_.begin(), live_ops_.end())) {
    if (op->request != nullptr) ucp_request_cancel(worker_, op->request);
  }
  const absl::Time until = absl::Now() + absl::Seconds(2);
  auto settled = [&] {
    for (void* r : closing_) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    }
    return recvs_.empty() && live_ops_.empty();
  };
  while (!settled() && absl::Now() < until) ucp_worker_progress(worker_);
  for (void* r : closing_) ucp_request_free(r);
  closing_.clear();
  for (ucp_rkey_h k : mapped_rkeys_) ucp_rkey_destroy(k);  // Map's mappings end here
  mapped_rkeys_.clear();
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  listener_ = nullptr;
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  // What UCX never completed (its requests went with the worker) is failed here, once UCX can
  // no longer touch the buffers.
  for (RecvOp* r : std::vector<RecvOp*>(recvs_.begin(), recvs_.end())) {
    FinishRecv(r, absl::UnavailableError("UCX transport shut down"));
  }
  for (Op* op : std::vector<Op*>(live_ops_.begin(), live_ops_.end())) {
    delete static_cast<OpContext*>(op->ctx);
    Finish(nullptr, op, absl::UnavailableError("UCX transport shut down"));
  }
  for (auto& ep : eps) ep->ops.clear();
}

absl::StatusOr<std::shared_ptr<Endpoint>> Engine::Connect(absl::string_view address,
                                                          absl::Duration timeout) {
  absl::string_view rest = address;
  if (absl::StartsWith(rest, kScheme)) rest.remove_prefix(kScheme.size());
  absl::StatusOr<HostPort> hp = ParseHostPort(rest);
  if (!hp.ok() || hp->port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not a UCX address (ucx://HOST:PORT)"));
  }
  const std::string host = hp->host;
  const uint32_t port = hp->port;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(absl::StrCat("resolving ", host, ": ", gai_strerror(rc)));
  }
  sockaddr_storage sa{};
  std::memcpy(&sa, res->ai_addr, res->ai_addrlen);
  const socklen_t salen = res->ai_addrlen;
  freeaddrinfo(res);

  auto ep = std::make_shared<UcxEndpoint>(weak_from_this(), std::string(address));
  auto wait = std::make_shared<ConnectWait>();
  const uint64_t handle = ep->OnFailure([wait](const absl::Status& s) { wait->Set(s); });
  const std::string addr(address);
  const bool posted = Post([this, sa, salen, addr, ep, wait] {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    p.sockaddr.addrlen = salen;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Engine::OnEpError;
    p.err_handler.arg = this;
    if (ucs_status_t st = ucp_ep_create(worker_, &p, &ep->ep); st != UCS_OK) {
      ep->ep = nullptr;
      wait->Set(FromUcs(st, absl::StrCat("connecting to ", addr)));
      return;
    }
    eps_[ep->ep] = ep;
    const uint64_t n = ++next_nonce_;
    connecting_[n] = {.ep = ep, .wait = wait};
    std::string hello;
    AppendPod(hello, n);
    SendControl(ep->ep, kHelloId, std::move(hello));
  });
  if (!posted) return absl::UnavailableError("UCX transport shut down");
  absl::Status result;
  {
    std::unique_lock<std::mutex> lock(wait->mu);
    if (!wait->cv.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                           [&] { return wait->result.has_value(); })) {
      result = absl::UnavailableError(absl::StrCat("connecting to ", address, ": no answer within ",
                                                   absl::FormatDuration(timeout)));
    } else {
      result = *wait->result;
    }
  }
  ep->RemoveFailureCallback(handle);
  if (!result.ok()) {
    // (CloseEndpoint also takes the handshake's entry, wait and all, out of `connecting_`.)
    Post([this, ep, result] { CloseEndpoint(ep, absl::UnavailableError(result.message())); });
    if (result.code() != absl::StatusCode::kInvalidArgument) {
      return absl::UnavailableError(result.message());
    }
    return result;
  }
  return std::shared_ptr<Endpoint>(ep);
}

uint64_t UcxEndpoint::Post(Op* op, uint16_t id, absl::Duration timeout) {
  const uint64_t tid = op->tid;
  if (timeout != absl::InfiniteDuration()) op->deadline = absl::Now() + timeout;
  std::shared_ptr<Engine> engine = engine_.lock();
  auto self = shared_from_this();
  const bool posted =
      engine != nullptr && engine->Post([engine, self, op, id] {
        if (op->is_put) {
          engine->DoPut(self, op);
        } else {
          engine->DoSend(self, op, id);
        }
      });
  if (!posted) {
    Completion done = std::move(op->done);
    delete op;
    done(absl::UnavailableError("UCX transport shut down"));
  }
  return tid;
}

uint64_t UcxEndpoint::Send(uint16_t id, std::span<const uint8_t> header, Payload payload,
                           absl::Duration timeout, Completion done) {
  auto* op = new Op;
  op->tid = next_tid_.fetch_add(1) + 1;
  op->header.assign(header.begin(), header.end());
  op->payload = payload;
  op->done = std::move(done);
  if (absl::Status bad = internal::CheckMessageId(id); !bad.ok()) {
    const uint64_t tid = op->tid;
    Completion d = std::move(op->done);
    delete op;
    d(std::move(bad));
    return tid;
  }
  return Post(op, id, timeout);
}

uint64_t UcxEndpoint::Put(Payload payload, absl::string_view remote, uint64_t remote_offset,
                          absl::Duration timeout, Completion done) {
  auto* op = new Op;
  op->tid = next_tid_.fetch_add(1) + 1;
  op->payload = payload;
  op->done = std::move(done);
  op->is_put = true;
  op->remote = std::string(remote);
  op->remote_offset = remote_offset;
  return Post(op, 0, timeout);
}

UcxEndpoint::~UcxEndpoint() {
  if (mapped_rkeys.empty()) return;
  if (std::shared_ptr<Engine> engine = engine_.lock()) {
    // (Once the transport is shutting down, its Shutdown releases them.)
    engine->PostQueued([e = engine.get(), keys = std::move(mapped_rkeys)] {
      for (const auto& [base, k] : keys) e->ReleaseMapped(k);
    });
  }
}

void UcxEndpoint::Unmap(const uint8_t* base) {
  std::shared_ptr<Engine> engine = engine_.lock();
  if (engine == nullptr) return;
  engine->PostQueued([e = engine.get(), self = shared_from_this(), base] {
    auto& keys = self->mapped_rkeys;
    for (auto it = keys.begin(); it != keys.end(); ++it) {
      if (it->first != base) continue;
      e->ReleaseMapped(it->second);
      keys.erase(it);
      return;
    }
  });
}

absl::StatusOr<std::span<uint8_t>> UcxEndpoint::Map(absl::string_view remote) {
  STRATA_ASSIGN_OR_RETURN(const RegionDescriptor desc, ParseRegionDescriptor(remote, "Map"));
  std::shared_ptr<Engine> engine = engine_.lock();
  absl::StatusOr<std::span<uint8_t>> result = absl::UnavailableError("UCX transport shut down");
  if (engine == nullptr) return result;
  engine->Run([&] {
    if (ep == nullptr) {
      const absl::Status h = health();
      result = h.ok() ? absl::UnavailableError("endpoint closed") : h;
      return;
    }
    ucp_rkey_h rkey = nullptr;
    if (ucs_status_t st = ucp_ep_rkey_unpack(send_ep(), desc.packed_rkey, &rkey); st != UCS_OK) {
      result = FromUcs(st, "Map: unpacking the remote key");
      return;
    }
    void* local = nullptr;
    void* last = nullptr;
    ucs_status_t st = ucp_rkey_ptr(rkey, desc.addr, &local);
    // (The whole region must be mapped, not only its first byte: the size is the peer's word.)
    if (st == UCS_OK && desc.size > 0) st = ucp_rkey_ptr(rkey, desc.addr + desc.size - 1, &last);
    if (st == UCS_OK && desc.size > 0 &&
        static_cast<uint8_t*>(last) != static_cast<uint8_t*>(local) + desc.size - 1) {
      st = UCS_ERR_INVALID_ADDR;
    }
    if (st != UCS_OK) {
      ucp_rkey_destroy(rkey);
      result = absl::UnimplementedError(absl::StrCat(
          "Map: the region of ", peer_, " is not reachable through shared memory (",
          ucs_status_string(st), ")"));
      return;
    }
    mapped_rkeys.emplace_back(static_cast<const uint8_t*>(local), rkey);
    engine->TrackMapped(rkey);
    result = std::span<uint8_t>(static_cast<uint8_t*>(local), desc.size);
  });
  return result;
}

void UcxEndpoint::Cancel(uint64_t tid) {
  std::shared_ptr<Engine> engine = engine_.lock();
  if (engine == nullptr) return;
  auto self = shared_from_this();
  engine->PostQueued([engine, self, tid] {
    engine->DoCancel(self, tid, absl::CancelledError(absl::StrCat("transfer ", tid, " cancelled")));
  });
}

std::string UcxEndpoint::Describe() const {
  std::shared_ptr<Engine> engine = engine_.lock();
  if (engine == nullptr) return peer_ + " (transport shut down)";
  std::string info;
  engine->Run([&] {
    if (ep == nullptr) {
      info = "(closed)";
      return;
    }
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f == nullptr) return;
    ucp_ep_print_info(send_ep(), f);
    fclose(f);
    info.assign(buf, len);
    free(buf);
  });
  // The data endpoint's lanes: "#   lane[0]:  1:posix/memory.0 md[0] ... am zcopy_rndv"
  std::string lanes;
  for (absl::string_view line : absl::StrSplit(info, '\n')) {
    if (!absl::StrContains(line, "lane[")) continue;
    line = absl::StripAsciiWhitespace(absl::StripPrefix(absl::StripAsciiWhitespace(line), "#"));
    absl::StrAppend(&lanes, lanes.empty() ? "" : "; ", line);
  }
  return absl::StrCat(peer_, " [", lanes.empty() ? info : lanes, "]");
}

UcxRegion::~UcxRegion() { ucp_mem_unmap(engine_->context(), memh_); }

absl::StatusOr<std::string> UcxRegion::RemoteDescriptor() const {
  void* rkey = nullptr;
  size_t rkey_size = 0;
  if (ucs_status_t st = ucp_rkey_pack(engine_->context(), memh_, &rkey, &rkey_size);
      st != UCS_OK) {
    return FromUcs(st, "ucp_rkey_pack");
  }
  std::string out(4 + 8 + 8, '\0');
  const uint64_t addr = reinterpret_cast<uint64_t>(data());
  const uint64_t size = this->size();
  std::memcpy(out.data(), &kRegionMagic, 4);
  std::memcpy(out.data() + 4, &addr, 8);
  std::memcpy(out.data() + 12, &size, 8);
  out.append(static_cast<const char*>(rkey), rkey_size);
  ucp_rkey_buffer_release(rkey);
  return out;
}

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {
    caps_.backend = "ucx";
    caps_.one_sided = true;
    caps_.device_memory = engine_->device_memory();
    caps_.cross_process = true;
    caps_.maps_peer_memory = true;
  }
  ~UcxTransport() override { engine_->Stop(); }

  const Capabilities& capabilities() const override { return caps_; }
  std::string address() const override { return engine_->address(); }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* data, size_t size,
                                                         MemoryKind kind) override {
    if (data == nullptr || size == 0) return absl::InvalidArgumentError("Register: empty region");
    if (kind == MemoryKind::kDevice && !caps_.device_memory) {
      return absl::UnimplementedError("this UCX build has no CUDA memory support");
    }
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = data;
    p.length = size;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t st = ucp_mem_map(engine_->context(), &p, &memh); st != UCS_OK) {
      return FromUcs(st, absl::StrCat("registering ", size, " bytes"));
    }
    return std::unique_ptr<MemoryRegion>(
        new UcxRegion(static_cast<uint8_t*>(data), size, engine_, memh));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t size, MemoryKind kind) override {
    if (size == 0) return absl::InvalidArgumentError("Allocate: empty region");
    if (kind == MemoryKind::kDevice && !caps_.device_memory) {
      return absl::UnimplementedError("this UCX build has no CUDA memory support");
    }
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    p.address = nullptr;
    p.length = size;
    p.flags = UCP_MEM_MAP_ALLOCATE;
    p.memory_type = kind == MemoryKind::kDevice ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t st = ucp_mem_map(engine_->context(), &p, &memh); st != UCS_OK) {
      return FromUcs(st, absl::StrCat("allocating ", size, " bytes"));
    }
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (ucs_status_t st = ucp_mem_query(memh, &attr); st != UCS_OK) {
      ucp_mem_unmap(engine_->context(), memh);
      return FromUcs(st, "ucp_mem_query");
    }
    return std::unique_ptr<MemoryRegion>(
        new UcxRegion(static_cast<uint8_t*>(attr.address), size, engine_, memh));
  }

  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view address,
                                                    absl::Duration timeout) override {
    return engine_->Connect(address, timeout);
  }

  void SetHandler(uint16_t id, MessageHandler handler) override {
    engine_->SetHandler(id, std::move(handler));
  }

  size_t max_header_size() const override { return 4096; }

 private:
  std::shared_ptr<Engine> engine_;
  Capabilities caps_;
};

}  // namespace

absl::Status UcxTransportOptions::Validate() const {
  if (busy_poll < absl::ZeroDuration()) return absl::InvalidArgumentError("busy_poll < 0");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(UcxTransportOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("UcxTransportOptions: ", s.message()));
  }
  auto engine = std::make_shared<Engine>(std::move(options));
  if (absl::Status s = engine->Init(); !s.ok()) return s;
  engine->Start();
  return std::unique_ptr<Transport>(new UcxTransport(std::move(engine)));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransportWaitingForPort(
    const UcxTransportOptions& options, absl::Duration wait,
    const std::function<void(const absl::Status&)>& waiting) {
  const absl::Time give_up = absl::Now() + wait;
  absl::StatusOr<std::unique_ptr<Transport>> t = CreateUcxTransport(options);
  for (bool told = false; !t.ok() && absl::IsUnavailable(t.status()) &&
                          absl::StrContains(t.status().message(), kPortInUse) &&
                          absl::Now() < give_up;) {
    if (!told && waiting) waiting(t.status());
    told = true;
    absl::SleepFor(
        std::min(absl::Seconds(1), std::max(absl::ZeroDuration(), give_up - absl::Now())));
    t = CreateUcxTransport(options);
  }
  return t;
}

std::string UcxVersion() { return ucp_get_version_string(); }

}  // namespace strata::transport
