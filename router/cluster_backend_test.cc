// ClusterBackend against real gRPC on loopback: fake prefill and decode nodes (the seam is the
// serving.proto services; the nodes' engines are tested in their own folders) and a real store.
#include "router/cluster_backend.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/testing/free_port.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvstore/block_store.h"
#include "kvstore/shared_tier.h"
#include "kvstore/store_service.h"
#include "kvstore/testing/redis_cluster_process.h"
#include "model/llama.h"
#include "router/openai_api.h"

namespace strata::router {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "strata-tiny";
constexpr uint32_t kBos = 4094;
constexpr uint32_t kContext = 2048;

std::string ModelDir() { return std::string(STRATA_SOURCE_DIR) + "/models/strata-tiny"; }

bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Records what the backend sends; counts the ends (exactly one is allowed).
class RecordingStream : public CompletionStream {
 public:
  void Token(std::string_view text, uint32_t token_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    text_ += text;
    tokens_.push_back(token_id);
  }
  void Finish(FinishReason reason, const Usage& usage) override {
    std::lock_guard<std::mutex> lock(mu_);
    reason_ = reason;
    usage_ = usage;
    ++ends_;
    cv_.notify_all();
  }
  void Fail(const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = status;
    ++ends_;
    cv_.notify_all();
  }
  bool WaitEnded(absl::Duration timeout = absl::Seconds(10)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [&] { return ends_ > 0; });
  }
  int ends() {
    std::lock_guard<std::mutex> lock(mu_);
    return ends_;
  }
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }
  std::vector<uint32_t> tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_;
  }
  absl::Status failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }
  Usage usage() {
    std::lock_guard<std::mutex> lock(mu_);
    return usage_;
  }
  FinishReason reason() {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::string text_;
  std::vector<uint32_t> tokens_;
  FinishReason reason_ = FinishReason::kLength;
  Usage usage_;
  absl::Status failure_;
  int ends_ = 0;
};

// What the fake nodes do and saw.
struct FakeState {
  enum class Decode { kGenerate, kHold, kDieAfterRegistered };
  std::mutex mu;
  std::condition_variable cv;
  Decode decode = Decode::kGenerate;
  bool prefill_fails = false;
  grpc::StatusCode prefill_error = grpc::StatusCode::RESOURCE_EXHAUSTED;
  std::string prefill_id = "prefill-0";  // what the prefill service's Load reports
  std::string prefill_codec = "fp16";    // and the codec it serves
  uint64_t prefill_queued_tokens = 0;
  uint64_t prefill_max_queued_tokens = 0;  // the queue bound the prefill node reports
  double prefill_tokens_per_second = 0;
  int handoffs_left = 0;  // Generate calls that stream one token, then hand the request off
  std::vector<strata::v1::GenerateRequest> generates;
  std::vector<strata::v1::PrefillRequest> prefills;
  int decode_cancelled = 0;

  bool PrefillArrived(const std::string& id) {
    for (const auto& p : prefills) {
      if (p.request_id() == id) return true;
    }
    return false;
  }
};

strata::v1::NodeLoad FakeLoad(const char* id, const char* role) {
  strata::v1::NodeLoad l;
  l.set_node_id(id);
  l.set_role(role);
  l.set_model(kModel);
  l.set_codec("fp16");
  l.set_chunk_tokens(64);
  l.set_context_tokens(kContext);
  l.set_incarnation(7);
  if (std::string(role) == "decode") {
    l.set_kv_bytes_capacity(uint64_t{1} << 30);
    l.set_kv_bytes_per_token(1024);
    l.set_max_batch(64);
  }
  return l;
}

class FakeDecode final : public strata::v1::DecodeNode::Service {
 public:
  explicit FakeDecode(FakeState* s, std::string id = "decode-0") : s_(s), id_(std::move(id)) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const strata::v1::GenerateRequest* req,
                        grpc::ServerWriter<strata::v1::GenerateEvent>* writer) override {
    FakeState::Decode mode;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->generates.push_back(*req);
      mode = s_->decode;
    }
    strata::v1::GenerateEvent registered;
    registered.mutable_registered()->set_transport_address("fake-transport:1");
    registered.mutable_registered()->set_node_id("decode-0");
    writer->Write(registered);
    if (mode == FakeState::Decode::kDieAfterRegistered) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the decode node crashed");
    }
    bool prefill_fails = false;
    {
      std::unique_lock<std::mutex> lock(s_->mu);
      while (!s_->PrefillArrived(req->request_id()) && !ctx->IsCancelled()) {
        s_->cv.wait_for(lock, std::chrono::milliseconds(5));
      }
      prefill_fails = s_->prefill_fails;
    }
    bool hand_off = false;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (s_->handoffs_left > 0 && !prefill_fails) {
        --s_->handoffs_left;
        hand_off = true;
      }
    }
    if (hand_off) {  // as a draining node: one token, then the hand-off
      strata::v1::GenerateEvent t;
      t.mutable_token()->set_token(72);
      t.mutable_token()->set_text("Hello");
      writer->Write(t);
      strata::v1::GenerateEvent h;
      h.mutable_handed_off()->set_completion_tokens(1);
      h.mutable_handed_off()->set_text("!");
      writer->Write(h);
      return grpc::Status::OK;
    }
    if (mode == FakeState::Decode::kHold || prefill_fails || ctx->IsCancelled()) {
      while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(2));
      std::lock_guard<std::mutex> lock(s_->mu);
      ++s_->decode_cancelled;
      s_->cv.notify_all();
      return grpc::Status(grpc::StatusCode::CANCELLED, "the caller cancelled");
    }
    for (auto [id, text] : {std::pair<uint32_t, const char*>{72, "Hello"}, {73, " world"}}) {
      strata::v1::GenerateEvent e;
      e.mutable_token()->set_token(id);
      e.mutable_token()->set_text(text);
      writer->Write(e);
    }
    strata::v1::GenerateEvent done;
    done.mutable_finished()->set_reason(strata::v1::FINISH_STOP);
    done.mutable_finished()->set_prompt_tokens(req->prompt_size());
    done.mutable_finished()->set_completion_tokens(2);
    done.mutable_finished()->set_cached_tokens(3);
    writer->Write(done);
    return grpc::Status::OK;
  }

  grpc::Status Load(grpc::ServerContext*, const strata::v1::LoadRequest*,
                    strata::v1::NodeLoad* resp) override {
    *resp = FakeLoad(id_.c_str(), "decode");
    return grpc::Status::OK;
  }

 private:
  FakeState* s_;
  const std::string id_;
};

class FakePrefill final : public strata::v1::PrefillNode::Service {
 public:
  explicit FakePrefill(FakeState* s) : s_(s) {}

  grpc::Status Prefill(grpc::ServerContext*, const strata::v1::PrefillRequest* req,
                       strata::v1::PrefillResponse* resp) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->prefills.push_back(*req);
    s_->cv.notify_all();
    if (s_->prefill_fails) {
      return grpc::Status(s_->prefill_error, s_->prefill_error == grpc::StatusCode::UNAVAILABLE
                                                 ? "the prefill host is gone"
                                                 : "prefill queue full");
    }
    resp->set_first_token(72);
    resp->set_prompt_tokens(req->tokens_size());
    resp->set_computed_tokens(req->tokens_size());
    resp->set_node_id("prefill-0");
    return grpc::Status::OK;
  }

  grpc::Status Load(grpc::ServerContext*, const strata::v1::LoadRequest*,
                    strata::v1::NodeLoad* resp) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    *resp = FakeLoad(s_->prefill_id.c_str(), "prefill");
    resp->set_codec(s_->prefill_codec);
    resp->set_queued_prefill_tokens(s_->prefill_queued_tokens);
    resp->set_max_queued_prefill_tokens(s_->prefill_max_queued_tokens);
    resp->set_prefill_tokens_per_second(s_->prefill_tokens_per_second);
    return grpc::Status::OK;
  }

 private:
  FakeState* s_;
};

// Both fake nodes on one server (the services differ, so two node entries may share it).
class FakeNodes {
 public:
  FakeNodes() : FakeNodes(nullptr, "decode-0") {}
  // With `shared`, the services use that state (nodes on several servers seeing one another's
  // requests); the decode service reports `decode_id`.
  FakeNodes(FakeState* shared, std::string decode_id)
      : decode_(shared != nullptr ? shared : &state, std::move(decode_id)),
        prefill_(shared != nullptr ? shared : &state) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&decode_);
    b.RegisterService(&prefill_);
    server_ = b.BuildAndStart();
  }
  ~FakeNodes() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1)); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  FakeState state;

 private:
  FakeDecode decode_;
  FakePrefill prefill_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// A loopback port nothing listens on (bound, then released).
int FreePort() {
  const uint16_t port = FreeLoopbackPort();
  EXPECT_NE(port, 0);
  return port;
}

membership::ClusterSpec Spec(const std::string& address, const std::string& store = "") {
  membership::ClusterSpec spec;
  spec.path = "test";
  spec.model = ModelDir();
  spec.codec = "fp16";
  spec.chunk_tokens = 64;
  spec.store = store;
  spec.nodes = {{.id = "prefill-0", .role = membership::Role::kPrefill, .grpc = address},
                {.id = "decode-0",
                 .role = membership::Role::kDecode,
                 .grpc = address,
                 .transport = "127.0.0.1:7301"}};
  return spec;
}

std::unique_ptr<ClusterBackend> MakeBackend(membership::ClusterSpec spec,
                                            uint32_t max_in_flight = 16,
                                            RetryBudgetOptions retry_budget = {}) {
  ClusterBackendOptions o;
  o.spec = std::move(spec);
  o.max_in_flight = max_in_flight;
  o.retry_budget = retry_budget;
  o.load_poll_interval = absl::Milliseconds(20);
  o.store_retry_interval = absl::Milliseconds(100);
  absl::StatusOr<std::unique_ptr<ClusterBackend>> b = ClusterBackend::Create(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// Until every node of the cluster file answers the backend's load polls.
bool WaitForEveryNodeHealthy(const ClusterBackend& backend) {
  return WaitFor([&] {
    const std::vector<NodeStatus> nodes = backend.Nodes();
    return !nodes.empty() && std::all_of(nodes.begin(), nodes.end(),
                                         [](const NodeStatus& n) { return n.healthy; });
  });
}

CompletionRequest Completion(std::string text, uint32_t max_tokens = 16) {
  static std::atomic<int> next{0};
  CompletionRequest r;
  r.request_id = absl::StrCat("cmpl-test", next.fetch_add(1));
  r.model = kModel;
  r.prompt_text = std::move(text);
  r.sampling.max_tokens = max_tokens;
  r.arrival = absl::Now();
  return r;
}

CompletionRequest TokenCompletion(std::vector<uint32_t> tokens, uint32_t max_tokens = 16) {
  CompletionRequest r = Completion("", max_tokens);
  r.prompt_tokens = std::move(tokens);
  return r;
}

// ---- without nodes ---------------------------------------------------------------------------

class UnreachableClusterTest : public testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeBackend(Spec(absl::StrCat("127.0.0.1:", FreePort())));
    ASSERT_NE(backend_, nullptr);
  }
  absl::Status StartStatus(CompletionRequest r) {
    return backend_->Start(std::move(r), std::make_shared<RecordingStream>()).status();
  }
  std::unique_ptr<ClusterBackend> backend_;
};

TEST_F(UnreachableClusterTest, DescribesTheModel) {
  std::vector<ModelCard> models = backend_->Models();
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0].id, kModel);
  EXPECT_EQ(models[0].max_model_len, kContext);
  EXPECT_THAT(backend_->ChatTemplateText(kModel), HasSubstr("<|start_header_id|>"));
  EXPECT_EQ(backend_->ChatTemplateText("other"), "");
}

TEST_F(UnreachableClusterTest, UnknownModelIsNotFound) {
  CompletionRequest r = Completion("hi");
  r.model = "gpt-4";
  absl::Status s = StartStatus(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("gpt-4"));
}

TEST_F(UnreachableClusterTest, TokenOutsideTheVocabularyNamesPrompt) {
  absl::Status s = StartStatus(TokenCompletion({1, 2, 4096}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ErrorParam(s), "prompt");
  EXPECT_THAT(s.message(), HasSubstr("prompt[2] = 4096"));
}

TEST_F(UnreachableClusterTest, PromptOverTheContextNamesTheField) {
  absl::Status s = StartStatus(TokenCompletion(std::vector<uint32_t>(kContext, 5)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ErrorParam(s), "prompt");

  CompletionRequest chat = Completion("");
  chat.chat = true;
  for (int i = 0; i < 1000; ++i) chat.prompt_text += "hello world ";
  chat.sampling.max_tokens = 0;
  s = StartStatus(chat);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ErrorParam(s), "messages");

  s = StartStatus(TokenCompletion(std::vector<uint32_t>(100, 5), kContext - 99));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ErrorParam(s), "max_tokens");
  EXPECT_THAT(s.message(), HasSubstr("2049 tokens"));
}

TEST_F(UnreachableClusterTest, NoHealthyNodeIsUnavailable) {
  absl::Status s = StartStatus(TokenCompletion(std::vector<uint32_t>(100, 5), kContext - 100));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(backend_->in_flight(), 0u);
}

TEST_F(UnreachableClusterTest, UnhealthyNamesTheNodes) {
  // Wait for the first poll's verdict (the nodes never answer).
  std::string detail;
  ASSERT_TRUE(WaitFor([&] {
    backend_->Healthy(&detail);
    return absl::StrContains(detail, "UNAVAILABLE");
  })) << detail;
  EXPECT_FALSE(backend_->Healthy(&detail));
  EXPECT_THAT(detail, HasSubstr("no healthy prefill node"));
  EXPECT_THAT(detail, HasSubstr("prefill-0"));
  EXPECT_THAT(detail, HasSubstr("decode-0"));
  EXPECT_THAT(backend_->RenderMetrics(),
              HasSubstr("strata_router_node_healthy{node=\"decode-0\",role=\"decode\"} 0"));
}

TEST_F(UnreachableClusterTest, RefusalsAreCounted) {
  CompletionRequest r = Completion("hi");
  r.model = "nope";
  (void)StartStatus(r);
  (void)StartStatus(TokenCompletion({9999}));
  const std::string metrics = backend_->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("strata_router_requests_total{status=\"not_found\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_requests_total{status=\"invalid_argument\"} 1"));
}

TEST(ClusterBackendOptionsTest, ValidateNamesTheField) {
  ClusterBackendOptions o;
  o.spec = Spec("127.0.0.1:1");
  EXPECT_TRUE(o.Validate().ok());
  o.max_in_flight = 0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_in_flight"));
  o.max_in_flight = 1;
  o.load_poll_interval = absl::ZeroDuration();
  EXPECT_THAT(o.Validate().message(), HasSubstr("load_poll_interval"));
  o.load_poll_interval = absl::Milliseconds(100);
  o.spec.chunk_tokens = 70;  // not a multiple of the hash block (16)
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// ---- with fake nodes -------------------------------------------------------------------------

class FakeClusterTest : public testing::Test {
 protected:
  void SetUp() override { Make(16); }
  void Make(uint32_t max_in_flight) {
    backend_.reset();
    backend_ = MakeBackend(Spec(nodes_.address()), max_in_flight);
    ASSERT_NE(backend_, nullptr);
    std::string detail;
    ASSERT_TRUE(WaitFor([&] { return backend_->Healthy(&detail); })) << detail;
  }
  FakeState& state() { return nodes_.state; }

  FakeNodes nodes_;
  std::unique_ptr<ClusterBackend> backend_;
};

TEST_F(FakeClusterTest, GeneratesThroughBothNodes) {
  auto stream = std::make_shared<RecordingStream>();
  CompletionRequest r = Completion("Hello there", 5);
  r.sampling.stop = {"\n"};
  r.cache_salt = "tenant-a";
  const std::string id = r.request_id;
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(r, stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  EXPECT_TRUE(stream->failure().ok()) << stream->failure();
  EXPECT_EQ(stream->text(), "Hello world");
  EXPECT_EQ(stream->tokens(), (std::vector<uint32_t>{72, 73}));
  EXPECT_EQ(stream->reason(), FinishReason::kStop);
  EXPECT_EQ(stream->usage().completion_tokens, 2u);
  EXPECT_EQ(stream->usage().cached_tokens, 3u);

  std::lock_guard<std::mutex> lock(state().mu);
  ASSERT_EQ(state().generates.size(), 1u);
  ASSERT_EQ(state().prefills.size(), 1u);
  const strata::v1::GenerateRequest& g = state().generates[0];
  const strata::v1::PrefillRequest& p = state().prefills[0];
  EXPECT_EQ(g.request_id(), id);
  EXPECT_EQ(p.request_id(), id);
  ASSERT_GT(g.prompt_size(), 1);
  EXPECT_EQ(g.prompt(0), kBos);  // completions text: the model's BOS first
  EXPECT_NE(g.prompt(1), kBos);
  EXPECT_EQ(stream->usage().prompt_tokens, static_cast<uint32_t>(g.prompt_size()));
  EXPECT_EQ(std::vector<uint32_t>(p.tokens().begin(), p.tokens().end()),
            std::vector<uint32_t>(g.prompt().begin(), g.prompt().end()));
  EXPECT_EQ(p.decode_address(), "fake-transport:1");
  EXPECT_EQ(g.max_tokens(), 5u);
  ASSERT_EQ(g.stop_size(), 1);
  EXPECT_EQ(g.stop(0), "\n");
  EXPECT_EQ(g.cache_salt(), "tenant-a");
  EXPECT_EQ(p.cache_salt(), "tenant-a");
  EXPECT_EQ(p.sampling().seed(), g.sampling().seed());  // one seed for the first token and the rest
}

TEST_F(FakeClusterTest, CountsAndReleasesAFinishedRequest) {
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(Completion("hi"), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  ASSERT_TRUE(WaitFor([&] { return backend_->in_flight() == 0; }));
  h->reset();  // a finished request's handle: nothing happens
  EXPECT_EQ(stream->ends(), 1);
  const std::string metrics = backend_->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("strata_router_requests_total{status=\"ok\"} 1"));
  EXPECT_THAT(metrics,
              HasSubstr("strata_router_routed_total{decode=\"decode-0\",prefill=\"prefill-0\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_completion_tokens_total 2"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_cached_tokens_total 3"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_ttft_seconds_count 1"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_inter_token_seconds_count 1"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_in_flight 0"));
}

TEST_F(FakeClusterTest, ChatPromptKeepsItsOwnBosAndFillsTheContext) {
  auto stream = std::make_shared<RecordingStream>();
  CompletionRequest r = Completion(
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n",
      0);
  r.chat = true;
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(r, stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  std::lock_guard<std::mutex> lock(state().mu);
  const strata::v1::GenerateRequest& g = state().generates.at(0);
  EXPECT_EQ(g.prompt(0), kBos);
  EXPECT_NE(g.prompt(1), kBos);  // no second BOS
  EXPECT_EQ(g.max_tokens(), kContext - static_cast<uint32_t>(g.prompt_size()));
}

TEST_F(FakeClusterTest, CompletionsTextStartingWithBosGetsNoSecond) {
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h =
      backend_->Start(Completion("<|begin_of_text|>Once upon"), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  std::lock_guard<std::mutex> lock(state().mu);
  const strata::v1::GenerateRequest& g = state().generates.at(0);
  EXPECT_EQ(g.prompt(0), kBos);
  EXPECT_NE(g.prompt(1), kBos);
}

TEST_F(FakeClusterTest, TokenPromptIsUsedAsGiven) {
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h =
      backend_->Start(TokenCompletion({10, 11, 12}), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  std::lock_guard<std::mutex> lock(state().mu);
  const strata::v1::GenerateRequest& g = state().generates.at(0);
  EXPECT_EQ(std::vector<uint32_t>(g.prompt().begin(), g.prompt().end()),
            (std::vector<uint32_t>{10, 11, 12}));
}

TEST_F(FakeClusterTest, PrefillErrorFailsTheRequestAndCancelsTheDecode) {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().prefill_fails = true;
  }
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(Completion("hi"), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  EXPECT_EQ(stream->failure().code(), absl::StatusCode::kResourceExhausted) << stream->failure();
  EXPECT_THAT(stream->failure().message(), HasSubstr("prefill node prefill-0"));
  EXPECT_THAT(stream->failure().message(), HasSubstr("prefill queue full"));
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().decode_cancelled == 1;
  }));
  ASSERT_TRUE(WaitFor([&] { return backend_->in_flight() == 0; }));
  EXPECT_EQ(stream->ends(), 1);
  EXPECT_THAT(backend_->RenderMetrics(),
              HasSubstr("strata_router_requests_total{status=\"resource_exhausted\"} 1"));
  // The node refused what the router admitted: a 429 all the same, counted as such, with a
  // Retry-After, and never retried.
  EXPECT_THAT(backend_->RenderMetrics(),
              HasSubstr("strata_router_rejected_total{reason=\"node\"} 1"));
  EXPECT_EQ(RetryAfterSeconds(stream->failure()), 1);
  EXPECT_THAT(backend_->RenderMetrics(), HasSubstr("strata_router_retries_total 0"));
}

// prefill-0 (preferred: idle) on `lost` answers UNAVAILABLE, as a lost host does; prefill-1
// (busy) and decode-0 on `good` work.
membership::ClusterSpec LostPrefillNodeSpec(FakeNodes& lost, FakeNodes& good) {
  {
    std::lock_guard<std::mutex> lock(lost.state.mu);
    lost.state.prefill_fails = true;
    lost.state.prefill_error = grpc::StatusCode::UNAVAILABLE;
  }
  {
    std::lock_guard<std::mutex> lock(good.state.mu);
    good.state.prefill_id = "prefill-1";
    good.state.prefill_queued_tokens = 100000;
  }
  membership::ClusterSpec spec = Spec(good.address());
  spec.nodes = {{.id = "prefill-0", .role = membership::Role::kPrefill, .grpc = lost.address()},
                {.id = "prefill-1", .role = membership::Role::kPrefill, .grpc = good.address()},
                {.id = "decode-0",
                 .role = membership::Role::kDecode,
                 .grpc = good.address(),
                 .transport = "127.0.0.1:7301"}};
  return spec;
}

TEST(ClusterBackendRetryTest, PrefillNodeLostBeforeTheFirstTokenIsRetriedOnceElsewhere) {
  // The request is routed again, once, avoiding prefill-0, and succeeds; the decode node's first
  // attempt is cancelled.
  FakeNodes lost, good;
  membership::ClusterSpec spec = LostPrefillNodeSpec(lost, good);
  std::unique_ptr<ClusterBackend> backend = MakeBackend(spec);
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(WaitForEveryNodeHealthy(*backend));
  auto stream = std::make_shared<RecordingStream>();
  CompletionRequest r = Completion("Hello there", 5);
  const std::string id = r.request_id;
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend->Start(r, stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  EXPECT_TRUE(stream->failure().ok()) << stream->failure();
  EXPECT_EQ(stream->text(), "Hello world");
  EXPECT_EQ(stream->ends(), 1);
  {
    std::lock_guard<std::mutex> lock(lost.state.mu);
    ASSERT_EQ(lost.state.prefills.size(), 1u);
    EXPECT_EQ(lost.state.prefills[0].request_id(), id);
  }
  {
    std::lock_guard<std::mutex> lock(good.state.mu);
    ASSERT_EQ(good.state.generates.size(), 2u);
    EXPECT_EQ(good.state.generates[0].request_id(), id);
    EXPECT_EQ(good.state.generates[1].request_id(), id + "-retry1");
    // One seed for both attempts: the retry samples what the first would have.
    EXPECT_EQ(good.state.generates[0].sampling().seed(), good.state.generates[1].sampling().seed());
    ASSERT_EQ(good.state.prefills.size(), 1u);
    EXPECT_EQ(good.state.prefills[0].request_id(), id + "-retry1");
  }
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(good.state.mu);
    return good.state.decode_cancelled == 1;  // the first attempt's partial sequence
  }));
  ASSERT_TRUE(WaitFor([&] { return backend->in_flight() == 0; }));
  const std::string metrics = backend->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("strata_router_retries_total 1"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_requests_total{status=\"ok\"} 1"));
}

TEST(ClusterBackendRetryTest, ASpentRetryBudgetFailsInsteadOfRetrying) {
  // As above, but a budget of no retries at all: the lost node's request fails (UNAVAILABLE)
  // and is counted as throttled.
  FakeNodes lost, good;
  membership::ClusterSpec spec = LostPrefillNodeSpec(lost, good);
  std::unique_ptr<ClusterBackend> backend =
      MakeBackend(spec, 16, RetryBudgetOptions{.ratio = 0, .min_per_second = 0});
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(WaitForEveryNodeHealthy(*backend));
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h =
      backend->Start(Completion("Hello there", 5), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  EXPECT_EQ(stream->failure().code(), absl::StatusCode::kUnavailable) << stream->failure();
  ASSERT_TRUE(WaitFor([&] { return backend->in_flight() == 0; }));
  const std::string metrics = backend->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("strata_router_retries_total 0"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_retries_throttled_total 1"));
  {
    std::lock_guard<std::mutex> lock(good.state.mu);
    EXPECT_TRUE(good.state.prefills.empty());
  }
}

TEST(ClusterBackendHandOffTest, HandedOffRequestsContinueElsewhereWithTheStreamedTokens) {
  // Two decode nodes; the first two Generate calls stream one token each and hand the request
  // off (as draining nodes do). Each continuation avoids the node that handed off, carries the
  // client's prompt followed by every token streamed so far, and what is left of max_tokens; the
  // client sees one stream and its own counts.
  FakeState shared;
  FakeNodes a(&shared, "decode-0"), b(&shared, "decode-1");
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    shared.handoffs_left = 2;
  }
  membership::ClusterSpec spec = Spec(a.address());
  spec.nodes = {{.id = "prefill-0", .role = membership::Role::kPrefill, .grpc = a.address()},
                {.id = "decode-0",
                 .role = membership::Role::kDecode,
                 .grpc = a.address(),
                 .transport = "127.0.0.1:7301"},
                {.id = "decode-1",
                 .role = membership::Role::kDecode,
                 .grpc = b.address(),
                 .transport = "127.0.0.1:7302"}};
  std::unique_ptr<ClusterBackend> backend = MakeBackend(spec);
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(WaitForEveryNodeHealthy(*backend));
  auto stream = std::make_shared<RecordingStream>();
  CompletionRequest r = Completion("Hello there", 8);
  const std::string id = r.request_id;
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend->Start(r, stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  ASSERT_TRUE(stream->failure().ok()) << stream->failure();
  EXPECT_EQ(stream->text(), "Hello!Hello!Hello world");
  // Each hand-off's held-back text ("!") comes as a text-only call with the last token's id.
  EXPECT_EQ(stream->tokens(), (std::vector<uint32_t>{72, 72, 72, 72, 72, 73}));
  EXPECT_EQ(stream->ends(), 1);
  std::vector<strata::v1::GenerateRequest> g;
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    g = shared.generates;
  }
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0].request_id(), id);
  EXPECT_EQ(g[1].request_id(), id + "-resume1");
  EXPECT_EQ(g[2].request_id(), id + "-resume2");
  std::vector<uint32_t> prompt(g[0].prompt().begin(), g[0].prompt().end());
  for (int hop = 1; hop <= 2; ++hop) {
    prompt.push_back(72);  // the token the previous node streamed
    EXPECT_EQ(std::vector<uint32_t>(g[hop].prompt().begin(), g[hop].prompt().end()), prompt)
        << "hop " << hop;
    EXPECT_EQ(g[hop].max_tokens(), 8u - hop);
    EXPECT_EQ(g[hop].sampling().seed(), g[0].sampling().seed());
  }
  EXPECT_EQ(stream->usage().prompt_tokens, static_cast<uint32_t>(g[0].prompt_size()));
  EXPECT_EQ(stream->usage().completion_tokens, 4u);
  ASSERT_TRUE(WaitFor([&] { return backend->in_flight() == 0; }));
  const std::string metrics = backend->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("strata_router_handoffs_total 2"));
  EXPECT_THAT(metrics, HasSubstr("strata_router_requests_total{status=\"ok\"} 1"));
}

TEST_F(FakeClusterTest, DecodeNodeDeathFailsTheRequest) {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().decode = FakeState::Decode::kDieAfterRegistered;
  }
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(Completion("hi"), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(stream->WaitEnded());
  EXPECT_EQ(stream->failure().code(), absl::StatusCode::kUnavailable) << stream->failure();
  EXPECT_THAT(stream->failure().message(), HasSubstr("decode node decode-0"));
  // Lost before the first token: retried once, and with no other decode node that fails too.
  EXPECT_THAT(stream->failure().message(), HasSubstr("the retry on other nodes failed"));
  ASSERT_TRUE(WaitFor([&] { return backend_->in_flight() == 0; }));
  EXPECT_EQ(stream->ends(), 1);
  EXPECT_THAT(backend_->RenderMetrics(), HasSubstr("strata_router_retries_total 1"));
  EXPECT_THAT(backend_->RenderMetrics(),
              HasSubstr("strata_router_requests_total{status=\"unavailable\"} 1"));
}

TEST_F(FakeClusterTest, CancelReachesTheNodes) {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().decode = FakeState::Decode::kHold;
  }
  auto stream = std::make_shared<RecordingStream>();
  CompletionRequest r = Completion("hi");
  const std::string id = r.request_id;
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(r, stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().PrefillArrived(id);
  }));
  EXPECT_EQ(backend_->in_flight(), 1u);
  (*h)->Cancel();
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().decode_cancelled == 1;
  }));
  ASSERT_TRUE(WaitFor([&] { return backend_->in_flight() == 0; }));
  (*h)->Cancel();  // again: nothing
  h->reset();
  EXPECT_EQ(stream->ends(), 0);  // no stream calls are needed after Cancel
  EXPECT_THAT(backend_->RenderMetrics(),
              HasSubstr("strata_router_requests_total{status=\"cancelled\"} 1"));
}

TEST_F(FakeClusterTest, AFullPrefillQueueIs429WithRetryAfterBeforeAnyCall) {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().prefill_queued_tokens = 1500;
    state().prefill_max_queued_tokens = 1000;
    state().prefill_tokens_per_second = 100;
  }
  // The router sees the node's report on its next poll.
  ASSERT_TRUE(WaitFor([&] {
    for (const NodeStatus& n : backend_->Nodes()) {
      if (n.report.max_queued_prefill_tokens() == 1000) return true;
    }
    return false;
  }));
  absl::StatusOr<std::unique_ptr<RequestHandle>> h =
      backend_->Start(Completion("hi"), std::make_shared<RecordingStream>());
  ASSERT_EQ(h.status().code(), absl::StatusCode::kResourceExhausted) << h.status();
  EXPECT_THAT(h.status().message(), HasSubstr(kNoPrefillRoom));
  // (1500 + the prompt - 1000) tokens at 100 tokens/s: about 5 s until it has room.
  EXPECT_GE(RetryAfterSeconds(h.status()), 5);
  EXPECT_LE(RetryAfterSeconds(h.status()), 7);
  EXPECT_THAT(backend_->RenderMetrics(),
              HasSubstr("strata_router_rejected_total{reason=\"prefill_queue\"} 1"));
  {
    std::lock_guard<std::mutex> lock(state().mu);
    EXPECT_TRUE(state().generates.empty());  // nothing reached a node
    EXPECT_TRUE(state().prefills.empty());
  }
}

// A node serving another codec than the cluster's (a stale deployment) is not routed to: its
// blocks would not be the cluster's.
TEST_F(FakeClusterTest, ANodeServingAnotherCodecIsUnhealthySayingWhich) {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().prefill_codec = "kivi:k2v2:g32";
  }
  std::string problem;
  ASSERT_TRUE(WaitFor([&] {
    for (const NodeStatus& n : backend_->Nodes()) {
      if (n.spec.id == "prefill-0" && !n.healthy) problem = n.problem;
    }
    return !problem.empty();
  }));
  EXPECT_THAT(problem, HasSubstr("serves codec kivi:k2v2:g32, the router fp16"));
  std::string detail;
  EXPECT_FALSE(backend_->Healthy(&detail));
}

TEST_F(FakeClusterTest, OverMaxInFlightIsResourceExhausted) {
  Make(1);
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().decode = FakeState::Decode::kHold;
  }
  auto held = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(Completion("one"), held);
  ASSERT_TRUE(h.ok()) << h.status();
  absl::StatusOr<std::unique_ptr<RequestHandle>> second =
      backend_->Start(Completion("two"), std::make_shared<RecordingStream>());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("max_in_flight"));
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().decode_cancelled == 0 && !state().prefills.empty();
  }));
  h->reset();  // destroying the handle cancels
  ASSERT_TRUE(WaitFor([&] { return backend_->in_flight() == 0; }));
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().decode_cancelled == 1;
  }));
  std::lock_guard<std::mutex> lock(state().mu);
  EXPECT_EQ(state().generates.size(), 1u);
}

TEST_F(FakeClusterTest, DestroyingTheBackendCancelsWhatIsInFlight) {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().decode = FakeState::Decode::kHold;
  }
  auto stream = std::make_shared<RecordingStream>();
  absl::StatusOr<std::unique_ptr<RequestHandle>> h = backend_->Start(Completion("hi"), stream);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return !state().prefills.empty();
  }));
  backend_.reset();  // returns once the calls ended
  EXPECT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().decode_cancelled == 1;
  }));
  h->reset();  // outlived the backend: a no-op
}

TEST_F(FakeClusterTest, ManyConcurrentRequestsAllEnd) {
  std::vector<std::shared_ptr<RecordingStream>> streams;
  std::vector<std::unique_ptr<RequestHandle>> handles;
  for (int i = 0; i < 12; ++i) {
    streams.push_back(std::make_shared<RecordingStream>());
    absl::StatusOr<std::unique_ptr<RequestHandle>> h =
        backend_->Start(Completion(absl::StrCat("request ", i)), streams.back());
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*std::move(h));
  }
  for (auto& s : streams) {
    ASSERT_TRUE(s->WaitEnded());
    EXPECT_EQ(s->text(), "Hello world");
  }
  ASSERT_TRUE(WaitFor([&] { return backend_->in_flight() == 0; }));
}

// ---- the store's events ----------------------------------------------------------------------

// The blocks of chain[0..chunks), every layer, as a prefill node names and encodes them (fp16).
std::vector<std::pair<BlockName, AlignedBuffer>> EncodeChunks(const model::LlamaModel& model,
                                                              const model::SequenceKvCache& cache,
                                                              const std::vector<BlockHash>& chain,
                                                              uint32_t chunks) {
  auto codec = *kernels::Codec::Create("fp16");
  const model::ModelConfig& c = model.config();
  std::vector<float> k(size_t{64} * c.num_kv_heads * c.head_dim, 0.25f), v(k.size(), -0.5f);
  std::vector<std::pair<BlockName, AlignedBuffer>> out;
  for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
    for (uint32_t l = 0; l < c.num_layers; ++l) {
      absl::StatusOr<AlignedBuffer> block = codec->Encode(
          {k.data(), v.data(), SourceDType::kFloat32, 64, c.num_kv_heads, c.head_dim},
          {.layer = l, .chunk_index = chunk, .model_fingerprint = model.fingerprint()});
      EXPECT_TRUE(block.ok()) << block.status();
      out.emplace_back(cache.NameOf(l, chain[chunk]), *std::move(block));
    }
  }
  return out;
}

TEST(ClusterBackendStoreTest, StoreThatStartsLaterFeedsTheIndex) {
  const int port = FreePort();
  const std::string address = absl::StrCat("127.0.0.1:", port);
  std::unique_ptr<ClusterBackend> backend = MakeBackend(Spec("127.0.0.1:1", address));
  ASSERT_NE(backend, nullptr);
  ASSERT_NE(backend->store_feed(), nullptr);
  absl::SleepFor(absl::Milliseconds(150));  // the first connection attempts fail
  EXPECT_FALSE(backend->store_feed()->connected());

  absl::StatusOr<std::unique_ptr<kvstore::BlockStore>> store =
      kvstore::BlockStore::Open({.ram_bytes = size_t{64} << 20});
  ASSERT_TRUE(store.ok()) << store.status();
  kvstore::StoreService service(store->get(), size_t{1} << 20);
  int bound = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      kvstore::StartStoreServer(&service, address, size_t{1} << 20, &bound);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_EQ(bound, port);

  // Two chunks of a prompt, every layer, named as the prefill nodes name them.
  absl::StatusOr<std::unique_ptr<model::LlamaModel>> model = model::LlamaModel::Load(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<model::SequenceKvCache>> cache =
      (*model)->NewCache({.codec = "fp16", .chunk_tokens = 64});
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::vector<uint32_t> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(100 + i);
  absl::StatusOr<std::vector<BlockHash>> chain = backend->ChunkKeys(prompt, "");
  ASSERT_TRUE(chain.ok());
  ASSERT_EQ(chain->size(), 2u);
  const uint32_t layers = (*model)->config().num_layers;
  uint32_t i = 0;
  for (auto& [name, block] : EncodeChunks(**model, **cache, *chain, 2)) {
    const uint32_t c = i++ / layers;
    const BlockHash* parent = c > 0 ? &(*chain)[c - 1] : nullptr;
    ASSERT_TRUE((*store)->Put(name, parent, block.span()).ok());
  }
  ASSERT_TRUE(WaitFor([&] {
    return backend->prefix_index().Overlap(*chain, absl::Now()).StoreChunks() == 2;
  })) << backend->prefix_index().Overlap(*chain, absl::Now()).StoreChunks();
  EXPECT_TRUE(backend->store_feed()->connected());
  // Another tenant's salt keys other chunks: nothing cached for it.
  absl::StatusOr<std::vector<BlockHash>> salted = backend->ChunkKeys(prompt, "tenant-b");
  ASSERT_TRUE(salted.ok());
  EXPECT_EQ(backend->prefix_index().Overlap(*salted, absl::Now()).StoreChunks(), 0u);
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(backend->RenderMetrics(), "strata_router_store_connected 1");
  }));

  // A removed layer removes the chunk (and the store drops its descendants).
  ASSERT_TRUE((*store)->Delete((*cache)->NameOf(0, (*chain)[1])));
  ASSERT_TRUE(WaitFor(
      [&] { return backend->prefix_index().Overlap(*chain, absl::Now()).StoreChunks() == 1; }));
  backend.reset();
  kvstore::StopStoreServer(server->get(), &service);
}

// A node that names a store of its own (its host's) gets that store watched too, under a holder
// of its own ("store@ADDRESS"): its chunks are not the cluster store's.
TEST(ClusterBackendStoreTest, AStoreANodeNamesAsItsHostsIsWatchedUnderItsOwnHolder) {
  struct Store {
    std::unique_ptr<kvstore::BlockStore> blocks;
    std::unique_ptr<kvstore::StoreService> service;
    std::unique_ptr<grpc::Server> server;
    std::string address;
  };
  Store stores[2];
  for (Store& st : stores) {
    st.blocks = *kvstore::BlockStore::Open({.ram_bytes = size_t{64} << 20});
    st.service = std::make_unique<kvstore::StoreService>(st.blocks.get(), size_t{1} << 20);
    int port = 0;
    absl::StatusOr<std::unique_ptr<grpc::Server>> server =
        kvstore::StartStoreServer(st.service.get(), "127.0.0.1:0", size_t{1} << 20, &port);
    ASSERT_TRUE(server.ok()) << server.status();
    st.server = *std::move(server);
    st.address = absl::StrCat("127.0.0.1:", port);
  }
  membership::ClusterSpec spec = Spec("127.0.0.1:1", stores[0].address);
  spec.nodes[0].store = stores[1].address;  // prefill-0's host runs a store of its own
  std::unique_ptr<ClusterBackend> backend = MakeBackend(spec);
  ASSERT_NE(backend, nullptr);

  absl::StatusOr<std::unique_ptr<model::LlamaModel>> model = model::LlamaModel::Load(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<model::SequenceKvCache>> cache =
      (*model)->NewCache({.codec = "fp16", .chunk_tokens = 64});
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::vector<uint32_t> prompt(140);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(500 + i);
  absl::StatusOr<std::vector<BlockHash>> chain = backend->ChunkKeys(prompt, "");
  ASSERT_TRUE(chain.ok());
  ASSERT_EQ(chain->size(), 2u);
  const uint32_t layers = (*model)->config().num_layers;
  uint32_t i = 0;
  for (auto& [name, block] : EncodeChunks(**model, **cache, *chain, 2)) {
    const uint32_t c = i++ / layers;
    const BlockHash* parent = c > 0 ? &(*chain)[c - 1] : nullptr;
    ASSERT_TRUE(stores[1].blocks->Put(name, parent, block.span()).ok());
  }
  const std::string holder = StoreHolderId(stores[1].address, stores[0].address);
  ASSERT_TRUE(WaitFor([&] {
    const OverlapResult o = backend->prefix_index().Overlap(*chain, absl::Now());
    const HolderOverlap* h = o.Find(holder);
    return h != nullptr && h->chunks == 2;
  }));
  EXPECT_EQ(backend->prefix_index().Overlap(*chain, absl::Now()).Find("store"), nullptr);
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(backend->RenderMetrics(), "strata_router_store_connected 1");
  }));
  backend.reset();
  for (Store& st : stores) kvstore::StopStoreServer(st.server.get(), st.service.get());
}

// ---- the shared tier ---------------------------------------------------------------------------

// Host A's store wrote a prompt's three chunks through to the shared tier; this router's store
// (host B's) holds only the first. Routing counts all three as store chunks, asking Redis; a
// chunk missing from Redis ends the run there; another tenant's keys find nothing; a Redis
// Cluster that is gone leaves the store's count, the error counted.
TEST(ClusterBackendSharedTierTest, ChunksOnlyTheSharedTierHoldsCountAsStoreChunks) {
  if (!kvstore::testing::RedisClusterProcess::Installed()) {
    GTEST_SKIP() << "skipped: no redis-server (scripts/setup.sh installs it)";
  }
  kvstore::testing::RedisClusterProcess redis(3, 0);
  std::string why;
  ASSERT_TRUE(redis.Start(&why)) << why;
  const kvstore::SharedTierOptions tier_options{.redis = {.seeds = {redis.seed()}}};

  absl::StatusOr<std::unique_ptr<kvstore::BlockStore>> store =
      kvstore::BlockStore::Open({.ram_bytes = size_t{64} << 20});
  ASSERT_TRUE(store.ok()) << store.status();
  kvstore::StoreService service(store->get(), size_t{1} << 20);
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      kvstore::StartStoreServer(&service, "127.0.0.1:0", size_t{1} << 20, &port);
  ASSERT_TRUE(server.ok()) << server.status();

  ClusterBackendOptions o;
  o.spec = Spec("127.0.0.1:1", absl::StrCat("127.0.0.1:", port));
  o.load_poll_interval = absl::Milliseconds(20);
  o.store_retry_interval = absl::Milliseconds(100);
  o.shared_tier = tier_options;
  o.shared_tier_probe_timeout = absl::Seconds(2);  // a loaded test machine
  absl::StatusOr<std::unique_ptr<ClusterBackend>> backend = ClusterBackend::Create(o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE(WaitFor([&] { return (*backend)->shared_tier_connected(); }));

  absl::StatusOr<std::unique_ptr<model::LlamaModel>> model = model::LlamaModel::Load(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<model::SequenceKvCache>> cache =
      (*model)->NewCache({.codec = "fp16", .chunk_tokens = 64});
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::vector<uint32_t> prompt(200);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(300 + i);
  absl::StatusOr<std::vector<BlockHash>> chain = (*backend)->ChunkKeys(prompt, "");
  ASSERT_TRUE(chain.ok());
  ASSERT_EQ(chain->size(), 3u);
  const uint32_t layers = (*model)->config().num_layers;
  absl::StatusOr<std::unique_ptr<kvstore::SharedTier>> host_a =
      kvstore::SharedTier::Connect(tier_options);
  ASSERT_TRUE(host_a.ok()) << host_a.status();
  uint32_t i = 0;
  for (auto& [name, block] : EncodeChunks(**model, **cache, *chain, 3)) {
    const uint32_t c = i++ / layers;
    if (c == 0) {
      ASSERT_TRUE((*store)->Put(name, nullptr, block.span()).ok());
    }
    const std::vector<absl::Status> put =
        (*host_a)->Put({{name, c, SharedBytes::FromBuffer(std::move(block))}});
    ASSERT_TRUE(put[0].ok()) << put[0];
  }
  ASSERT_TRUE(WaitFor(
      [&] { return (*backend)->prefix_index().Overlap(*chain, absl::Now()).StoreChunks() == 1; }));
  OverlapResult o3 = (*backend)->CachedOverlap(*chain, absl::Now());
  EXPECT_EQ(o3.StoreChunks(), 3u);
  const HolderOverlap* shared = o3.Find(kSharedTierHolder);
  ASSERT_NE(shared, nullptr);
  EXPECT_EQ(shared->kind, HolderKind::kStore);
  EXPECT_EQ(shared->chunks, 3u);
  const std::string metrics = (*backend)->RenderMetrics();
  EXPECT_THAT(metrics, ::testing::HasSubstr("strata_router_shared_tier_probes_total 1"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("strata_router_shared_tier_chunks_total 3"));

  // Another tenant's salt keys other chunks: nothing anywhere.
  absl::StatusOr<std::vector<BlockHash>> salted = (*backend)->ChunkKeys(prompt, "tenant-b");
  ASSERT_TRUE(salted.ok());
  EXPECT_EQ((*backend)->CachedOverlap(*salted, absl::Now()).StoreChunks(), 0u);

  // Chunk 1's last layer gone from Redis: the run stops at the store's chunk.
  const std::string gone = (*host_a)->KeyOf((*cache)->NameOf(layers - 1, (*chain)[1]));
  ASSERT_TRUE((*host_a)->redis().Run({{"DEL", gone}}, absl::Now() + absl::Seconds(5))[0].ok());
  OverlapResult o1 = (*backend)->CachedOverlap(*chain, absl::Now());
  EXPECT_EQ(o1.StoreChunks(), 1u);
  ASSERT_NE(o1.Find(kSharedTierHolder), nullptr);  // chunk 0 is still there
  EXPECT_EQ(o1.Find(kSharedTierHolder)->chunks, 1u);

  // The whole Redis Cluster gone: the store's chunk still counts; the failed probe is counted.
  for (const auto& n : std::vector<kvstore::testing::RedisClusterProcess::Node>(redis.nodes())) {
    redis.Kill(*redis.Find(absl::StrCat("127.0.0.1:", n.port)));
  }
  EXPECT_EQ((*backend)->CachedOverlap(*chain, absl::Now()).StoreChunks(), 1u);
  EXPECT_THAT((*backend)->RenderMetrics(),
              ::testing::HasSubstr("strata_router_shared_tier_errors_total 1"));
  backend->reset();
  kvstore::StopStoreServer(server->get(), &service);
}

}  // namespace
}  // namespace strata::router
