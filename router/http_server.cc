#include "router/http_server.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "boost/asio.hpp"
#include "boost/asio/ssl.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "common/log.h"
#include "router/chat_template.h"
#include "router/openai_api.h"

namespace strata::router {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

constexpr size_t kHeaderLimit = 64 * 1024;
// After answering with "close" (413, 400 on a malformed request), keep reading and discarding
// for this long so that the client's unsent body does not turn our close into a reset that
// destroys the response before the client read it ("lingering close", as nginx does).
constexpr auto kLingerTime = std::chrono::seconds(2);

// Beast's string_view and Debian Abseil's are different types.
absl::string_view Sv(beast::string_view s) { return absl::string_view(s.data(), s.size()); }

std::chrono::steady_clock::duration ToChrono(absl::Duration d) {
  return absl::ToChronoNanoseconds(d);
}

// Request ids: 128 random bits, per-thread generator seeded from the OS.
std::string NewId(absl::string_view prefix) {
  thread_local std::mt19937_64 rng{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  return absl::StrFormat("%s%016x%016x", prefix, rng(), rng());
}

class Connection;

// What the backend talks to: forwards each call onto the connection's strand, tagged with the
// request's sequence number so that a late call can never touch a later request on the same
// connection. Holds no Asio object (only a weak reference to the connection), so it may outlive
// the server.
class ConnectionStream final : public CompletionStream,
                               public std::enable_shared_from_this<ConnectionStream> {
 public:
  ConnectionStream(std::weak_ptr<Connection> connection, uint64_t seq, ResponseContext ctx,
                   bool streaming, uint32_t n)
      : connection_(std::move(connection)),
        seq_(seq),
        ctx_(std::move(ctx)),
        streaming_(streaming),
        choices_(std::max<uint32_t>(n, 1)) {}

  // Choice 0's calls (the only choice when n is 1).
  void Token(std::string_view text, uint32_t token_id) override { TokenAt(0, text, token_id); }
  void TokenWithLogprobs(std::string_view text, uint32_t token_id,
                         const TokenLogprobs& logprobs) override {
    TokenAt(0, text, token_id, &logprobs);
  }
  void Echo(std::string_view prompt_text, std::vector<TokenLogprobs> prompt_logprobs) override {
    EchoAt(0, prompt_text, std::move(prompt_logprobs));
  }
  void Finish(FinishReason reason, const Usage& usage) override { FinishAt(0, reason, usage); }
  void Fail(const absl::Status& status) override;
  std::shared_ptr<CompletionStream> Choice(uint32_t index) override;

  void TokenAt(uint32_t choice, std::string_view text, uint32_t token_id,
               const TokenLogprobs* logprobs = nullptr);
  void EchoAt(uint32_t choice, std::string_view prompt_text,
              std::vector<TokenLogprobs> prompt_logprobs);
  void FinishAt(uint32_t choice, FinishReason reason, const Usage& usage);

  // No further calls are forwarded (the request is over, or the server is stopping). Waits for
  // a forward in progress on another thread.
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

 private:
  enum class Kind { kData, kEnd, kFail };
  // `received`: when the backend handed over the token (kData only).
  void Forward(Kind kind, std::string data, int http_status = 200,
               absl::Time received = absl::InfinitePast(),
               std::optional<ApiError> error = std::nullopt);

  struct ChoiceState {
    ChoiceResult result;     // non-streaming: the completion so far
    size_t text_offset = 0;  // streaming: bytes of the tokens sent so far
    bool finished = false;
    Usage usage;
  };

  const std::weak_ptr<Connection> connection_;
  const uint64_t seq_;
  const ResponseContext ctx_;
  const bool streaming_;
  // Serializes the choices' ends: the one that ends the request forwards after the others.
  absl::Mutex finish_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<ChoiceState> choices_ ABSL_GUARDED_BY(mu_);
};

// Choice `index` of a request with n > 1: forwards to its parent.
class ChoiceStream final : public CompletionStream {
 public:
  ChoiceStream(std::shared_ptr<ConnectionStream> parent, uint32_t index)
      : parent_(std::move(parent)), index_(index) {}
  void Token(std::string_view text, uint32_t token_id) override {
    parent_->TokenAt(index_, text, token_id);
  }
  void TokenWithLogprobs(std::string_view text, uint32_t token_id,
                         const TokenLogprobs& logprobs) override {
    parent_->TokenAt(index_, text, token_id, &logprobs);
  }
  void Echo(std::string_view prompt_text, std::vector<TokenLogprobs> prompt_logprobs) override {
    parent_->EchoAt(index_, prompt_text, std::move(prompt_logprobs));
  }
  void Finish(FinishReason reason, const Usage& usage) override {
    parent_->FinishAt(index_, reason, usage);
  }
  void Fail(const absl::Status& status) override { parent_->Fail(status); }

 private:
  const std::shared_ptr<ConnectionStream> parent_;
  const uint32_t index_;
};

class ServerImpl;

// One client connection. Every member is touched only on the connection's strand (the socket's
// executor), except in ServerImpl::Stop after the I/O threads were joined.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // `tls` (null: plain HTTP) is the server's, and outlives the connection.
  Connection(ServerImpl* server, tcp::socket socket, net::ssl::context* tls)
      : server_(server), socket_(std::move(socket)), timer_(socket_.get_executor()) {
    if (tls != nullptr) tls_.emplace(socket_, *tls);
  }
  ~Connection();

  void Start() {
    net::dispatch(socket_.get_executor(), [self = shared_from_this()] { self->Handshake(); });
  }

  // Server stopping; runs with no I/O thread left.
  void Abandon() { Close(); }

  // Called by ConnectionStream, from any thread.
  template <typename F>
  void Post(F&& f) {
    net::post(socket_.get_executor(), std::forward<F>(f));
  }
  // `error`: a failed stream's error as an HTTP response, sent instead of the stream when no
  // byte of it went out yet.
  void OnStreamEvent(uint64_t seq, bool end, bool ok, std::string data, absl::Time received,
                     std::optional<ApiError> error);
  void OnResponseEvent(uint64_t seq, int http_status, std::string body);

 private:
  using Request = http::request<http::string_body>;

  // Runs `f` on the stream requests and responses travel: the TLS stream, or the socket.
  template <typename F>
  void WithStream(F&& f) {
    if (tls_.has_value()) {
      f(*tls_);
    } else {
      f(socket_);
    }
  }
  // HTTPS: the TLS handshake (within idle_timeout; a failed one, e.g. plain HTTP sent to an HTTPS
  // port, closes the connection), then DoRead. Plain HTTP: DoRead.
  void Handshake();
  void DoRead();
  void OnRead(error_code ec);
  void HandleRequest(Request request);
  void HandleCompletion(const Request& request, Endpoint endpoint);
  void NextRequest();

  void SendResponse(int status, absl::string_view content_type, std::string body,
                    bool close = false, int retry_after_seconds = 1);
  void SendError(const ApiError& error, bool close = false);
  void OnResponseWritten(error_code ec, bool close);

  // The stream's 200 and headers go out with its first event (StartStream): until then an error
  // is still an HTTP status of its own (a 429 before any byte, not an error event after a 200).
  void StartStream();
  void EnqueueStream(std::string data, absl::Time received);
  void WriteStream();
  void OnStreamWritten(error_code ec, bool last);

  // With API keys: the tenant of the request's key; false (and a 401 sent) when it has none.
  bool Authenticate(const Request& request);

  // Gives the request's place among its tenant's back: once the backend is done, before the last
  // bytes are written (a client that has its answer may send the next request at once).
  void ReleaseTenantSlot();
  void RequestDone();
  void ClientGone();
  void LingerClose();
  void Drain();
  void Close();

  void ArmTimer(absl::Duration d);
  void DisarmTimer();

  ServerImpl* const server_;
  tcp::socket socket_;  // its executor is this connection's strand
  // HTTPS: TLS over socket_ (which LingerClose, Drain and Close still use directly: once the
  // response is out, what is left is discarded or cut at the TCP level).
  std::optional<net::ssl::stream<tcp::socket&>> tls_;
  net::steady_timer timer_;
  uint64_t timer_gen_ = 0;  // a fired wait of an older generation is stale
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool reading_ = false;
  std::optional<Request> pipelined_;  // read while a request was in flight
  bool closing_ = false;
  bool lingering_ = false;  // answered with "close": reading only to discard

  // The request being answered.
  bool in_flight_ = false;
  bool backend_done_ = false;  // Finish / Fail arrived (or the backend was never involved)
  uint64_t seq_ = 0;
  std::string request_id_;
  std::string route_;
  absl::Time start_;
  int status_ = 0;
  bool keep_alive_ = true;
  std::unique_ptr<RequestHandle> handle_;
  std::shared_ptr<ConnectionStream> stream_;
  // Keeps this connection alive while the backend has its request (no I/O may be pending).
  std::shared_ptr<Connection> self_;

  // Writing.
  bool writing_ = false;
  bool streaming_ = false;
  bool stream_started_ = false;  // the stream's headers went out
  ResponseContext stream_ctx_;   // of the stream not yet started
  bool stream_end_ = false;
  bool close_after_stream_ = false;
  std::string tenant_;         // the request's tenant ("" without API keys)
  bool tenant_slot_ = false;   // holds one of its tenant's in-flight places
  std::string pending_;    // stream bytes not yet handed to a write
  std::string write_buf_;  // stream bytes of the write in flight
  // When the backend handed over each token event in pending_ / in the write in flight (for
  // HttpServerOptions::on_token_written).
  std::vector<absl::Time> pending_received_, write_received_;
  std::optional<http::response<http::empty_body>> stream_header_;
  std::optional<http::response_serializer<http::empty_body>> stream_serializer_;
  std::array<char, 4096> drain_{};  // lingering close
};

class ServerImpl final : public HttpServer {
 public:
  ServerImpl(const HttpServerOptions& options, Backend* backend)
      : options_(options), backend_(backend), acceptor_(ioc_) {}
  ~ServerImpl() override { Stop(); }

  absl::Status Listen() {
    error_code ec;
    if (!options_.tls_cert_file.empty()) {
      tls_.emplace(net::ssl::context::tls_server);
      tls_->set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                            net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 |
                            net::ssl::context::no_tlsv1_1,
                        ec);
      if (!ec) tls_->use_certificate_chain_file(options_.tls_cert_file, ec);
      if (ec) {
        return absl::InvalidArgumentError(absl::StrCat(
            "TLS certificate ", options_.tls_cert_file, ": ", ec.message()));
      }
      tls_->use_private_key_file(options_.tls_key_file, net::ssl::context::pem, ec);
      if (ec) {
        return absl::InvalidArgumentError(
            absl::StrCat("TLS key ", options_.tls_key_file, ": ", ec.message()));
      }
    }
    const net::ip::address address = net::ip::make_address(options_.host, ec);
    if (ec) return absl::InvalidArgumentError(absl::StrCat("bad host '", options_.host, "'"));
    const tcp::endpoint endpoint(address, options_.port);
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", options_.host, ":", options_.port, ": ", ec.message()));
    }
    port_ = acceptor_.local_endpoint().port();
    DoAccept();
    threads_.reserve(options_.threads);
    for (int i = 0; i < options_.threads; ++i) threads_.emplace_back([this] { ioc_.run(); });
    return absl::OkStatus();
  }

  uint16_t port() const override { return port_; }

  void Stop() override {
    {
      absl::MutexLock lock(&stop_mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    work_.reset();
    ioc_.stop();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    error_code ec;
    acceptor_.close(ec);
    std::vector<std::shared_ptr<Connection>> open;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [ptr, weak] : connections_) {
        if (std::shared_ptr<Connection> c = weak.lock()) open.push_back(std::move(c));
      }
    }
    for (const std::shared_ptr<Connection>& c : open) c->Abandon();
    open.clear();
    // Let the aborted operations' handlers run so that they release their connections.
    ioc_.restart();
    ioc_.run_for(std::chrono::seconds(2));
  }

  const HttpServerOptions& options() const { return options_; }
  // A place among the tenant's completions in flight; false when it holds its limit.
  bool AcquireTenant(const std::string& tenant) {
    absl::MutexLock lock(&tenants_mu_);
    size_t& n = tenants_in_flight_[tenant];
    if (options_.max_in_flight_per_tenant > 0 && n >= options_.max_in_flight_per_tenant) {
      return false;
    }
    ++n;
    return true;
  }
  void ReleaseTenant(const std::string& tenant) {
    absl::MutexLock lock(&tenants_mu_);
    auto it = tenants_in_flight_.find(tenant);
    if (it != tenants_in_flight_.end() && --it->second == 0) tenants_in_flight_.erase(it);
  }
  Backend* backend() const { return backend_; }

  void Unregister(Connection* c) {
    absl::MutexLock lock(&mu_);
    connections_.erase(c);
  }

 private:
  void DoAccept() {
    acceptor_.async_accept(net::make_strand(ioc_), [this](error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec) {
        // Out of file descriptors and the like: back off instead of spinning.
        auto timer = std::make_shared<net::steady_timer>(ioc_, std::chrono::milliseconds(20));
        timer->async_wait([this, timer](error_code) { DoAccept(); });
        return;
      }
      std::shared_ptr<Connection> connection;
      {
        absl::MutexLock lock(&mu_);
        if (connections_.size() < options_.max_connections) {
          connection = std::make_shared<Connection>(this, std::move(socket),
                                                    tls_.has_value() ? &*tls_ : nullptr);
          connections_.emplace(connection.get(), connection);
        }
      }
      if (connection != nullptr) {
        connection->Start();
      } else {
        error_code ignored;
        socket.close(ignored);
      }
      DoAccept();
    });
  }

  const HttpServerOptions options_;
  Backend* const backend_;
  std::optional<net::ssl::context> tls_;  // HTTPS; set in Listen, read-only after
  absl::Mutex mu_;
  // Open connections (for max_connections and Stop). Declared before ioc_: connections still
  // owned by handlers are destroyed with ioc_ and unregister themselves here.
  std::unordered_map<Connection*, std::weak_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  net::io_context ioc_;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work_{
      net::make_work_guard(ioc_)};
  tcp::acceptor acceptor_;  // touched by the accept chain only (one operation at a time)
  uint16_t port_ = 0;
  std::vector<std::thread> threads_;
  absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
  absl::Mutex tenants_mu_;
  absl::flat_hash_map<std::string, size_t> tenants_in_flight_ ABSL_GUARDED_BY(tenants_mu_);
};

// ---- ConnectionStream ------------------------------------------------------------------------

std::shared_ptr<CompletionStream> ConnectionStream::Choice(uint32_t index) {
  {
    absl::MutexLock lock(&mu_);
    if (index >= choices_.size()) return nullptr;
  }
  if (index == 0) return shared_from_this();
  return std::make_shared<ChoiceStream>(shared_from_this(), index);
}

void ConnectionStream::TokenAt(uint32_t choice, std::string_view text, uint32_t /*token_id*/,
                               const TokenLogprobs* logprobs) {
  const absl::string_view t(text.data(), text.size());
  if (streaming_) {
    const absl::Time received = absl::Now();
    if (logprobs == nullptr) {
      if (!t.empty()) {
        Forward(Kind::kData, RenderStreamTextEvent(ctx_, t, {}, 0, choice), 200, received);
      }
      return;
    }
    size_t offset;
    {
      absl::MutexLock lock(&mu_);
      if (choice >= choices_.size()) return;
      offset = choices_[choice].text_offset;
      choices_[choice].text_offset += logprobs->chosen.token.size();
    }
    // Sent even when its text is held back: each token's logprobs go in order.
    Forward(Kind::kData,
            RenderStreamTextEvent(ctx_, t, absl::MakeConstSpan(logprobs, 1), offset, choice), 200,
            received);
    return;
  }
  absl::MutexLock lock(&mu_);
  if (closed_ || choice >= choices_.size()) return;
  choices_[choice].result.text.append(t.data(), t.size());
  if (logprobs != nullptr) choices_[choice].result.logprobs.push_back(*logprobs);
}

void ConnectionStream::EchoAt(uint32_t choice, std::string_view prompt_text,
                              std::vector<TokenLogprobs> prompt_logprobs) {
  const absl::string_view t(prompt_text.data(), prompt_text.size());
  if (streaming_) {
    size_t offset;
    {
      absl::MutexLock lock(&mu_);
      if (choice >= choices_.size()) return;
      offset = choices_[choice].text_offset;
      for (const TokenLogprobs& p : prompt_logprobs) {
        choices_[choice].text_offset += p.chosen.token.size();
      }
    }
    Forward(Kind::kData, RenderStreamTextEvent(ctx_, t, prompt_logprobs, offset, choice), 200,
            absl::Now());
    return;
  }
  absl::MutexLock lock(&mu_);
  if (closed_ || choice >= choices_.size()) return;
  ChoiceResult& r = choices_[choice].result;
  r.text.insert(0, std::string(t));
  r.logprobs.insert(r.logprobs.begin(), std::make_move_iterator(prompt_logprobs.begin()),
                    std::make_move_iterator(prompt_logprobs.end()));
}

void ConnectionStream::FinishAt(uint32_t choice, FinishReason reason, const Usage& usage) {
  absl::MutexLock order(&finish_mu_);
  bool last = true;
  Usage total;
  std::vector<ChoiceResult> results;
  {
    absl::MutexLock lock(&mu_);
    if (closed_ || choice >= choices_.size() || choices_[choice].finished) return;
    choices_[choice].finished = true;
    choices_[choice].result.reason = reason;
    choices_[choice].usage = usage;
    // One prompt for every choice; their completions add up.
    total.prompt_tokens =
        choices_[0].finished ? choices_[0].usage.prompt_tokens : usage.prompt_tokens;
    total.cached_tokens =
        choices_[0].finished ? choices_[0].usage.cached_tokens : usage.cached_tokens;
    for (const ChoiceState& c : choices_) {
      last = last && c.finished;
      if (c.finished) total.completion_tokens += c.usage.completion_tokens;
    }
    if (last && !streaming_) {
      for (ChoiceState& c : choices_) results.push_back(std::move(c.result));
    }
  }
  if (streaming_) {
    std::string data = RenderStreamFinishEvent(ctx_, reason, choice);
    if (!last) {
      Forward(Kind::kData, std::move(data));
      return;
    }
    if (ctx_.include_usage) data += RenderStreamUsageEvent(ctx_, total);
    data.append(kStreamDoneEvent.data(), kStreamDoneEvent.size());
    Forward(Kind::kEnd, std::move(data));
    return;
  }
  if (last) Forward(Kind::kEnd, RenderCompletionResponse(ctx_, results, total));
}

void ConnectionStream::Fail(const absl::Status& status) {
  const absl::Status error = status.ok() ? absl::InternalError("backend failed with OK") : status;
  const ApiError api = ToApiError(error);
  if (streaming_) {
    Forward(Kind::kFail, RenderStreamErrorEvent(api), api.http_status, absl::InfinitePast(), api);
  } else {
    Forward(Kind::kFail, RenderErrorJson(api), api.http_status);
  }
}

void ConnectionStream::Forward(Kind kind, std::string data, int http_status, absl::Time received,
                               std::optional<ApiError> error) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  // The strong reference lives only inside the lock: the backend thread must never be the one
  // that destroys a connection (its socket belongs to the server's io_context).
  std::shared_ptr<Connection> c = connection_.lock();
  if (c == nullptr) return;
  Connection* raw = c.get();
  if (streaming_) {
    raw->Post([c = std::move(c), seq = seq_, kind, data = std::move(data), received,
               error = std::move(error)]() mutable {
      c->OnStreamEvent(seq, kind != Kind::kData, kind == Kind::kEnd, std::move(data), received,
                       std::move(error));
    });
  } else {
    raw->Post([c = std::move(c), seq = seq_, http_status, data = std::move(data)]() mutable {
      c->OnResponseEvent(seq, http_status, std::move(data));
    });
  }
}

// ---- Connection ------------------------------------------------------------------------------

Connection::~Connection() { server_->Unregister(this); }

void Connection::ArmTimer(absl::Duration d) {
  const uint64_t gen = ++timer_gen_;
  timer_.expires_after(ToChrono(d));
  timer_.async_wait([self = shared_from_this(), gen](error_code ec) {
    if (ec || gen != self->timer_gen_ || self->closing_) return;
    self->ClientGone();
    self->Close();
  });
}

void Connection::DisarmTimer() {
  ++timer_gen_;
  timer_.cancel();
}

void Connection::Handshake() {
  if (!tls_.has_value()) {
    DoRead();
    return;
  }
  ArmTimer(server_->options().idle_timeout);
  tls_->async_handshake(net::ssl::stream_base::server,
                        [self = shared_from_this()](error_code ec) {
                          if (self->closing_) return;
                          if (ec) {
                            self->Close();
                            return;
                          }
                          self->DoRead();
                        });
}

void Connection::DoRead() {
  if (closing_ || reading_) return;
  reading_ = true;
  parser_.emplace();
  parser_->body_limit(server_->options().max_body_bytes);
  parser_->header_limit(kHeaderLimit);
  if (!in_flight_) ArmTimer(server_->options().idle_timeout);
  WithStream([&](auto& stream) {
    http::async_read(stream, buffer_, *parser_,
                     [self = shared_from_this()](error_code ec, size_t) { self->OnRead(ec); });
  });
}

void Connection::OnRead(error_code ec) {
  reading_ = false;
  if (closing_) return;
  if (lingering_) {
    if (ec) {
      Close();
    } else {
      Drain();
    }
    return;
  }
  if (ec) {
    if (in_flight_) {  // the client went away (or broke the protocol) while being answered
      ClientGone();
      Close();
      return;
    }
    if (ec == http::error::body_limit) {
      seq_++;
      request_id_ = NewId("req-");
      route_ = "(body too large)";
      start_ = absl::Now();
      in_flight_ = true;
      keep_alive_ = false;
      SendError(
          ToApiError(absl::OutOfRangeError(absl::StrCat(
              "request body exceeds the limit of ", server_->options().max_body_bytes, " bytes"))),
          /*close=*/true);
      return;
    }
    if (ec == http::error::end_of_stream || ec == net::error::eof ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset ||
        ec == http::error::partial_message ||
        ec == net::ssl::error::stream_truncated) {  // HTTPS: closed without close_notify
      Close();
      return;
    }
    seq_++;
    request_id_ = NewId("req-");
    route_ = "(malformed request)";
    start_ = absl::Now();
    in_flight_ = true;
    keep_alive_ = false;
    SendError({400, absl::StrCat("malformed HTTP request: ", ec.message()), "invalid_request_error",
               std::nullopt, std::nullopt},
              /*close=*/true);
    return;
  }
  Request request = parser_->release();
  if (in_flight_) {
    pipelined_ = std::move(request);
    return;
  }
  HandleRequest(std::move(request));
}

void Connection::HandleRequest(Request request) {
  DisarmTimer();
  seq_++;
  status_ = 0;
  in_flight_ = true;
  backend_done_ = true;
  start_ = absl::Now();
  keep_alive_ = request.keep_alive();
  absl::string_view target = Sv(request.target());
  target = target.substr(0, target.find('?'));
  route_ = absl::StrCat(Sv(request.method_string()), " ", target);
  const bool get = request.method() == http::verb::get;
  const bool post = request.method() == http::verb::post;

  std::optional<Endpoint> endpoint;
  if (target == "/v1/completions") endpoint = Endpoint::kCompletions;
  if (target == "/v1/chat/completions") endpoint = Endpoint::kChatCompletions;
  if (endpoint.has_value()) {
    request_id_ = NewId(*endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-");
    if (!Authenticate(request)) return;
    if (!post) {
      SendError({405,
                 absl::StrCat("method ", Sv(request.method_string()), " is not allowed on ", target,
                              "; use POST"),
                 "invalid_request_error", std::nullopt, "method_not_allowed"});
      return;
    }
    HandleCompletion(request, *endpoint);
    return;
  }
  request_id_ = NewId("req-");
  Backend* backend = server_->backend();
  if (target == "/v1/models" || target == "/health" || target == "/metrics") {
    if (!get) {
      SendError({405,
                 absl::StrCat("method ", Sv(request.method_string()), " is not allowed on ", target,
                              "; use GET"),
                 "invalid_request_error", std::nullopt, "method_not_allowed"});
      return;
    }
    if (target == "/v1/models") {
      if (!Authenticate(request)) return;
      SendResponse(200, "application/json", RenderModelList(backend->Models()));
    } else if (target == "/health") {
      std::string detail;
      if (backend->Healthy(&detail)) {
        SendResponse(200, "application/json", R"({"status":"ok"})");
      } else {
        ApiError e = ToApiError(absl::UnavailableError(detail.empty() ? "unhealthy" : detail));
        SendError(e);
      }
    } else {
      SendResponse(200, "text/plain; version=0.0.4; charset=utf-8", backend->RenderMetrics());
    }
    return;
  }
  SendError({404, absl::StrCat("no route for ", Sv(request.method_string()), " ", target),
             "not_found_error", std::nullopt, std::nullopt});
}

void Connection::HandleCompletion(const Request& http_request, Endpoint endpoint) {
  Backend* backend = server_->backend();
  ChatRenderer render = [backend](
                            const std::string& model,
                            absl::Span<const ChatMessage> messages) -> absl::StatusOr<std::string> {
    const std::string text = backend->ChatTemplateText(model);
    if (text.empty()) {
      for (const ModelCard& card : backend->Models()) {
        if (card.id == model) {
          return FieldError(
              "model", absl::StrCat("model ", model, " has no chat template; use /v1/completions"));
        }
      }
      return absl::NotFoundError(absl::StrCat("The model `", model, "` does not exist."));
    }
    absl::StatusOr<ChatTemplate> chat_template = AnalyzeChatTemplate(text);
    if (!chat_template.ok()) {
      return FieldError("model",
                        absl::StrCat("model ", model, " has a chat template Strata cannot render"));
    }
    return RenderChat(*chat_template, messages);
  };
  absl::StatusOr<CompletionRequest> parsed =
      ParseCompletionRequest(http_request.body(), endpoint, render);
  if (!parsed.ok()) {
    SendError(ToApiError(parsed.status()));
    return;
  }
  CompletionRequest request = *std::move(parsed);
  if (auto t = http_request.find("X-Request-Timeout"); t != http_request.end()) {
    double seconds = 0;
    if (!absl::SimpleAtod(Sv(t->value()), &seconds) || !(seconds > 0) || seconds > 86400) {
      SendError({400,
                 absl::StrCat("X-Request-Timeout: '", Sv(t->value()),
                              "' is not a number of seconds in (0, 86400]"),
                 "invalid_request_error", "X-Request-Timeout", std::nullopt});
      return;
    }
    request.timeout = absl::Seconds(seconds);
  }
  if (server_->options().api_keys != nullptr) {
    if (!server_->AcquireTenant(tenant_)) {
      SendError(ToApiError(absl::ResourceExhaustedError(absl::StrCat(
          "tenant ", tenant_, " has ", server_->options().max_in_flight_per_tenant,
          " requests in flight, its limit; retry when one has finished"))));
      return;
    }
    tenant_slot_ = true;
    request.cache_salt = TenantSalt(tenant_, request.cache_salt);
  }
  request.request_id = request_id_;
  request.arrival = start_;
  ResponseContext ctx;
  ctx.id = request_id_;
  ctx.model = request.model;
  ctx.created = absl::ToUnixSeconds(start_);
  ctx.chat = request.chat;
  ctx.include_usage = request.include_usage;
  ctx.logprobs = request.logprobs;
  const bool streaming = request.stream;
  const uint32_t choices = request.n;
  stream_ = std::make_shared<ConnectionStream>(weak_from_this(), seq_, ctx, streaming, choices);
  backend_done_ = false;
  absl::StatusOr<std::unique_ptr<RequestHandle>> handle =
      backend->Start(std::move(request), stream_);
  if (!handle.ok()) {
    stream_->Close();
    stream_.reset();
    backend_done_ = true;
    SendError(ToApiError(handle.status()));
    return;
  }
  handle_ = *std::move(handle);
  self_ = shared_from_this();
  if (streaming) {
    streaming_ = true;
    stream_started_ = false;
    stream_end_ = false;
    stream_ctx_ = ctx;
  }
  DoRead();  // notices a client that goes away while the backend works
}

void Connection::NextRequest() {
  if (closing_) return;
  if (pipelined_.has_value()) {
    Request next = std::move(*pipelined_);
    pipelined_.reset();
    HandleRequest(std::move(next));
    return;
  }
  if (reading_) {
    ArmTimer(server_->options().idle_timeout);
  } else {
    DoRead();
  }
}

void Connection::SendResponse(int status, absl::string_view content_type, std::string body,
                              bool close, int retry_after_seconds) {
  ReleaseTenantSlot();
  status_ = status;
  auto response =
      std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), 11);
  response->set(http::field::server, "strata-router");
  response->set(http::field::content_type,
                beast::string_view(content_type.data(), content_type.size()));
  response->set("X-Request-Id", request_id_);
  if (status == 429) {
    response->set(http::field::retry_after, absl::StrCat(std::max(1, retry_after_seconds)));
  }
  response->keep_alive(keep_alive_ && !close);
  response->body() = std::move(body);
  response->prepare_payload();
  writing_ = true;
  ArmTimer(server_->options().write_timeout);
  WithStream([&](auto& stream) {
    http::async_write(stream, *response,
                      [self = shared_from_this(), response, close](error_code ec, size_t) {
                        self->OnResponseWritten(ec, close || !response->keep_alive());
                      });
  });
}

void Connection::SendError(const ApiError& error, bool close) {
  SendResponse(error.http_status, "application/json", RenderErrorJson(error), close,
               error.retry_after_seconds);
}

void Connection::OnResponseWritten(error_code ec, bool close) {
  writing_ = false;
  if (closing_) return;
  DisarmTimer();
  if (ec) {
    ClientGone();
    Close();
    return;
  }
  RequestDone();
  if (close) {
    LingerClose();
    return;
  }
  NextRequest();
}

void Connection::StartStream() {
  const ResponseContext& ctx = stream_ctx_;
  stream_started_ = true;
  stream_end_ = false;
  close_after_stream_ = false;
  status_ = 200;
  stream_header_.emplace(http::status::ok, 11);
  stream_header_->set(http::field::server, "strata-router");
  stream_header_->set(http::field::content_type, "text/event-stream");
  stream_header_->set(http::field::cache_control, "no-cache");
  stream_header_->set("X-Request-Id", request_id_);
  stream_header_->keep_alive(keep_alive_);
  stream_header_->chunked(true);
  stream_serializer_.emplace(*stream_header_);
  if (ctx.chat) pending_ = RenderStreamRoleEvent(ctx);  // OpenAI's first chunk: the role
  writing_ = true;
  ArmTimer(server_->options().write_timeout);
  WithStream([&](auto& stream) {
    http::async_write_header(stream, *stream_serializer_,
                             [self = shared_from_this()](error_code ec, size_t) {
                               self->OnStreamWritten(ec, /*last=*/false);
                             });
  });
}

void Connection::OnStreamEvent(uint64_t seq, bool end, bool ok, std::string data,
                               absl::Time received, std::optional<ApiError> error) {
  if (closing_ || seq != seq_ || !in_flight_ || !streaming_ || stream_end_) return;
  if (!stream_started_) {
    if (end && !ok && error.has_value()) {
      // Nothing went out yet: the error is the response (429 with Retry-After, 503, ...).
      backend_done_ = true;
      streaming_ = false;
      SendError(*error);
      return;
    }
    StartStream();
  }
  if (!end) {
    EnqueueStream(std::move(data), received);
    return;
  }
  backend_done_ = true;
  stream_end_ = true;
  ReleaseTenantSlot();
  close_after_stream_ = !ok;
  if (!ok) status_ = 500;  // logged only: the client already has its 200
  pending_ += data;
  WriteStream();
}

void Connection::OnResponseEvent(uint64_t seq, int http_status, std::string body) {
  if (closing_ || seq != seq_ || !in_flight_ || streaming_ || backend_done_) return;
  backend_done_ = true;
  SendResponse(http_status, "application/json", std::move(body));
}

void Connection::EnqueueStream(std::string data, absl::Time received) {
  if (pending_.size() + data.size() > server_->options().max_pending_stream_bytes) {
    ClientGone();  // reads slower than we produce: give the capacity to someone else
    Close();
    return;
  }
  pending_ += data;
  if (server_->options().on_token_written) pending_received_.push_back(received);
  WriteStream();
}

void Connection::WriteStream() {
  if (writing_ || closing_) return;
  if (!pending_.empty()) {
    write_buf_.clear();
    write_buf_.swap(pending_);
    write_received_.clear();
    write_received_.swap(pending_received_);
    writing_ = true;
    ArmTimer(server_->options().write_timeout);
    WithStream([&](auto& stream) {
      net::async_write(stream, http::make_chunk(net::buffer(write_buf_)),
                       [self = shared_from_this()](error_code ec, size_t) {
                         self->OnStreamWritten(ec, /*last=*/false);
                       });
    });
    return;
  }
  if (stream_end_) {
    writing_ = true;
    ArmTimer(server_->options().write_timeout);
    WithStream([&](auto& stream) {
      net::async_write(stream, http::make_chunk_last(),
                       [self = shared_from_this()](error_code ec, size_t) {
                         self->OnStreamWritten(ec, /*last=*/true);
                       });
    });
    return;
  }
  DisarmTimer();  // waiting for the backend: no deadline
}

void Connection::OnStreamWritten(error_code ec, bool last) {
  writing_ = false;
  if (closing_) return;
  if (ec) {
    ClientGone();
    Close();
    return;
  }
  if (!write_received_.empty()) {
    const absl::Time now = absl::Now();
    for (absl::Time t : write_received_) server_->options().on_token_written(now - t);
    write_received_.clear();
  }
  if (!last) {
    WriteStream();
    return;
  }
  DisarmTimer();
  const bool close = close_after_stream_ || !keep_alive_;
  RequestDone();
  if (close) {
    LingerClose();
    return;
  }
  NextRequest();
}

void Connection::ReleaseTenantSlot() {
  if (!tenant_slot_) return;
  server_->ReleaseTenant(tenant_);
  tenant_slot_ = false;
}

bool Connection::Authenticate(const Request& request) {
  tenant_.clear();
  const std::shared_ptr<const ApiKeys>& keys = server_->options().api_keys;
  if (keys == nullptr) return true;
  auto header = request.find(http::field::authorization);
  const absl::string_view key =
      header == request.end() ? absl::string_view() : BearerKey(Sv(header->value()));
  std::optional<std::string> tenant = keys->TenantOf(key);
  if (!tenant.has_value()) {
    SendError({401,
               key.empty() ? "You didn't provide an API key: send it as 'Authorization: Bearer "
                             "KEY'"
                           : "Incorrect API key provided",
               "invalid_request_error", std::nullopt, "invalid_api_key"});
    return false;
  }
  tenant_ = *std::move(tenant);
  return true;
}

void Connection::RequestDone() {
  if (!in_flight_) return;
  if (server_->options().log_requests) {
    Log(request_id_, absl::StrFormat("%s %d %.1fms", route_, status_,
                                     absl::ToDoubleMilliseconds(absl::Now() - start_)));
  }
  in_flight_ = false;
  ReleaseTenantSlot();
  if (stream_ != nullptr) stream_->Close();
  stream_.reset();
  handle_.reset();  // finished: destroying the handle cancels nothing
  streaming_ = false;
  stream_started_ = false;
  stream_end_ = false;
  close_after_stream_ = false;
  stream_serializer_.reset();
  stream_header_.reset();
  pending_.clear();
  write_buf_.clear();
  pending_received_.clear();
  write_received_.clear();
  self_.reset();  // every caller runs in a handler that holds its own reference
}

void Connection::ClientGone() {
  if (!in_flight_) return;
  if (stream_ != nullptr) stream_->Close();
  if (handle_ != nullptr && !backend_done_) {
    handle_->Cancel();
    status_ = 499;  // logged only (nginx's "client closed request")
  }
  handle_.reset();
  RequestDone();
}

void Connection::LingerClose() {
  error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_send, ignored);
  const uint64_t gen = ++timer_gen_;
  timer_.expires_after(kLingerTime);
  timer_.async_wait([self = shared_from_this(), gen](error_code ec) {
    if (!ec && gen == self->timer_gen_) self->Close();
  });
  lingering_ = true;
  if (reading_) return;  // the pending read ends in OnRead, which drains
  Drain();
}

void Connection::Drain() {
  socket_.async_read_some(net::buffer(drain_), [self = shared_from_this()](error_code ec, size_t) {
    if (ec || self->closing_) {
      self->Close();
      return;
    }
    self->Drain();
  });
}

void Connection::Close() {
  if (closing_) return;
  ClientGone();
  closing_ = true;
  ++timer_gen_;
  timer_.cancel();
  error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  pipelined_.reset();
  self_.reset();
}

}  // namespace

absl::Status HttpServerOptions::Validate() const {
  if (threads < 1) return absl::InvalidArgumentError("threads must be >= 1");
  if (max_body_bytes < 1) return absl::InvalidArgumentError("max_body_bytes must be >= 1");
  if (max_connections < 1) return absl::InvalidArgumentError("max_connections must be >= 1");
  if (idle_timeout <= absl::ZeroDuration() || write_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("idle_timeout and write_timeout must be positive");
  }
  if (max_pending_stream_bytes < 1) {
    return absl::InvalidArgumentError("max_pending_stream_bytes must be >= 1");
  }
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError("HTTPS needs both tls_cert_file and tls_key_file");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              Backend* backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("HttpServer needs a backend");
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  auto server = std::make_unique<ServerImpl>(options, backend);
  if (absl::Status s = server->Listen(); !s.ok()) return s;
  return std::unique_ptr<HttpServer>(std::move(server));
}

}  // namespace strata::router
