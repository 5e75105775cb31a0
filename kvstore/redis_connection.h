// One connection to one Redis node, plain TCP or TLS (OpenSSL), speaking RESP: commands are
// encoded here (large arguments are written from the caller's bytes, not copied) and replies
// parsed by hiredis's reader (Debian's libhiredis 0.14, whose own connections have no TLS).
// Every wait is bounded: the connect and TLS handshake by `connect_timeout`, each write and each
// reply by `io_timeout`. A connection that failed is not reused (the caller drops it).
//
//   STRATA_ASSIGN_OR_RETURN(auto c, RedisConnection::Open("10.0.0.5", 6379, opts, tls.get()));
//   c->Append({"SET", "k", value});
//   c->Append({"GET", "k"});
//   STRATA_RETURN_IF_ERROR(c->Flush());
//   STRATA_ASSIGN_OR_RETURN(RedisReplyPtr set, c->Read());
//
// Not thread-safe: one caller at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"

struct iovec;
struct redisReader;
struct redisReply;
struct ssl_ctx_st;
struct ssl_st;

namespace strata::kvstore {

// TLS to Redis (Redis's tls-port). The servers' certificates are always verified: against
// `ca_file`, else the system's CA store, and for the name `server_name`, else the host connected
// to (an IP address is checked against the certificate's IP SANs).
struct RedisTlsOptions {
  bool enabled = false;
  std::string ca_file = "";      // PEM bundle the servers' certificates must chain to ("": system)
  std::string cert_file = "";    // this client's certificate chain, PEM (Redis's tls-auth-clients)
  std::string key_file = "";     // its private key, PEM
  std::string server_name = "";  // the name every node's certificate must carry ("": address)
};

// The client side of TLS, shared by every connection of a client (an OpenSSL SSL_CTX).
class RedisTlsContext {
 public:
  // kInvalidArgument naming the file that cannot be read or does not match.
  static absl::StatusOr<std::shared_ptr<RedisTlsContext>> Create(const RedisTlsOptions& options);
  ~RedisTlsContext();
  RedisTlsContext(const RedisTlsContext&) = delete;
  RedisTlsContext& operator=(const RedisTlsContext&) = delete;

  ssl_ctx_st* ctx() const { return ctx_; }
  const std::string& server_name() const { return server_name_; }

 private:
  RedisTlsContext(ssl_ctx_st* ctx, std::string server_name)
      : ctx_(ctx), server_name_(std::move(server_name)) {}
  ssl_ctx_st* ctx_;
  std::string server_name_;
};

struct RedisReplyDeleter {
  void operator()(redisReply* r) const;
};
using RedisReplyPtr = std::unique_ptr<redisReply, RedisReplyDeleter>;

// A reply read by RedisConnection::ReadReply: hiredis's parse, or a bulk string of at least
// RedisConnection::kDirectBulk bytes read straight into an aligned buffer.
struct RedisDirectReply {
  RedisReplyPtr parsed;  // null when `bulk` holds the reply
  std::optional<AlignedBuffer> bulk;
};

class RedisConnection {
 public:
  // kUnavailable (naming the address and why) when the node cannot be reached in time or the
  // TLS handshake fails (a certificate that does not verify included).
  static absl::StatusOr<std::unique_ptr<RedisConnection>> Open(const std::string& host,
                                                               uint16_t port,
                                                               absl::Duration connect_timeout,
                                                               absl::Duration io_timeout,
                                                               const RedisTlsContext* tls);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Queues one command. Arguments of 16 KiB and more are written from the caller's bytes at
  // Flush: they must stay alive until then.
  void Append(absl::Span<const absl::string_view> argv);
  // Writes every queued command. kUnavailable when the connection fails or a write stalls past
  // io_timeout.
  // `not_after` caps every wait (a call's deadline), besides io_timeout.
  absl::Status Flush(absl::Time not_after = absl::InfiniteFuture());
  // The next reply (a Redis error reply is a reply: type REDIS_REPLY_ERROR). kUnavailable when
  // the connection fails, no reply completes within io_timeout, or the bytes are not RESP.
  absl::StatusOr<RedisReplyPtr> Read(absl::Time not_after = absl::InfiniteFuture());
  // Read, but with `direct_bulk` a bulk string of kDirectBulk bytes or more is read from the
  // socket (or out of TLS) straight into a 64-byte aligned buffer: none of the parser's copies,
  // nor its buffer's growth. One longer than kMaxBulk (Redis's own limit) is refused:
  // kUnavailable.
  absl::StatusOr<RedisDirectReply> ReadReply(absl::Time not_after, bool direct_bulk);
  static constexpr size_t kDirectBulk = 16 << 10;
  static constexpr size_t kMaxBulk = size_t{512} << 20;
  // Append, Flush and Read for one command.
  absl::StatusOr<RedisReplyPtr> Call(absl::Span<const absl::string_view> argv,
                                     absl::Time not_after = absl::InfiniteFuture());

  // A plain connection over `fd`, a connected stream socket it then owns (tests and fuzzing).
  static std::unique_ptr<RedisConnection> FromSocket(int fd, std::string address,
                                                     absl::Duration io_timeout);

  // Whether a connection that sat idle (in a pool) can take a command: false when it failed or
  // the server closed it meanwhile (Redis's `timeout`, CLIENT KILL, a restart). An idle
  // connection has nothing to read, save over TLS the records a server sends after the
  // handshake (session tickets), which are taken in here. Never waits.
  bool Reusable();

  const std::string& address() const { return address_; }

 private:
  RedisConnection(int fd, std::string address, absl::Duration io_timeout);
  absl::Status Handshake(const RedisTlsContext& tls, const std::string& host, absl::Time deadline);
  absl::Status SendRaw(const char* p, size_t n, absl::Time deadline);
  // Every byte of `iov` (advanced in place) onto the socket in gathered writes, each wait for
  // room bounded by `idle` from its start and by `not_after`.
  absl::Status SendAll(std::vector<iovec>& iov, absl::Duration idle, absl::Time not_after);
  absl::StatusOr<size_t> RecvRaw(char* p, size_t n, absl::Time deadline);
  absl::Status Write(const char* p, size_t n, absl::Time deadline);  // through TLS where on
  absl::StatusOr<size_t> ReadSome(char* p, size_t n, absl::Time deadline);
  struct BulkHeader {
    size_t header_bytes = 0;  // "$<length>\r\n"
    size_t value_bytes = 0;
  };
  // At a '$' in in_: its length, waiting for the rest of the header if needed; nullopt for what
  // is not a length (nil, junk: hiredis judges it); kUnavailable past kMaxBulk.
  absl::StatusOr<std::optional<BulkHeader>> ParseBulkHeader(absl::Time not_after);
  // The bulk string at in_pos_ (its header parsed), read whole into an aligned buffer.
  absl::StatusOr<AlignedBuffer> ReadLargeBulk(const BulkHeader& bulk, absl::Time not_after);
  // Until in_ holds `n` unparsed bytes (n <= its size).
  absl::Status FillTo(size_t n, absl::Time not_after);
  // When one wait for the socket ends: io_timeout from now, capped by `not_after`.
  absl::Time WaitEnd(absl::Time not_after) const {
    return std::min(absl::Now() + io_timeout_, not_after);
  }
  absl::Status DrainTls(absl::Time deadline);   // TLS records made, onto the socket
  std::string PendingTlsAlert();                // the error of an alert already received, or ""
  // Marks the connection failed (never used again); kUnavailable naming the address.
  absl::Status Failed(absl::string_view what);

  int fd_;
  const std::string address_;
  const absl::Duration io_timeout_;
  ssl_st* ssl_ = nullptr;  // TLS: OpenSSL over memory BIOs, the socket driven here
  void* rbio_ = nullptr;   // BIO*: bytes from the socket for OpenSSL (owned by ssl_)
  void* wbio_ = nullptr;   // BIO*: OpenSSL's records for the socket (owned by ssl_)
  redisReader* reader_;
  // Queued output: owned runs of small bytes and views of large arguments, in order.
  struct Piece {
    std::string owned;
    absl::string_view view;
  };
  std::vector<Piece> out_;
  std::string small_;
  std::vector<char> in_;  // receive buffer: [in_pos_, in_len_) not yet parsed nor fed to hiredis
  size_t in_pos_ = 0;
  size_t in_len_ = 0;
  std::vector<char> tls_scratch_;  // TLS records received for a read smaller than one
  size_t feed_left_ = 0;     // bytes of the reply hiredis is being fed still to come
  bool to_newline_ = false;  // hiredis is being fed a one-line reply up to its '\n'
  bool failed_ = false;
};

}  // namespace strata::kvstore
