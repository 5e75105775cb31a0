#include "membership/etcd_client.h"

#include <poll.h>

#include <string_view>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "boost/asio/connect.hpp"
#include "boost/asio/ip/tcp.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "common/host_port.h"
#include "nlohmann/json.hpp"

namespace strata::membership {
namespace {

namespace beast = boost::beast;
constexpr size_t kMaxWatchLine = size_t{64} << 20;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

std::string UnB64(const json& v) {
  std::string out;
  if (v.is_string()) absl::Base64Unescape(v.get<std::string>(), &out);
  return out;
}

int64_t Int(const json& v) {  // int64 fields come as strings; zero values are omitted
  int64_t n = 0;
  if (v.is_string()) {
    (void)absl::SimpleAtoi(v.get<std::string>(), &n);
  } else if (v.is_number_integer()) {
    n = v.get<int64_t>();
  }
  return n;
}

const json& Field(const json& j, const char* name) {
  static const json kNull;
  if (!j.is_object()) return kNull;
  auto it = j.find(name);
  return it == j.end() ? kNull : *it;
}

// The end of the range of keys starting with `prefix` (etcd's range_end): its last byte below
// 0xff incremented, what follows dropped.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<unsigned char>(prefix.back()) < 0xff) {
      prefix.back() = static_cast<char>(static_cast<unsigned char>(prefix.back()) + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdKeyValue KeyValueOf(const json& kv) {
  EtcdKeyValue out;
  out.key = UnB64(Field(kv, "key"));
  out.value = UnB64(Field(kv, "value"));
  out.mod_revision = Int(Field(kv, "mod_revision"));
  out.lease = Int(Field(kv, "lease"));
  return out;
}

EtcdRange RangeOf(const json& r) {
  EtcdRange out;
  out.revision = Int(Field(Field(r, "header"), "revision"));
  const json& kvs = Field(r, "kvs");
  if (kvs.is_array()) {
    for (const json& kv : kvs) out.kvs.push_back(KeyValueOf(kv));
  }
  return out;
}

class HttpEtcdClient final : public EtcdClient {
 public:
  HttpEtcdClient(std::string endpoint, absl::Duration timeout)
      : endpoint_(std::move(endpoint)), timeout_(timeout) {
    // host:port, or a bare host on etcd's client port.
    absl::StatusOr<HostPort> hp = ParseHostPort(endpoint_);
    if (hp.ok()) {
      host_ = hp->host;
      port_ = std::to_string(hp->port);
    } else {
      host_ = endpoint_;
      port_ = "2379";
    }
  }

  absl::Status Put(const std::string& key, const std::string& value, int64_t lease) override {
    json body = {{"key", B64(key)}, {"value", B64(value)}};
    if (lease != 0) body["lease"] = std::to_string(lease);
    return Call("/v3/kv/put", body).status();
  }

  absl::StatusOr<EtcdRange> RangePrefix(const std::string& prefix) override {
    absl::StatusOr<json> r =
        Call("/v3/kv/range", {{"key", B64(prefix)}, {"range_end", B64(PrefixEnd(prefix))}});
    if (!r.ok()) return r.status();
    return RangeOf(*r);
  }

  absl::Status Delete(const std::string& key) override {
    return Call("/v3/kv/deleterange", {{"key", B64(key)}}).status();
  }

  absl::StatusOr<int64_t> Grant(absl::Duration ttl) override {
    const int64_t seconds = std::max<int64_t>(1, absl::ToInt64Seconds(ttl));
    absl::StatusOr<json> r = Call("/v3/lease/grant", {{"TTL", std::to_string(seconds)}});
    if (!r.ok()) return r.status();
    const int64_t id = Int(Field(*r, "ID"));
    if (id == 0) {
      return absl::InternalError(absl::StrCat(
          "etcd ", endpoint_, ": lease grant without an ID: ", Field(*r, "error").dump()));
    }
    return id;
  }

  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease) override {
    absl::StatusOr<json> r = Call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}});
    if (!r.ok()) return r.status();
    const int64_t ttl = Int(Field(Field(*r, "result"), "TTL"));
    if (ttl <= 0) {  // no TTL: the lease is gone
      return absl::NotFoundError(absl::StrCat("etcd ", endpoint_, ": lease ", lease, " expired"));
    }
    return absl::Seconds(ttl);
  }

  absl::Status Revoke(int64_t lease) override {
    return Call("/v3/lease/revoke", {{"ID", std::to_string(lease)}}).status();
  }

  absl::Status Watch(const std::string& prefix, int64_t start_revision,
                     const std::function<void(int64_t, const std::vector<EtcdEvent>&)>& on,
                     const std::atomic<bool>& stop) override {
    net::io_context ioc;
    tcp::socket socket(ioc);
    if (absl::Status s = Connect(ioc, socket); !s.ok()) return s;

    json create = {{"key", B64(prefix)}, {"range_end", B64(PrefixEnd(prefix))}};
    if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
    http::request<http::string_body> req{http::verb::post, "/v3/watch", 11};
    req.set(http::field::host, host_);
    req.set(http::field::content_type, "application/json");
    req.body() = json{{"create_request", create}}.dump();
    req.prepare_payload();
    beast::error_code ec;
    http::write(socket, req, ec);
    if (ec) return Unavailable("watch", ec.message());
    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(boost::none);
    std::string pending;
    // Non-blocking reads after a poll of at most a second, so that `stop` is seen (Asio's
    // blocking reads would wait out any receive timeout in a poll of their own).
    socket.non_blocking(true, ec);
    while (!stop.load()) {
      http::read_some(socket, buffer, parser, ec);  // what is buffered first, then the socket
      if (ec == net::error::would_block || ec == net::error::try_again) {
        ec = {};
        pollfd p{socket.native_handle(), POLLIN, 0};
        poll(&p, 1, 1000);
        continue;
      }
      if (ec) return Unavailable("watch", ec.message());
      if (parser.is_header_done() && parser.get().result_int() >= 400) {
        return Unavailable("watch", absl::StrCat("HTTP ", parser.get().result_int()));
      }
      std::string& body = parser.get().body();
      pending += body;
      body.clear();
      if (pending.size() > kMaxWatchLine && pending.find('\n') == std::string::npos) {
        return Unavailable("watch", "a line of over 64 MiB");
      }
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        const std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        if (absl::Status s = OnWatchLine(line, on); !s.ok()) return s;
      }
      if (parser.is_done()) {
        if (!pending.empty()) {
          if (absl::Status s = OnWatchLine(pending, on); !s.ok()) return s;
        }
        return Unavailable("watch", "the stream ended");
      }
    }
    return absl::CancelledError("etcd watch: stopped");
  }

 private:
  absl::Status OnWatchLine(const std::string& line,
                           const std::function<void(int64_t, const std::vector<EtcdEvent>&)>& on) {
    if (line.empty()) return absl::OkStatus();
    absl::StatusOr<EtcdWatchBatch> batch = ParseEtcdWatchLine(line, endpoint_);
    if (!batch.ok()) return batch.status();
    on(batch->revision, batch->events);
    return absl::OkStatus();
  }

  absl::Status Unavailable(const char* what, const std::string& why) const {
    return absl::UnavailableError(absl::StrCat("etcd ", endpoint_, ": ", what, ": ", why));
  }

  absl::Status Connect(net::io_context& ioc, tcp::socket& socket) const {
    beast::error_code ec;
    tcp::resolver resolver(ioc);
    const auto results = resolver.resolve(host_, port_, ec);
    if (ec) return Unavailable("resolve", ec.message());
    net::connect(socket, results, ec);
    if (ec) return Unavailable("connect", ec.message());
    return absl::OkStatus();
  }

  absl::StatusOr<json> Call(const std::string& path, const json& body) const {
    net::io_context ioc;
    beast::tcp_stream stream(ioc);
    stream.expires_after(absl::ToChronoMilliseconds(timeout_));
    tcp::resolver resolver(ioc);
    beast::error_code ec;
    const auto results = resolver.resolve(host_, port_, ec);
    if (ec) return Unavailable(path.c_str(), ec.message());
    stream.connect(results, ec);
    if (ec) return Unavailable(path.c_str(), ec.message());
    http::request<http::string_body> req{http::verb::post, path, 11};
    req.set(http::field::host, host_);
    req.set(http::field::content_type, "application/json");
    req.body() = body.dump();
    req.prepare_payload();
    http::write(stream, req, ec);
    if (ec) return Unavailable(path.c_str(), ec.message());
    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    // One-shot calls answer at once; the lease keepalive's stream sends its first message and
    // stays open: take what has come by the first complete line.
    while (!parser.is_done()) {
      http::read_some(stream, buffer, parser, ec);
      if (ec) break;
      if (parser.is_header_done() && parser.get().body().find('\n') != std::string::npos) break;
    }
    if (!parser.is_header_done()) return Unavailable(path.c_str(), ec ? ec.message() : "no answer");
    const int status = parser.get().result_int();
    std::string text = parser.get().body();
    if (const size_t nl = text.find('\n'); nl != std::string::npos) text.resize(nl);
    if (absl::Status s = EtcdAnswerStatus(status, text, absl::StrCat("etcd ", endpoint_, path));
        !s.ok()) {
      return s;
    }
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return Unavailable(path.c_str(),
                         absl::StrCat("an answer that is not JSON: ", text.substr(0, 200)));
    }
    return j;
  }

  const std::string endpoint_;
  const absl::Duration timeout_;
  std::string host_, port_;
};

}  // namespace

absl::StatusOr<EtcdWatchBatch> ParseEtcdWatchLine(const std::string& line,
                                                  const std::string& endpoint) {
  const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::UnavailableError(
        absl::StrCat("etcd ", endpoint, ": watch: a line that is not JSON"));
  }
  if (const json& err = Field(j, "error"); !err.is_null()) {
    return absl::UnavailableError(absl::StrCat("etcd ", endpoint, ": watch: ", err.dump()));
  }
  const json& result = Field(j, "result");
  if (Field(result, "canceled").is_boolean() && Field(result, "canceled").get<bool>()) {
    return absl::FailedPreconditionError(absl::StrCat("etcd ", endpoint,
                                                      ": watch canceled (compact revision ",
                                                      Int(Field(result, "compact_revision")), ")"));
  }
  EtcdWatchBatch batch;
  batch.revision = Int(Field(Field(result, "header"), "revision"));
  if (const json& evs = Field(result, "events"); evs.is_array()) {
    for (const json& e : evs) {
      EtcdEvent ev;
      ev.deleted = Field(e, "type").is_string() && Field(e, "type").get<std::string>() == "DELETE";
      ev.kv = KeyValueOf(Field(e, "kv"));
      batch.events.push_back(std::move(ev));
    }
  }
  return batch;
}

absl::StatusOr<EtcdRange> ParseEtcdRange(const std::string& body, const std::string& endpoint) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::UnavailableError(
        absl::StrCat("etcd ", endpoint, ": range: an answer that is not JSON"));
  }
  return RangeOf(j);
}

absl::Status EtcdAnswerStatus(int http_status, const std::string& body, const std::string& where) {
  if (http_status < 400) return absl::OkStatus();
  const std::string shown = body.substr(0, 200);
  if (http_status >= 500)
    return absl::UnavailableError(absl::StrCat(where, ": HTTP ", http_status, " ", shown));
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  const json& c = Field(j, "code");
  int code = c.is_number_integer() ? c.get<int>() : static_cast<int>(absl::StatusCode::kUnknown);
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int>(absl::StatusCode::kUnknown);
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(where, ": HTTP ", http_status, " ", shown));
}

std::unique_ptr<EtcdClient> NewHttpEtcdClient(const std::string& endpoint, absl::Duration timeout) {
  return std::make_unique<HttpEtcdClient>(endpoint, timeout);
}

}  // namespace strata::membership
