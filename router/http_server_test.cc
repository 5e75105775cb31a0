// The HTTP server for real over loopback (Beast's client on plain sockets), in front of a fake
// Backend: the Backend is the seam the router process implements, the server and client are real.
#include "router/http_server.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "boost/asio.hpp"
#include "boost/asio/ssl.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "router/openai_api.h"

namespace strata::router {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kLlama3Template[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

// The fake backend. Mode kScript answers every request at once, from inside Start, with the
// tokens "Hello", " world" and Finish(kStop); kHold sends one token "x" from Start and keeps the
// stream until the test calls FinishHeld.
class FakeBackend : public Backend {
 public:
  // kFailFirst: accepts the request, then fails it before any token with fail_status().
  // kChoices: every choice of the request (CompletionRequest::n) streams "c<i>" and finishes.
  enum class Mode { kScript, kHold, kFailFirst, kChoices };

  struct Shared {
    absl::Mutex mu;
    int cancels ABSL_GUARDED_BY(mu) = 0;
    int handles_destroyed ABSL_GUARDED_BY(mu) = 0;
  };

  class Handle : public RequestHandle {
   public:
    explicit Handle(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
    ~Handle() override {
      absl::MutexLock lock(&shared_->mu);
      shared_->handles_destroyed++;
    }
    void Cancel() override {
      absl::MutexLock lock(&shared_->mu);
      shared_->cancels++;
    }

   private:
    std::shared_ptr<Shared> shared_;
  };

  std::vector<ModelCard> Models() const override {
    return {ModelCard{"tiny", 1700000000, "strata", 2048}};
  }
  std::string ChatTemplateText(const std::string& model) const override {
    return model == "tiny" ? kLlama3Template : "";
  }
  absl::StatusOr<std::unique_ptr<RequestHandle>> Start(
      CompletionRequest request, std::shared_ptr<CompletionStream> stream) override {
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(request);
      if (!refuse_.ok()) return refuse_;
      if (request.model != "tiny") return absl::NotFoundError("no model " + request.model);
    }
    if (mode_ == Mode::kScript) {
      stream->Token("Hello", 1);
      stream->Token(" world", 2);
      stream->Finish(FinishReason::kStop, Usage{5, 2, 1});
    } else if (mode_ == Mode::kFailFirst) {
      absl::MutexLock lock(&mu_);
      stream->Fail(fail_status_);
    } else if (mode_ == Mode::kChoices) {
      for (uint32_t i = 0; i < request.n; ++i) {
        std::shared_ptr<CompletionStream> c = stream->Choice(i);
        if (c == nullptr) return absl::InternalError("no choice stream");
        c->Token(absl::StrCat("c", i), 10 + i);
        c->Finish(i == 0 ? FinishReason::kStop : FinishReason::kLength, Usage{4, 1 + i, 0});
      }
    } else {
      stream->Token("x", 3);
      absl::MutexLock lock(&mu_);
      held_.push_back(stream);
    }
    return std::make_unique<Handle>(shared_);
  }
  bool Healthy(std::string* detail) const override {
    *detail = "warming up";
    return healthy_;
  }
  std::string RenderMetrics() const override { return "strata_router_requests_total 7\n"; }

  void set_mode(Mode mode) { mode_ = mode; }
  void set_fail_status(absl::Status s) {
    absl::MutexLock lock(&mu_);
    fail_status_ = std::move(s);
  }
  void set_healthy(bool healthy) { healthy_ = healthy; }
  void Refuse(absl::Status status) {
    absl::MutexLock lock(&mu_);
    refuse_ = std::move(status);
  }
  std::vector<CompletionRequest> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  size_t held() {
    absl::MutexLock lock(&mu_);
    return held_.size();
  }
  void FinishHeld() {
    std::vector<std::shared_ptr<CompletionStream>> held;
    {
      absl::MutexLock lock(&mu_);
      held.swap(held_);
    }
    for (auto& s : held) s->Finish(FinishReason::kLength, Usage{1, 1, 0});
  }
  // Waits (bounded) until `n` cancels were seen; returns the count.
  int WaitForCancels(int n, absl::Duration timeout) {
    absl::MutexLock lock(&shared_->mu);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(shared_->mu) { return shared_->cancels >= n; };
    shared_->mu.AwaitWithTimeout(absl::Condition(&enough), timeout);
    return shared_->cancels;
  }
  int cancels() {
    absl::MutexLock lock(&shared_->mu);
    return shared_->cancels;
  }

 private:
  Mode mode_ = Mode::kScript;
  bool healthy_ = true;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  absl::Mutex mu_;
  absl::Status refuse_ ABSL_GUARDED_BY(mu_);
  absl::Status fail_status_ ABSL_GUARDED_BY(mu_) = absl::InternalError("unset");
  std::vector<CompletionRequest> requests_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<CompletionStream>> held_ ABSL_GUARDED_BY(mu_);
};

// A blocking client connection with a receive timeout, so that a broken server fails the test
// instead of hanging it.
class Client {
 public:
  explicit Client(uint16_t port) : socket_(ioc_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
    timeval tv{10, 0};
    setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }

  void Send(http::verb method, const std::string& target, const std::string& body,
            size_t content_length_override = 0) {
    http::request<http::string_body> req{method, target, 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    if (content_length_override != 0) req.content_length(content_length_override);
    http::write(socket_, req);
  }

  http::response<http::string_body> Read() {
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    http::read(socket_, buffer_, parser);
    return parser.release();
  }

  http::response<http::string_body> Call(http::verb method, const std::string& target,
                                         const std::string& body = "") {
    Send(method, target, body);
    return Read();
  }

  // Reads raw bytes until `needle` was seen (or the timeout); returns what was read.
  std::string ReadUntil(const std::string& needle) {
    std::string got;
    char buf[4096];
    while (got.find(needle) == std::string::npos) {
      boost::system::error_code ec;
      const size_t n = socket_.read_some(net::buffer(buf), ec);
      if (ec) break;
      got.append(buf, n);
    }
    return got;
  }

  tcp::socket& socket() { return socket_; }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
};

// The JSON payloads of an SSE body, and whether it ended with [DONE].
std::vector<std::string> SseEvents(const std::string& body) {
  std::vector<std::string> events;
  for (absl::string_view e : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(e, "data: ")) << e;
    events.emplace_back(e.substr(6));
  }
  return events;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = {}) {
    options.host = "127.0.0.1";
    options.port = 0;
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(options, &backend_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void SetUp() override { StartServer(); }
  uint16_t port() const { return server_->port(); }

  FakeBackend backend_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpServerTest, NonStreamingCompletion) {
  Client client(port());
  auto res = client.Call(http::verb::post, "/v1/completions",
                         R"({"model":"tiny","prompt":"Hi","max_tokens":8,"temperature":0})");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_THAT(std::string(res[http::field::content_type]), HasSubstr("application/json"));
  const json j = json::parse(res.body());
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["choices"][0]["text"], "Hello world");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(j["usage"]["total_tokens"], 7);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  EXPECT_THAT(j["id"].get<std::string>(), StartsWith("cmpl-"));
  EXPECT_EQ(std::string(res["X-Request-Id"]), j["id"].get<std::string>());
  const std::vector<CompletionRequest> seen = backend_.requests();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].prompt_text, "Hi");
  EXPECT_EQ(seen[0].sampling.max_tokens, 8u);
  EXPECT_EQ(seen[0].sampling.temperature, 0.0f);
  EXPECT_EQ(seen[0].request_id, j["id"].get<std::string>());

  // Keep-alive: a second request on the same connection, with a fresh id.
  auto again = client.Call(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"x"})");
  ASSERT_EQ(again.result_int(), 200);
  EXPECT_NE(json::parse(again.body())["id"], j["id"]);
}

TEST_F(HttpServerTest, StreamingCompletionSendsEventsInOrderThenDone) {
  Client client(port());
  auto res = client.Call(http::verb::post, "/v1/completions",
                         R"({"model":"tiny","prompt":"Hi","stream":true})");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_EQ(std::string(res[http::field::content_type]), "text/event-stream");
  EXPECT_TRUE(res.chunked());
  const std::vector<std::string> events = SseEvents(res.body());
  ASSERT_EQ(events.size(), 4u) << res.body();
  EXPECT_EQ(json::parse(events[0])["choices"][0]["text"], "Hello");
  EXPECT_EQ(json::parse(events[1])["choices"][0]["text"], " world");
  EXPECT_TRUE(json::parse(events[1])["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(json::parse(events[2])["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(events[3], "[DONE]");
  EXPECT_EQ(json::parse(events[0])["id"].get<std::string>(), std::string(res["X-Request-Id"]));
}

// Each streamed token is reported once, after the write that carried it, with the time since the
// backend handed it over; a non-streamed request reports none.
TEST_F(HttpServerTest, ReportsEachStreamedTokensRelayTime) {
  server_->Stop();
  absl::Mutex mu;
  std::vector<absl::Duration> seen;
  HttpServerOptions options;
  options.on_token_written = [&](absl::Duration d) {
    absl::MutexLock lock(&mu);
    seen.push_back(d);
  };
  StartServer(options);
  Client client(port());
  const absl::Time before = absl::Now();
  auto res = client.Call(http::verb::post, "/v1/completions",
                         R"({"model":"tiny","prompt":"Hi","stream":true})");
  const absl::Duration elapsed = absl::Now() - before;
  ASSERT_EQ(res.result_int(), 200) << res.body();
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(seen.size(), 2u);  // "Hello" and " world"
    for (absl::Duration d : seen) {
      EXPECT_GE(d, absl::ZeroDuration());
      EXPECT_LE(d, elapsed);
    }
  }
  ASSERT_EQ(client.Call(http::verb::post, "/v1/completions",
                        R"({"model":"tiny","prompt":"Hi"})").result_int(), 200);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(seen.size(), 2u);
}

TEST_F(HttpServerTest, ChatStreamWithUsageChunk) {
  Client client(port());
  auto res =
      client.Call(http::verb::post, "/v1/chat/completions",
                  R"({"model":"tiny","messages":[{"role":"user","content":"Hi"}],"stream":true,)"
                  R"("stream_options":{"include_usage":true}})");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  const std::vector<std::string> events = SseEvents(res.body());
  ASSERT_EQ(events.size(), 6u) << res.body();
  const json role = json::parse(events[0]);
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(role["usage"].is_null());
  EXPECT_EQ(json::parse(events[1])["choices"][0]["delta"]["content"], "Hello");
  EXPECT_EQ(json::parse(events[2])["choices"][0]["delta"]["content"], " world");
  EXPECT_EQ(json::parse(events[3])["choices"][0]["finish_reason"], "stop");
  const json usage = json::parse(events[4]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);
  EXPECT_EQ(events[5], "[DONE]");
  ASSERT_EQ(backend_.requests().size(), 1u);
  EXPECT_EQ(backend_.requests()[0].prompt_text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_TRUE(backend_.requests()[0].include_usage);
}

TEST_F(HttpServerTest, NonStreamingChat) {
  Client client(port());
  auto res = client.Call(http::verb::post, "/v1/chat/completions",
                         R"({"model":"tiny","messages":[{"role":"user","content":"Hi"}]})");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  const json j = json::parse(res.body());
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello world");
  EXPECT_THAT(j["id"].get<std::string>(), StartsWith("chatcmpl-"));
  EXPECT_EQ(backend_.requests()[0].sampling.max_tokens, 0u);  // chat: backend decides
}

struct BadRequestCase {
  std::string body;
  std::string param;    // expected error.param
  std::string message;  // a substring of error.message
};

TEST_F(HttpServerTest, BadRequestsAre400NamingTheField) {
  const std::vector<BadRequestCase> cases = {
      {R"({"model":"tiny","prompt":"x",)", "", "not valid JSON (at byte"},
      {R"({"model":"tiny","prompt":"x","temperature":"hot"})", "temperature",
       "temperature must be a number"},
      {R"({"model":"tiny","prompt":"x","max_tokens":0})", "max_tokens",
       "max_tokens must be >= 1, got 0"},
      {"{\"model\":\"tiny\",\"prompt\":\"a\xff b\"}", "prompt", "prompt must be valid UTF-8"},
      {R"({"model":"tiny"})", "prompt", "prompt is required"},
  };
  Client client(port());
  for (const BadRequestCase& c : cases) {
    auto res = client.Call(http::verb::post, "/v1/completions", c.body);
    ASSERT_EQ(res.result_int(), 400) << c.body;
    const json j = json::parse(res.body());
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(c.message));
    if (c.param.empty()) {
      EXPECT_TRUE(j["error"]["param"].is_null());
    } else {
      EXPECT_EQ(j["error"]["param"], c.param);
    }
    EXPECT_FALSE(std::string(res["X-Request-Id"]).empty());
  }
  EXPECT_TRUE(backend_.requests().empty());
}

TEST_F(HttpServerTest, UnknownModelIs404AndUnknownRouteIs404AndWrongMethodIs405) {
  Client client(port());
  auto model = client.Call(http::verb::post, "/v1/chat/completions",
                           R"({"model":"nope","messages":[{"role":"user","content":"Hi"}]})");
  EXPECT_EQ(model.result_int(), 404);
  EXPECT_EQ(json::parse(model.body())["error"]["type"], "not_found_error");
  auto route = client.Call(http::verb::get, "/v2/whatever");
  EXPECT_EQ(route.result_int(), 404);
  EXPECT_THAT(json::parse(route.body())["error"]["message"].get<std::string>(),
              HasSubstr("/v2/whatever"));
  auto method = client.Call(http::verb::get, "/v1/completions");
  EXPECT_EQ(method.result_int(), 405);
  auto method2 = client.Call(http::verb::post, "/v1/models", "{}");
  EXPECT_EQ(method2.result_int(), 405);
}

TEST_F(HttpServerTest, OversizedBodyIs413) {
  server_.reset();
  HttpServerOptions options;
  options.max_body_bytes = 64 * 1024;
  StartServer(options);
  Client client(port());
  const std::string big =
      absl::StrCat(R"({"model":"tiny","prompt":")", std::string(100 * 1024, 'a'), R"("})");
  client.Send(http::verb::post, "/v1/completions", big);
  auto res = client.Read();
  EXPECT_EQ(res.result_int(), 413);
  EXPECT_EQ(json::parse(res.body())["error"]["code"], "request_too_large");
  EXPECT_TRUE(backend_.requests().empty());
}

TEST_F(HttpServerTest, AStreamFailedBeforeItsFirstTokenGetsAnHttpStatusNotA200) {
  backend_.set_mode(FakeBackend::Mode::kFailFirst);
  backend_.set_fail_status(WithRetryAfter(absl::ResourceExhaustedError("decode queue full"), 7));
  Client client(port());
  auto res = client.Call(http::verb::post, "/v1/completions",
                         R"({"model":"tiny","prompt":"x","stream":true})");
  EXPECT_EQ(res.result_int(), 429);
  EXPECT_EQ(std::string(res[http::field::retry_after]), "7");
  EXPECT_THAT(std::string(res[http::field::content_type]), HasSubstr("application/json"));
  EXPECT_EQ(json::parse(res.body())["error"]["message"], "decode queue full");
  // The connection stays usable (a keep-alive error response, not a cut stream).
  backend_.set_fail_status(absl::DeadlineExceededError("too slow"));
  res = client.Call(http::verb::post, "/v1/chat/completions",
                    R"({"model":"tiny","messages":[{"role":"user","content":"a"}],"stream":true})");
  EXPECT_EQ(res.result_int(), 504);
}

TEST_F(HttpServerTest, SeveralChoicesEachCarryTheirIndex) {
  backend_.set_mode(FakeBackend::Mode::kChoices);
  Client client(port());
  auto res =
      client.Call(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"x","n":3})");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  const json j = json::parse(res.body());
  ASSERT_EQ(j["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], absl::StrCat("c", i));
  }
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][2]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 1 + 2 + 3);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  // Streaming: each choice's text and finish with its index, one [DONE] after the last.
  client.Send(http::verb::post, "/v1/completions",
              R"({"model":"tiny","prompt":"x","n":2,"stream":true})");
  const std::string body = client.ReadUntil("[DONE]");
  EXPECT_THAT(body, HasSubstr(R"("index":1,"text":"c1")"));
  EXPECT_THAT(body, HasSubstr(R"("index":0,"text":"c0")"));
  size_t done = 0;
  for (size_t at = body.find("[DONE]"); at != std::string::npos; at = body.find("[DONE]", at + 1)) {
    ++done;
  }
  EXPECT_EQ(done, 1u);
}

TEST_F(HttpServerTest, OverloadedBackendIs429WithRetryAfter) {
  backend_.Refuse(absl::ResourceExhaustedError("queue full"));
  Client client(port());
  auto res = client.Call(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"x"})");
  EXPECT_EQ(res.result_int(), 429);
  EXPECT_EQ(std::string(res[http::field::retry_after]), "1");
  EXPECT_EQ(json::parse(res.body())["error"]["message"], "queue full");
  backend_.Refuse(absl::UnavailableError("no decode node"));
  auto unavailable =
      client.Call(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"x"})");
  EXPECT_EQ(unavailable.result_int(), 503);
  EXPECT_TRUE(unavailable[http::field::retry_after].empty());
}

// With API keys: /v1/* needs a listed key (401 otherwise, OpenAI's error shape), the key's
// tenant goes first in the cache salt, probes stay open, and a tenant holding its limit of
// requests in flight gets 429 while another tenant is served.
TEST_F(HttpServerTest, ApiKeysGateTheApiAndSaltEachTenantsPrefixes) {
  server_->Stop();
  HttpServerOptions options;
  options.api_keys = std::make_shared<const ApiKeys>(*ApiKeys::Parse(
      "sk-team-a-0123456789abcdef team-a\nsk-team-b-0123456789abcdef team-b\n", "test"));
  options.max_in_flight_per_tenant = 1;
  StartServer(options);
  const std::string body = R"({"model":"tiny","prompt":"Hi","cache_salt":"mine"})";
  auto call = [&](const std::string& target, const std::string& key, const std::string& b,
                  http::verb verb = http::verb::post) {
    Client client(port());
    http::request<http::string_body> req{verb, target, 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    if (!key.empty()) req.set(http::field::authorization, "Bearer " + key);
    req.body() = b;
    req.prepare_payload();
    http::write(client.socket(), req);
    return client.Read();
  };
  auto missing = call("/v1/completions", "", body);
  EXPECT_EQ(missing.result_int(), 401);
  EXPECT_EQ(json::parse(missing.body())["error"]["code"], "invalid_api_key");
  EXPECT_THAT(json::parse(missing.body())["error"]["message"].get<std::string>(),
              HasSubstr("didn't provide an API key"));
  auto wrong = call("/v1/completions", "sk-team-c-0123456789abcdef", body);
  EXPECT_EQ(wrong.result_int(), 401);
  EXPECT_EQ(call("/v1/models", "", "", http::verb::get).result_int(), 401);
  EXPECT_EQ(call("/v1/models", "sk-team-b-0123456789abcdef", "", http::verb::get).result_int(),
            200);
  EXPECT_EQ(call("/health", "", "", http::verb::get).result_int(), 200);
  EXPECT_TRUE(backend_.requests().empty());  // nothing reached the backend unauthenticated
  ASSERT_EQ(call("/v1/completions", "sk-team-a-0123456789abcdef", body).result_int(), 200);
  ASSERT_EQ(call("/v1/completions", "sk-team-b-0123456789abcdef", body).result_int(), 200);
  std::vector<CompletionRequest> seen = backend_.requests();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].cache_salt, TenantSalt("team-a", "mine"));
  EXPECT_EQ(seen[1].cache_salt, TenantSalt("team-b", "mine"));

  // One request in flight per tenant: team-a's second waits its turn (429), team-b goes on.
  backend_.set_mode(FakeBackend::Mode::kHold);
  const std::string stream = R"({"model":"tiny","prompt":"Hi","stream":true})";
  Client held(port());
  {
    http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::authorization, "Bearer sk-team-a-0123456789abcdef");
    req.body() = stream;
    req.prepare_payload();
    http::write(held.socket(), req);
  }
  for (int i = 0; i < 200 && backend_.held() < 1; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(backend_.held(), 1u);
  auto limited = call("/v1/completions", "sk-team-a-0123456789abcdef", body);
  EXPECT_EQ(limited.result_int(), 429);
  EXPECT_THAT(json::parse(limited.body())["error"]["message"].get<std::string>(),
              HasSubstr("tenant team-a"));
  backend_.set_mode(FakeBackend::Mode::kScript);
  EXPECT_EQ(call("/v1/completions", "sk-team-b-0123456789abcdef", body).result_int(), 200);
  backend_.FinishHeld();
  EXPECT_THAT(held.ReadUntil("[DONE]"), HasSubstr("[DONE]"));
  for (int i = 0; i < 100; ++i) {  // its place comes back once the response is written
    if (call("/v1/completions", "sk-team-a-0123456789abcdef", body).result_int() == 200) return;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ADD_FAILURE() << "team-a never got its place back";
}

TEST_F(HttpServerTest, ClientDisconnectMidStreamCancels) {
  backend_.set_mode(FakeBackend::Mode::kHold);
  {
    Client client(port());
    client.Send(http::verb::post, "/v1/completions",
                R"({"model":"tiny","prompt":"Hi","stream":true})");
    const std::string got = client.ReadUntil("\"text\":\"x\"");
    ASSERT_THAT(got, HasSubstr("\"text\":\"x\"")) << got;
    EXPECT_EQ(backend_.cancels(), 0);
  }  // the client closes its socket
  EXPECT_EQ(backend_.WaitForCancels(1, absl::Seconds(10)), 1);
  backend_.FinishHeld();  // a late Finish after Cancel is ignored
}

TEST_F(HttpServerTest, ModelsHealthMetrics) {
  Client client(port());
  auto models = client.Call(http::verb::get, "/v1/models");
  ASSERT_EQ(models.result_int(), 200);
  const json m = json::parse(models.body());
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["object"], "model");
  EXPECT_EQ(m["data"][0]["max_model_len"], 2048);
  auto health = client.Call(http::verb::get, "/health");
  EXPECT_EQ(health.result_int(), 200);
  EXPECT_EQ(json::parse(health.body())["status"], "ok");
  auto metrics = client.Call(http::verb::get, "/metrics");
  EXPECT_EQ(metrics.result_int(), 200);
  EXPECT_THAT(std::string(metrics[http::field::content_type]), HasSubstr("version=0.0.4"));
  EXPECT_EQ(metrics.body(), "strata_router_requests_total 7\n");
  backend_.set_healthy(false);
  auto sick = client.Call(http::verb::get, "/health");
  EXPECT_EQ(sick.result_int(), 503);
  EXPECT_THAT(sick.body(), HasSubstr("warming up"));
}

TEST_F(HttpServerTest, HoldsAThousandOpenStreamsOnTwoThreads) {
  constexpr int kStreams = 1000;
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  const rlim_t want = 2 * kStreams + 200;
  if (limit.rlim_cur < want) {
    if (limit.rlim_max < want) GTEST_SKIP() << "RLIMIT_NOFILE hard limit below " << want;
    limit.rlim_cur = want;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);
  }
  server_.reset();
  HttpServerOptions options;
  options.threads = 2;
  options.log_requests = false;
  StartServer(options);
  backend_.set_mode(FakeBackend::Mode::kHold);
  const absl::Time start = absl::Now();

  std::vector<std::unique_ptr<Client>> clients;
  clients.reserve(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    clients.push_back(std::make_unique<Client>(port()));
    clients.back()->Send(http::verb::post, "/v1/completions",
                         R"({"model":"tiny","prompt":"Hi","stream":true})");
  }
  // Every stream gets its first event while all of them are open.
  for (int i = 0; i < kStreams; ++i) {
    const std::string got = clients[i]->ReadUntil("\"text\":\"x\"");
    ASSERT_THAT(got, HasSubstr("\"text\":\"x\"")) << "stream " << i;
  }
  EXPECT_EQ(backend_.held(), size_t{kStreams});
  EXPECT_EQ(backend_.cancels(), 0);
  // Then every one completes.
  backend_.FinishHeld();
  for (int i = 0; i < kStreams; ++i) {
    const std::string got = clients[i]->ReadUntil("data: [DONE]");
    ASSERT_THAT(got, HasSubstr("data: [DONE]")) << "stream " << i;
  }
  EXPECT_EQ(backend_.cancels(), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
}

TEST_F(HttpServerTest, StopCancelsOpenRequests) {
  backend_.set_mode(FakeBackend::Mode::kHold);
  Client client(port());
  client.Send(http::verb::post, "/v1/completions",
              R"({"model":"tiny","prompt":"Hi","stream":true})");
  ASSERT_THAT(client.ReadUntil("\"text\":\"x\""), HasSubstr("\"text\":\"x\""));
  server_->Stop();
  EXPECT_EQ(backend_.cancels(), 1);
  backend_.FinishHeld();  // after Stop: ignored, must not crash
}

TEST_F(HttpServerTest, HttpsServesTlsClientsAndCutsPlainHttp) {
  // A self-signed certificate for 127.0.0.1, made by openssl as an operator would.
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("strata-https-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string cert = (dir / "c.crt").string(), key = (dir / "c.key").string();
  const std::string cmd = absl::StrCat(
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj "
      "/CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 -keyout ",
      key, " -out ", cert, " 2>/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  HttpServerOptions https;
  https.tls_cert_file = cert;
  https.tls_key_file = key;
  server_.reset();
  StartServer(https);

  net::io_context ioc;
  net::ssl::context ctx(net::ssl::context::tls_client);
  ctx.load_verify_file(cert);
  ctx.set_verify_mode(net::ssl::verify_peer);
  ctx.set_verify_callback(net::ssl::host_name_verification("127.0.0.1"));
  net::ssl::stream<tcp::socket> tls(ioc, ctx);
  tls.next_layer().connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port()));
  tls.handshake(net::ssl::stream_base::client);
  http::request<http::string_body> req{http::verb::get, "/health", 11};
  req.set(http::field::host, "127.0.0.1");
  http::write(tls, req);
  beast::flat_buffer buffer;
  http::response<http::string_body> health;
  http::read(tls, buffer, health);
  EXPECT_EQ(health.result_int(), 200);
  EXPECT_EQ(json::parse(health.body())["status"], "ok");

  // Plain HTTP to the HTTPS port: no answer, the connection is closed.
  Client plain(port());
  EXPECT_ANY_THROW(plain.Call(http::verb::get, "/health"));

  // One file without the other, and a file that is not a certificate.
  HttpServerOptions half;
  half.tls_cert_file = cert;
  EXPECT_EQ(HttpServer::Start(half, &backend_).status().code(),
            absl::StatusCode::kInvalidArgument);
  HttpServerOptions not_a_cert;
  not_a_cert.tls_cert_file = key;
  not_a_cert.tls_key_file = key;
  EXPECT_EQ(HttpServer::Start(not_a_cert, &backend_).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::router
