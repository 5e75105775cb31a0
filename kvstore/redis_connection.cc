#include "kvstore/redis_connection.h"

#include <arpa/inet.h>
#include <errno.h>
#include <hiredis/hiredis.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/host_port.h"

namespace strata::kvstore {
namespace {

// Arguments at least this long are written from the caller's bytes instead of copied.
constexpr size_t kLargeArgument = 16 << 10;
// hiredis's own read size: its reader moves what is left of its buffer forward after each
// reply once 1 KiB is consumed, so a larger feed costs more moves with many small replies.
constexpr size_t kReceiveBuffer = 16 << 10;
constexpr size_t kTlsWriteChunk = 256 << 10;

// Whether hiredis's reader holds no byte of a reply: all it was fed is parsed, and no reply is
// begun (hiredis 0.14 leaves an empty root task, type -1, after a call that found no bytes).
bool ReaderIdle(const redisReader* r) {
  return r->pos == r->len && (r->ridx == -1 || (r->ridx == 0 && r->rstack[0].type < 0));
}

using SharedAddrinfo = std::shared_ptr<const addrinfo>;

SharedAddrinfo Own(addrinfo* a) {
  return SharedAddrinfo(a, [](const addrinfo* p) { freeaddrinfo(const_cast<addrinfo*>(p)); });
}

// A name being looked up, and what the lookup found.
struct Lookup {
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  int rc = 0;
  SharedAddrinfo found;
};

// Lookups in flight, by host and port: callers of one name wait on one lookup, so a resolver that
// does not answer holds a thread per name, not one per attempt. (Never destroyed: a lookup's
// thread may outlive main.)
std::mutex& LookupsMu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<std::string, std::shared_ptr<Lookup>>& Lookups() {
  static auto* lookups = new std::map<std::string, std::shared_ptr<Lookup>>;
  return *lookups;
}

// `host`'s addresses, or an error naming it, by `deadline`. An address literal is parsed at once;
// a name is looked up on a thread of its own (getaddrinfo cannot be bounded: a resolver that
// does not answer holds it for its timeouts and attempts), which the caller stops waiting for at
// the deadline.
absl::StatusOr<SharedAddrinfo> Resolve(const std::string& host, uint16_t port,
                                       absl::Time deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = absl::StrCat(port);
  addrinfo* found = nullptr;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  if (getaddrinfo(host.c_str(), service.c_str(), &hints, &found) == 0) return Own(found);
  hints.ai_flags = AI_NUMERICSERV;
  const std::string key = absl::StrCat(host, " ", service);
  std::shared_ptr<Lookup> lookup;
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(LookupsMu());
    std::shared_ptr<Lookup>& slot = Lookups()[key];
    if (slot == nullptr) {
      slot = std::make_shared<Lookup>();
      start = true;
    }
    lookup = slot;
  }
  auto finish = [lookup, key](int rc, addrinfo* a) {
    {
      std::lock_guard<std::mutex> lock(LookupsMu());
      Lookups().erase(key);
    }
    std::lock_guard<std::mutex> lock(lookup->mu);
    lookup->rc = rc;
    if (rc == 0) lookup->found = Own(a);
    lookup->done = true;
    lookup->done_cv.notify_all();
  };
  if (start) {
    try {
      std::thread([finish, host, service, hints] {
        addrinfo* a = nullptr;
        const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &a);
        finish(rc, a);
      }).detach();
    } catch (const std::system_error& e) {
      finish(EAI_AGAIN, nullptr);
      return absl::UnavailableError(absl::StrCat("resolving ", host, ": no thread: ", e.what()));
    }
  }
  std::unique_lock<std::mutex> lock(lookup->mu);
  const auto wait =
      absl::ToChronoNanoseconds(std::max(deadline - absl::Now(), absl::ZeroDuration()));
  if (!lookup->done_cv.wait_for(lock, wait, [&] { return lookup->done; })) {
    return absl::UnavailableError(
        absl::StrCat("resolving ", host, ": no answer within the connect timeout"));
  }
  if (lookup->rc != 0) {
    return absl::UnavailableError(absl::StrCat("resolving ", host, ": ", gai_strerror(lookup->rc)));
  }
  return lookup->found;
}

// Every error OpenSSL queued on this thread, oldest first ("" when none).
std::string OpenSslErrors() {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "unknown error" : out;
}

// poll() until `fd` is ready for `events` or `deadline`: > 0 ready, 0 timed out, < 0 failed.
int PollUntil(int fd, short events, absl::Time deadline) {
  while (true) {
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (n < 0 && errno == EINTR) continue;
    return n;
  }
}

bool IsIpLiteral(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  return inet_pton(AF_INET, host.c_str(), &a4) == 1 || inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

void RedisReplyDeleter::operator()(redisReply* r) const { freeReplyObject(r); }

absl::StatusOr<std::shared_ptr<RedisTlsContext>> RedisTlsContext::Create(const RedisTlsOptions& o) {
  ERR_clear_error();
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("redis TLS: ", OpenSslErrors()));
  std::shared_ptr<RedisTlsContext> out(new RedisTlsContext(ctx, o.server_name));
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (!o.ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx, o.ca_file.c_str(), nullptr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis TLS: CA file '", o.ca_file, "': ", OpenSslErrors()));
    }
  } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis TLS: the system's CA certificates: ", OpenSslErrors()));
  }
  if (o.cert_file.empty() != o.key_file.empty()) {
    return absl::InvalidArgumentError(
        "redis TLS: a client certificate and its key go together (both or neither)");
  }
  if (!o.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, o.cert_file.c_str()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis TLS: certificate file '", o.cert_file, "': ", OpenSslErrors()));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis TLS: key file '", o.key_file, "': ", OpenSslErrors()));
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "redis TLS: key file '", o.key_file, "' does not match certificate '", o.cert_file, "'"));
    }
  }
  return out;
}

RedisTlsContext::~RedisTlsContext() { SSL_CTX_free(ctx_); }

RedisConnection::RedisConnection(int fd, std::string address, absl::Duration io_timeout)
    : fd_(fd),
      address_(std::move(address)),
      io_timeout_(io_timeout),
      reader_(redisReaderCreate()),
      in_(kReceiveBuffer) {}

RedisConnection::~RedisConnection() {
  if (ssl_ != nullptr) SSL_free(ssl_);  // frees both BIOs
  if (fd_ >= 0) close(fd_);
  redisReaderFree(reader_);
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::Open(
    const std::string& host, uint16_t port, absl::Duration connect_timeout,
    absl::Duration io_timeout, const RedisTlsContext* tls) {
  const std::string address = JoinHostPort(host, port);
  const absl::Time deadline = absl::Now() + connect_timeout;
  absl::StatusOr<SharedAddrinfo> found = Resolve(host, port, deadline);
  if (!found.ok()) {
    return absl::UnavailableError(absl::StrCat("redis ", address, ": ", found.status().message()));
  }
  std::string why = "no address";
  std::unique_ptr<RedisConnection> conn;
  for (const addrinfo* a = found->get(); a != nullptr && conn == nullptr; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      why = std::strerror(errno);
      close(fd);
      continue;
    }
    const int ready = PollUntil(fd, POLLOUT, deadline);
    int err = 0;
    socklen_t len = sizeof(err);
    if (ready <= 0) {
      why = ready == 0 ? "connect timed out" : std::strerror(errno);
    } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      why = std::strerror(err != 0 ? err : errno);
    } else {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      conn.reset(new RedisConnection(fd, address, io_timeout));
      break;
    }
    close(fd);
  }
  if (conn == nullptr) return absl::UnavailableError(absl::StrCat("redis ", address, ": ", why));
  if (conn->reader_ == nullptr) return absl::ResourceExhaustedError("redis: out of memory");
  if (tls != nullptr) {
    if (absl::Status s = conn->Handshake(*tls, host, deadline); !s.ok()) return s;
  }
  return conn;
}

absl::Status RedisConnection::Failed(absl::string_view what) {
  failed_ = true;
  return absl::UnavailableError(absl::StrCat("redis ", address_, ": ", what));
}

absl::Status RedisConnection::Handshake(const RedisTlsContext& tls, const std::string& host,
                                        absl::Time deadline) {
  ERR_clear_error();
  ssl_ = SSL_new(tls.ctx());
  BIO* r = BIO_new(BIO_s_mem());
  BIO* w = BIO_new(BIO_s_mem());
  if (ssl_ == nullptr || r == nullptr || w == nullptr) {
    BIO_free(r);
    BIO_free(w);
    return Failed(absl::StrCat("TLS: ", OpenSslErrors()));
  }
  SSL_set_bio(ssl_, r, w);
  rbio_ = r;
  wbio_ = w;
  const std::string& name = tls.server_name().empty() ? host : tls.server_name();
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl_);
  if (IsIpLiteral(name)) {
    X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str());
  } else {
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    X509_VERIFY_PARAM_set1_host(param, name.c_str(), 0);
    SSL_set_tlsext_host_name(ssl_, name.c_str());
  }
  SSL_set_connect_state(ssl_);
  std::vector<char> buf(16 << 10);
  while (true) {
    ERR_clear_error();
    const int rc = SSL_do_handshake(ssl_);
    const int e = rc == 1 ? SSL_ERROR_NONE : SSL_get_error(ssl_, rc);
    const std::string errors = e == SSL_ERROR_NONE ? "" : OpenSslErrors();
    // What OpenSSL wrote (our flight, or the alert of a failure) goes out first.
    absl::Status drained = DrainTls(deadline);
    if (e == SSL_ERROR_NONE) return drained;
    if (e != SSL_ERROR_WANT_READ) {
      const long verify = SSL_get_verify_result(ssl_);
      return Failed(absl::StrCat(
          "TLS handshake: ",
          verify != X509_V_OK
              ? absl::StrCat("the server's certificate for '", name,
                             "' does not verify: ", X509_verify_cert_error_string(verify))
              : errors));
    }
    if (!drained.ok()) return drained;
    absl::StatusOr<size_t> n = RecvRaw(buf.data(), buf.size(), deadline);
    if (!n.ok()) {
      return Failed(absl::StrCat("TLS handshake: ", n.status().message()));
    }
    BIO_write(r, buf.data(), static_cast<int>(*n));
  }
}

absl::Status RedisConnection::SendRaw(const char* p, size_t n, absl::Time deadline) {
  std::vector<iovec> iov = {{const_cast<char*>(p), n}};
  return SendAll(iov, absl::InfiniteDuration(), deadline);
}

absl::Status RedisConnection::SendAll(std::vector<iovec>& iov, absl::Duration idle,
                                      absl::Time not_after) {
  size_t first = 0;
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    const ssize_t k = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const int ready = PollUntil(fd_, POLLOUT, std::min(absl::Now() + idle, not_after));
      if (ready == 0) return Failed("a write stalled past the timeout");
      if (ready < 0) return Failed(absl::StrCat("poll: ", std::strerror(errno)));
      continue;
    }
    if (k < 0) return Failed(absl::StrCat("write: ", std::strerror(errno)));
    size_t sent = static_cast<size_t>(k);
    while (first < iov.size() && sent >= iov[first].iov_len) sent -= iov[first++].iov_len;
    if (sent > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + sent;
      iov[first].iov_len -= sent;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> RedisConnection::RecvRaw(char* p, size_t n, absl::Time deadline) {
  while (true) {
    const ssize_t k = recv(fd_, p, n, 0);
    if (k > 0) return static_cast<size_t>(k);
    if (k == 0) return Failed("the server closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const int ready = PollUntil(fd_, POLLIN, deadline);
      if (ready == 0) return Failed("no reply within the timeout");
      if (ready < 0) return Failed(absl::StrCat("poll: ", std::strerror(errno)));
      continue;
    }
    return Failed(absl::StrCat("read: ", std::strerror(errno)));
  }
}

absl::Status RedisConnection::DrainTls(absl::Time deadline) {
  BIO* w = static_cast<BIO*>(wbio_);
  char buf[16 << 10];
  while (BIO_ctrl_pending(w) > 0) {
    const int n = BIO_read(w, buf, sizeof(buf));
    if (n <= 0) break;
    if (absl::Status s = SendRaw(buf, static_cast<size_t>(n), deadline); !s.ok()) {
      // A server that refused us (no client certificate, say) sent an alert before closing:
      // its reason says more than the reset.
      const std::string alert = PendingTlsAlert();
      return alert.empty() ? s
                           : absl::UnavailableError(absl::StrCat(s.message(), " (", alert, ")"));
    }
  }
  return absl::OkStatus();
}

std::string RedisConnection::PendingTlsAlert() {
  char buf[16 << 10];
  const ssize_t k = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
  if (k <= 0) return "";
  BIO_write(static_cast<BIO*>(rbio_), buf, static_cast<int>(k));
  ERR_clear_error();
  char one;
  const int r = SSL_read(ssl_, &one, 1);
  return r <= 0 && SSL_get_error(ssl_, r) == SSL_ERROR_SSL ? OpenSslErrors() : "";
}

bool RedisConnection::Reusable() {
  // Bytes of a reply nobody read: not a connection to reuse.
  if (failed_ || in_pos_ < in_len_ || !ReaderIdle(reader_)) return false;
  char buf[16 << 10];
  for (int records = 0; records < 16; ++records) {  // a few tickets at most; more is not idle
    const ssize_t k = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // nothing: still open
    // EOF, a reset, or plain bytes nobody asked for.
    if (k <= 0 || ssl_ == nullptr) break;
    BIO_write(static_cast<BIO*>(rbio_), buf, static_cast<int>(k));
    ERR_clear_error();
    char one;
    const int r = SSL_read(ssl_, &one, 1);
    // A session ticket leaves OpenSSL wanting more; application data, close_notify or an alert
    // end the connection's use.
    if (r > 0 || SSL_get_error(ssl_, r) != SSL_ERROR_WANT_READ) break;
  }
  failed_ = true;
  return false;
}

absl::Status RedisConnection::Write(const char* p, size_t n, absl::Time deadline) {
  if (ssl_ == nullptr) return SendRaw(p, n, deadline);
  while (n > 0) {
    ERR_clear_error();
    const int k = SSL_write(ssl_, p, static_cast<int>(std::min(n, kTlsWriteChunk)));
    if (k <= 0) return Failed(absl::StrCat("TLS write: ", OpenSslErrors()));
    p += k;
    n -= static_cast<size_t>(k);
    if (absl::Status s = DrainTls(deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> RedisConnection::ReadSome(char* p, size_t n, absl::Time deadline) {
  if (ssl_ == nullptr) return RecvRaw(p, n, deadline);
  while (true) {
    ERR_clear_error();
    const int k = SSL_read(ssl_, p, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    if (k > 0) return static_cast<size_t>(k);
    const int e = SSL_get_error(ssl_, k);
    if (e == SSL_ERROR_ZERO_RETURN) return Failed("the server closed the TLS session");
    if (e != SSL_ERROR_WANT_READ) return Failed(absl::StrCat("TLS read: ", OpenSslErrors()));
    if (absl::Status s = DrainTls(deadline); !s.ok()) return s;
    // The records are received into `p` and copied into OpenSSL's buffer at once; into a
    // scratch buffer where `p` is smaller than a record, not a few bytes per recv.
    char* to = p;
    size_t room = n;
    if (n < kReceiveBuffer) {
      tls_scratch_.resize(kReceiveBuffer);
      to = tls_scratch_.data();
      room = tls_scratch_.size();
    }
    absl::StatusOr<size_t> m = RecvRaw(to, room, deadline);
    if (!m.ok()) return m.status();
    BIO_write(static_cast<BIO*>(rbio_), to, static_cast<int>(*m));
  }
}

void RedisConnection::Append(absl::Span<const absl::string_view> argv) {
  absl::StrAppend(&small_, "*", argv.size(), "\r\n");
  for (absl::string_view a : argv) {
    absl::StrAppend(&small_, "$", a.size(), "\r\n");
    if (a.size() >= kLargeArgument) {
      out_.push_back({std::move(small_), {}});
      small_.clear();
      out_.push_back({"", a});
    } else {
      small_.append(a.data(), a.size());
    }
    small_.append("\r\n");
  }
}

absl::Status RedisConnection::Flush(absl::Time not_after) {
  if (!small_.empty()) out_.push_back({std::move(small_), {}});
  small_.clear();
  std::vector<Piece> out = std::move(out_);
  out_.clear();
  if (failed_) return absl::UnavailableError(absl::StrCat("redis ", address_, ": closed"));
  if (ssl_ != nullptr) {
    for (const Piece& piece : out) {
      const absl::string_view b = piece.owned.empty() ? piece.view : piece.owned;
      if (absl::Status s = Write(b.data(), b.size(), WaitEnd(not_after)); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  // Plain TCP: every piece in one gathered write where the socket takes it.
  std::vector<iovec> iov;
  iov.reserve(out.size());
  for (const Piece& piece : out) {
    const absl::string_view b = piece.owned.empty() ? piece.view : piece.owned;
    if (!b.empty()) iov.push_back({const_cast<char*>(b.data()), b.size()});
  }
  return SendAll(iov, io_timeout_, not_after);
}

absl::StatusOr<RedisReplyPtr> RedisConnection::Read(absl::Time not_after) {
  absl::StatusOr<RedisDirectReply> r = ReadReply(not_after, /*direct=*/false);
  if (!r.ok()) return r.status();
  return std::move(r->parsed);
}

absl::StatusOr<RedisDirectReply> RedisConnection::ReadReply(absl::Time not_after,
                                                            bool direct_bulk) {
  if (failed_) return absl::UnavailableError(absl::StrCat("redis ", address_, ": closed"));
  while (true) {
    void* r = nullptr;
    if (redisReaderGetReply(reader_, &r) != REDIS_OK) {
      return Failed(absl::StrCat("not a Redis reply: ", reader_->errstr));
    }
    if (r != nullptr) return RedisDirectReply{RedisReplyPtr(static_cast<redisReply*>(r)), {}};
    if (in_pos_ == in_len_) {
      // The timeout bounds each wait for bytes, not the whole reply (a large value may take
      // several).
      absl::StatusOr<size_t> n = ReadSome(in_.data(), in_.size(), WaitEnd(not_after));
      if (!n.ok()) return n.status();
      in_pos_ = 0;
      in_len_ = *n;
      continue;
    }
    // hiredis is fed one reply at a time where its extent is known (a bulk string's length, a
    // line's end), so that the next one starts where hiredis holds nothing: a large bulk string
    // there can be read past it. Arrays and the rest go to hiredis as they come.
    size_t feed = in_len_ - in_pos_;
    if (feed_left_ > 0) {
      feed = std::min(feed, feed_left_);
      feed_left_ -= feed;
    } else if (to_newline_) {
      if (const void* nl = std::memchr(in_.data() + in_pos_, '\n', feed); nl != nullptr) {
        feed = static_cast<size_t>(static_cast<const char*>(nl) - (in_.data() + in_pos_)) + 1;
        to_newline_ = false;
      }
    } else if (ReaderIdle(reader_)) {  // a reply starts here
      const char type = in_[in_pos_];
      std::optional<BulkHeader> bulk;
      if (type == '$') {
        absl::StatusOr<std::optional<BulkHeader>> h = ParseBulkHeader(not_after);
        if (!h.ok()) return h.status();
        bulk = *h;
        feed = in_len_ - in_pos_;  // the header's wait may have brought more
      }
      if (bulk.has_value() && direct_bulk && bulk->value_bytes >= kDirectBulk) {
        absl::StatusOr<AlignedBuffer> value = ReadLargeBulk(*bulk, not_after);
        if (!value.ok()) return value.status();
        return RedisDirectReply{nullptr, *std::move(value)};
      }
      if (bulk.has_value()) {
        feed_left_ = bulk->header_bytes + bulk->value_bytes + 2;
        feed = std::min(feed, feed_left_);
        feed_left_ -= feed;
      } else if (type == '$' || type == '+' || type == '-' || type == ':') {  // one line
        to_newline_ = true;
        continue;  // the branch above feeds it
      }
    }
    if (redisReaderFeed(reader_, in_.data() + in_pos_, feed) != REDIS_OK) {
      return Failed(absl::StrCat("not a Redis reply: ", reader_->errstr));
    }
    in_pos_ += feed;
    if (in_pos_ == in_len_) in_pos_ = in_len_ = 0;
  }
}

absl::Status RedisConnection::FillTo(size_t n, absl::Time not_after) {
  if (in_pos_ > 0) {
    std::memmove(in_.data(), in_.data() + in_pos_, in_len_ - in_pos_);
    in_len_ -= in_pos_;
    in_pos_ = 0;
  }
  while (in_len_ < n) {
    absl::StatusOr<size_t> k =
        ReadSome(in_.data() + in_len_, in_.size() - in_len_, WaitEnd(not_after));
    if (!k.ok()) return k.status();
    in_len_ += *k;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<RedisConnection::BulkHeader>> RedisConnection::ParseBulkHeader(
    absl::Time not_after) {
  // "$<length>\r\n", a length of at most 20 digits.
  constexpr size_t kLongestHeader = 24;
  size_t nl = 0;  // the header's '\n', from in_pos_
  while (true) {
    const size_t have = in_len_ - in_pos_;
    const char* at = static_cast<const char*>(
        std::memchr(in_.data() + in_pos_, '\n', std::min(have, kLongestHeader)));
    if (at != nullptr) {
      nl = static_cast<size_t>(at - (in_.data() + in_pos_));
      break;
    }
    if (have >= kLongestHeader) return std::nullopt;  // not one we read: hiredis judges it
    if (absl::Status s = FillTo(have + 1, not_after); !s.ok()) return s;
  }
  // Digits between the '$' and "\r\n"; anything else ($-1 for nil, junk) is hiredis's.
  const char* digits = in_.data() + in_pos_ + 1;
  if (nl < 3 || digits[nl - 2] != '\r') return std::nullopt;
  size_t length = 0;
  for (size_t i = 0; i + 2 < nl; ++i) {
    if (digits[i] < '0' || digits[i] > '9') return std::nullopt;
    length = std::min(length * 10 + static_cast<size_t>(digits[i] - '0'), kMaxBulk + 1);
  }
  if (length > kMaxBulk) {
    return Failed(absl::StrCat("not a Redis reply: a bulk string longer than Redis sends (",
                               kMaxBulk, " bytes)"));
  }
  return BulkHeader{.header_bytes = nl + 1, .value_bytes = length};
}

absl::StatusOr<AlignedBuffer> RedisConnection::ReadLargeBulk(const BulkHeader& bulk,
                                                             absl::Time not_after) {
  const size_t length = bulk.value_bytes;
  AlignedBuffer value = AlignedBuffer::Uninitialized(length);
  in_pos_ += bulk.header_bytes;
  char* out = reinterpret_cast<char*>(value.data());
  size_t have = std::min(length, in_len_ - in_pos_);
  std::memcpy(out, in_.data() + in_pos_, have);
  in_pos_ += have;
  while (have < length) {  // the rest from the socket (or out of TLS) into its place
    absl::StatusOr<size_t> k = ReadSome(out + have, length - have, WaitEnd(not_after));
    if (!k.ok()) return k.status();
    have += *k;
  }
  if (absl::Status s = FillTo(2, not_after); !s.ok()) return s;
  if (in_[0] != '\r' || in_[1] != '\n') {
    return Failed(
        absl::StrCat("not a Redis reply: a bulk string of ", length, " bytes not ended by CRLF"));
  }
  in_pos_ += 2;
  if (in_pos_ == in_len_) in_pos_ = in_len_ = 0;
  return value;
}

std::unique_ptr<RedisConnection> RedisConnection::FromSocket(int fd, std::string address,
                                                             absl::Duration io_timeout) {
  return std::unique_ptr<RedisConnection>(new RedisConnection(fd, std::move(address), io_timeout));
}

absl::StatusOr<RedisReplyPtr> RedisConnection::Call(absl::Span<const absl::string_view> argv,
                                                    absl::Time not_after) {
  Append(argv);
  if (absl::Status s = Flush(not_after); !s.ok()) return s;
  return Read(not_after);
}

}  // namespace strata::kvstore
