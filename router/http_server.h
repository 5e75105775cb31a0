// The router's OpenAI-compatible HTTP/1.1 server (Boost.Beast on Boost.Asio) in front of a
// Backend (backend.h).
//
// Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
// GET /metrics. Other paths: 404 JSON; a known path with the wrong method: 405 JSON. Every
// response carries X-Request-Id (completions: the request id; others: a fresh "req-..." id); 429
// responses carry Retry-After (the backend's estimate of when there is room, 1 s without one).
// `X-Request-Timeout: SECONDS` on a completion request sets its deadline (CompletionRequest::
// timeout): every node gives the request up then. One log line per request goes to stderr (id,
// route, status, duration) unless HttpServerOptions::log_requests is false.
//
// Concurrency: one io_context run by `threads` threads; each connection is an object serialized
// on its own strand, so a bounded number of threads holds any number of open streams. While a
// request is with the backend the connection keeps reading: EOF or an error (client gone) cancels
// the request through its RequestHandle. A pipelined request is read and held until the current
// response is done (no more reads meanwhile). Non-streaming responses keep the connection alive;
// so do streams that end normally. A stream that failed mid-way sends one SSE error event, ends
// the chunked body and closes the connection. A client that reads a stream slower than it is
// produced is disconnected (and its request cancelled) once max_pending_stream_bytes are queued.
//
// Streaming (stream: true): the 200 and the headers go out with the stream's first event (the
// first token, or its end), so that a request refused before any token (overload: 429 with
// Retry-After; a lost node: 503) gets that status rather than an error event after a 200.
// Then: Content-Type: text/event-stream, chunked transfer; each event
// "data: {...}\n\n" is written as soon as it arrives (events that pile up while a write is in
// flight go out together in the next chunk); then, for a stream that finished, "data: [DONE]".
//
// Thread safety: Start, port and Stop may be called from any thread; Stop is idempotent and is
// called by the destructor. The Backend must outlive the server. After Stop returns no thread of
// the server runs, every open request was cancelled (its RequestHandle destroyed), and
// CompletionStream calls still made by the backend are ignored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "router/api_keys.h"
#include "router/backend.h"

namespace strata::router {

struct HttpServerOptions {
  std::string host = "0.0.0.0";             // address to listen on (IPv4 or IPv6 literal)
  uint16_t port = 0;                        // 0: any free port (see HttpServer::port)
  int threads = 2;                          // I/O threads running the io_context, >= 1
  size_t max_body_bytes = size_t{4} << 20;  // larger request bodies: 413, connection closed
  size_t max_connections = 4096;            // further connections are accepted and closed at once
  // A connection with no request in flight is closed after this long without a complete request
  // (covers slow or stalled header/body reads too).
  absl::Duration idle_timeout = absl::Seconds(60);
  // A single write (response, or a stream chunk) that takes longer closes the connection.
  absl::Duration write_timeout = absl::Seconds(30);
  // Stream bytes queued for a client that does not read; more closes it and cancels the request.
  size_t max_pending_stream_bytes = size_t{8} << 20;
  bool log_requests = true;  // one line per request on stderr
  // When set, called on an I/O thread once per streamed token event with the time from the
  // backend's CompletionStream::Token call to the end of the socket write that carried it to the
  // client: what the HTTP side adds to each token (the router's `token_relay` histogram).
  std::function<void(absl::Duration)> on_token_written;
  // When set, /v1/* requests must carry `Authorization: Bearer KEY` with a listed key (401
  // otherwise); the key's tenant goes first in the request's cache salt (api_keys.h). /health
  // and /metrics stay open (probes, scrapers).
  std::shared_ptr<const ApiKeys> api_keys;
  // With api_keys: completions in flight per tenant at most (more: 429); 0 = no limit.
  size_t max_in_flight_per_tenant = 0;
  // HTTPS when both are set (PEM certificate chain and private key; TLS 1.2 and later): a
  // connection that fails the handshake (plain HTTP included) is closed. Both empty: plain HTTP.
  std::string tls_cert_file = "";
  std::string tls_key_file = "";

  absl::Status Validate() const;
};

class HttpServer {
 public:
  // Binds, listens and starts the I/O threads. INVALID_ARGUMENT for bad options (or a null
  // backend, or TLS files that do not load), UNAVAILABLE when the address cannot be bound. `backend` is not owned.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           Backend* backend);
  virtual ~HttpServer() = default;

  // The bound port (the one chosen when options.port was 0).
  virtual uint16_t port() const = 0;
  // Stops accepting, closes every connection, cancels open requests, joins the threads.
  virtual void Stop() = 0;
};

}  // namespace strata::router
