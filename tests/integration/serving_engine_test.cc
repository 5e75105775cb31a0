// The prefill and decode engines in one process: prefill ships blocks over the in-process
// transport to decode, which generates. Greedy output equals single-process generation with the
// same codec (LlamaModel::Prefill then Step, as `strata generate` runs), prefixes are reused from
// the store, layers stream, sequences batch, and cancellation and bad shipments are handled.
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_node/decode_engine.h"
#include "gtest/gtest.h"
#include "kvstore/block_source.h"
#include "model/cpu_backend.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "prefill_node/prefill_engine.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/shipment.h"
#include "transport/testing/fault_injecting_transport.h"

namespace strata {
namespace {

class CollectingSink : public decode::TokenSink {
 public:
  void Token(uint32_t token, const std::string& text) override {
    std::lock_guard<std::mutex> lock(mu_);
    tokens_.push_back(token);
    text_ += text;
  }
  void Finish(decode::FinishReason reason, const decode::DecodeUsage& usage) override {
    std::lock_guard<std::mutex> lock(mu_);
    reason_ = reason;
    usage_ = usage;
    done_ = true;
    cv_.notify_all();
  }
  void Fail(const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    done_ = true;
    cv_.notify_all();
  }
  bool Wait(absl::Duration timeout = absl::Seconds(60)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoSeconds(timeout), [&] { return done_; });
  }
  std::vector<uint32_t> tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_;
  }
  absl::Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  decode::DecodeUsage usage() {
    std::lock_guard<std::mutex> lock(mu_);
    return usage_;
  }
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> tokens_;
  std::string text_;
  decode::FinishReason reason_ = decode::FinishReason::kLength;
  decode::DecodeUsage usage_;
  absl::Status status_;
  bool done_ = false;
};

constexpr uint32_t kChunk = 32;

class ServingEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ =
        model::LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny"))->release();
    backend_ = new model::CpuBackend(model_);
    tokenizer_ =
        model::Tokenizer::Load(absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny"))->release();
  }
  static void TearDownTestSuite() {
    delete backend_;
    delete model_;
    delete tokenizer_;
  }

  // `corrupt`: when set, the decode engine receives through a FaultInjectingTransport that damages
  // the payload of block messages n for which corrupt(n) holds (n counts from 1).
  void Build(const std::string& codec, uint32_t max_batch = 32, uint64_t budget = 1ull << 30,
             std::function<bool(int)> corrupt = nullptr) {
    codec_ = codec;
    decode_.reset();  // engines before the transports and the store they use
    prefill_.reset();
    faulty_.reset();
    store_ = *kvstore::BlockStore::Open({.ram_bytes = 256 << 20});
    source_ = std::make_unique<kvstore::EmbeddedBlockSource>(store_.get());
    pt_ = *transport::CreateInprocTransport({});
    dt_ = *transport::CreateInprocTransport({});
    transport::Transport* receiving = dt_.get();
    if (corrupt) {
      faulty_ = std::make_unique<transport::FaultInjectingTransport>(dt_.get());
      faulty_->corrupt = std::move(corrupt);
      receiving = faulty_.get();
    }
    prefill_ = *prefill::PrefillEngine::Create({.format = {.codec = codec, .chunk_tokens = kChunk}},
                                               backend_, pt_.get(), source_.get());
    decode_ = *decode::DecodeEngine::Create({.format = {.codec = codec, .chunk_tokens = kChunk},
                                             .max_batch = max_batch,
                                             .kv_budget_bytes = budget},
                                            backend_, tokenizer_, receiving, source_.get());
  }

  std::vector<uint32_t> Prompt(const std::string& text) {
    std::vector<uint32_t> ids = tokenizer_->Encode(text);
    ids.insert(ids.begin(), static_cast<uint32_t>(model_->config().bos_token_id));
    return ids;
  }

  // Single-process greedy generation, as `strata generate` runs it.
  std::vector<uint32_t> Solo(const std::vector<uint32_t>& prompt, uint32_t n) {
    auto cache = *model_->NewCache({.codec = codec_, .chunk_tokens = kChunk});
    std::vector<float> logits = *model_->Prefill(prompt, cache.get());
    std::vector<uint32_t> out;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t t = model::Sampler({}).Sample(logits, i);
      out.push_back(t);
      if (t == static_cast<uint32_t>(model_->config().eos_token_id)) break;
      logits = *model_->Step({&t, 1}, cache.get());
    }
    return out;
  }

  // Through the engines: register at decode, prefill ships, decode generates.
  std::shared_ptr<CollectingSink> Serve(const std::string& id, const std::vector<uint32_t>& prompt,
                                        uint32_t n, prefill::PrefillResult* result = nullptr,
                                        const std::string& salt = "", bool ignore_eos = false) {
    auto sink = std::make_shared<CollectingSink>();
    EXPECT_TRUE(decode_
                    ->Start({.request_id = id,
                             .prompt = prompt,
                             .cache_salt = salt,
                             .max_tokens = n,
                             .ignore_eos = ignore_eos},
                            sink)
                    .ok());
    absl::StatusOr<prefill::PrefillResult> r = prefill_->Prefill(
        {.request_id = id, .tokens = prompt, .cache_salt = salt, .decode_address = dt_->address()});
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok() && result != nullptr) *result = *r;
    return sink;
  }

  static model::LlamaModel* model_;
  static model::CpuBackend* backend_;  // model_, as the engines see it
  static model::Tokenizer* tokenizer_;
  std::string codec_;
  std::unique_ptr<kvstore::BlockStore> store_;
  std::unique_ptr<kvstore::EmbeddedBlockSource> source_;
  std::unique_ptr<transport::Transport> pt_, dt_;
  std::unique_ptr<transport::FaultInjectingTransport> faulty_;  // wraps dt_ when set
  std::unique_ptr<prefill::PrefillEngine> prefill_;
  std::unique_ptr<decode::DecodeEngine> decode_;
};

model::LlamaModel* ServingEngineTest::model_ = nullptr;
model::CpuBackend* ServingEngineTest::backend_ = nullptr;
model::Tokenizer* ServingEngineTest::tokenizer_ = nullptr;

const char kText[] =
    "The kernel schedules processes and manages memory. Each process has its own address space, "
    "and the kernel maps pages on demand when a process touches them for the first time.";

TEST_F(ServingEngineTest, GreedyOutputEqualsSingleProcessForEveryCodecFamily) {
  for (const char* codec :
       {"fp16", "kivi:k2v2:g32", "gear:k2v2:kcvt:r2:s1", "zipcache:k2v2:h4:s10", "kcvt:k4v4"}) {
    Build(codec);
    const std::vector<uint32_t> prompt = Prompt(absl::StrCat(kText, " ", kText));
    ASSERT_GT(prompt.size(), 2 * kChunk);
    prefill::PrefillResult r;
    auto sink = Serve(absl::StrCat("req-", std::string(codec).substr(0, 4)), prompt, 24, &r);
    ASSERT_TRUE(sink->Wait());
    ASSERT_TRUE(sink->status().ok()) << codec << ": " << sink->status();
    EXPECT_EQ(sink->tokens(), Solo(prompt, 24)) << codec;
    EXPECT_EQ(r.blocks_shipped, (prompt.size() / kChunk) * model_->config().num_layers) << codec;
    EXPECT_GT(r.block_bytes, 0u);
    EXPECT_EQ(sink->usage().prompt_tokens, prompt.size());
    // Layers stream: the decode side held layer 0's blocks before the last layer was computed
    // (two layers of compute give the in-process acknowledgements ample time).
    EXPECT_GT(r.layer0_acked_early, 0u) << codec;
  }
}

// Blocks damaged on their way to the decode node are refused there (their CRC-32C), never
// adopted, and sent again by the prefill node: the request succeeds with the output of an
// undamaged run. A block damaged on every attempt fails the request with DATA_LOSS, never a hang.
TEST_F(ServingEngineTest, BlocksDamagedInTransitAreRefusedAndSentAgain) {
  Build("kivi:k2v2:g32", 32, 1ull << 30, [](int n) { return n == 2 || n == 5 || n == 9; });
  const std::vector<uint32_t> prompt = Prompt(absl::StrCat(kText, " ", kText));
  prefill::PrefillResult r;
  auto sink = Serve("damaged", prompt, 16, &r);
  ASSERT_TRUE(sink->Wait());
  ASSERT_TRUE(sink->status().ok()) << sink->status();
  EXPECT_EQ(sink->tokens(), Solo(prompt, 16));
  EXPECT_EQ(r.blocks_shipped, (prompt.size() / kChunk) * model_->config().num_layers);
  EXPECT_EQ(decode_->receiver().stats().checksum_failures, 3u);
  EXPECT_EQ(prefill_->sender().stats().retries, 3u);

  // One block damaged on every attempt (BlockSenderOptions::max_attempts is 3): the prefill fails
  // with DATA_LOSS and tells the decode node, which fails the request at once (also when the
  // request's end shipment arrived before the abort, as here: the block fails last).
  Build("kivi:k2v2:g32", 32, 1ull << 30, [](int) { return false; });
  faulty_->corrupt_block = [](absl::string_view bytes) {
    absl::StatusOr<transport::ShipmentId> id = transport::ShipmentId::Decode(std::string(bytes));
    return id.ok() && id->kind == transport::ShipmentKind::kBlock && id->layer == 1 &&
           id->chunk == 1;
  };
  auto failed = std::make_shared<CollectingSink>();
  ASSERT_TRUE(
      decode_->Start({.request_id = "hopeless", .prompt = prompt, .max_tokens = 4}, failed).ok());
  absl::StatusOr<prefill::PrefillResult> p = prefill_->Prefill(
      {.request_id = "hopeless", .tokens = prompt, .decode_address = dt_->address()});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kDataLoss) << p.status();
  ASSERT_TRUE(failed->Wait(absl::Seconds(10)));  // not the decode node's KV timeout
  EXPECT_EQ(failed->status().code(), absl::StatusCode::kAborted) << failed->status();
  EXPECT_EQ(decode_->load().waiting, 0u);
  EXPECT_EQ(failed->tokens().size(), 0u);
}

TEST_F(ServingEngineTest, ASecondTurnAdoptsTheFirstTurnsPrefixAndMatchesRecomputing) {
  Build("kivi:k2v2:g32");
  const std::vector<uint32_t> turn1 = Prompt(kText);
  prefill::PrefillResult r1, r2;
  auto s1 = Serve("turn-1", turn1, 40, &r1);
  ASSERT_TRUE(s1->Wait());
  ASSERT_TRUE(s1->status().ok()) << s1->status();
  EXPECT_EQ(r1.cached_tokens, 0u);
  // Turn 2: turn 1, its answer, a new question.
  std::vector<uint32_t> turn2 = turn1;
  const std::vector<uint32_t> answer = s1->tokens();
  turn2.insert(turn2.end(), answer.begin(), answer.end());
  const std::vector<uint32_t> more = tokenizer_->Encode(" What does the kernel do next?");
  turn2.insert(turn2.end(), more.begin(), more.end());
  auto s2 = Serve("turn-2", turn2, 16, &r2);
  ASSERT_TRUE(s2->Wait());
  ASSERT_TRUE(s2->status().ok()) << s2->status();
  // Every full chunk of turn 1's prompt and answer was stored (prefill and decode), so turn 2
  // computes only from the last of them on.
  EXPECT_GE(r2.cached_tokens, (turn1.size() / kChunk) * kChunk);
  EXPECT_EQ(s2->usage().cached_tokens, r2.cached_tokens);
  EXPECT_EQ(r2.computed_tokens, turn2.size() - r2.cached_tokens);
  // Another tenant shares nothing.
  prefill::PrefillResult r3;
  auto s3 = Serve("turn-2-other-tenant", turn2, 4, &r3, "tenant-b");
  ASSERT_TRUE(s3->Wait());
  EXPECT_EQ(r3.cached_tokens, 0u);
  const std::vector<uint32_t> t2 = s2->tokens();
  EXPECT_EQ(s3->tokens(), std::vector<uint32_t>(t2.begin(), t2.begin() + 4));
}

TEST_F(ServingEngineTest, ConcurrentSequencesBatchAndEachEqualsItsSoloOutput) {
  Build("kivi:k4v4:g32", /*max_batch=*/8);
  constexpr int kStreams = 12;
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(Prompt(absl::StrCat("Request ", i, ": ", std::string(kText).substr(i * 5))));
    sinks.push_back(Serve(absl::StrCat("c", i), prompts.back(), 20));
  }
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    ASSERT_TRUE(sinks[i]->status().ok()) << sinks[i]->status();
    EXPECT_EQ(sinks[i]->tokens(), Solo(prompts[i], 20)) << "stream " << i;
  }
  const decode::DecodeStats st = decode_->stats();
  EXPECT_GT(st.batched_sequences, st.steps) << "sequences were never batched";
}

TEST_F(ServingEngineTest, SequencesOverOneCachedPrefixShareItsBytesAndEachEqualsItsSoloOutput) {
  Build("kivi:k2v2:g32", /*max_batch=*/8);
  // The prefix first, so that the store holds it, in a sequence that runs on (200 tokens)
  // while six questions over the same prefix arrive.
  const std::string prefix = std::string(kText) + " " + kText;
  auto first = Serve("p0", Prompt(prefix + " Why?"), 200, nullptr, "", /*ignore_eos=*/true);
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  std::vector<prefill::PrefillResult> results(6);
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(Prompt(absl::StrCat(prefix, " Question ", i, "?")));
    sinks.push_back(Serve(absl::StrCat("q", i), prompts.back(), 12, &results[i]));
  }
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    ASSERT_TRUE(sinks[i]->status().ok()) << sinks[i]->status();
    EXPECT_GT(results[i].cached_tokens, 0u) << i;
    EXPECT_EQ(sinks[i]->tokens(), Solo(prompts[i], 12)) << "stream " << i;
  }
  // Each question adopted the prefix's blocks from the bytes the first sequence holds: every
  // layer of every cached chunk, for each of the six.
  const decode::DecodeStats st = decode_->stats();
  const uint64_t layers = model_->config().num_layers;
  EXPECT_GE(st.blocks_shared, 6 * layers * (results[0].cached_tokens / kChunk));
  ASSERT_TRUE(first->Wait(absl::Minutes(5)));
  ASSERT_TRUE(first->status().ok()) << first->status();
  EXPECT_EQ(first->tokens().size(), 200u);
}

// The most bytes a cache holding `prompt` holds while it generates tokens [from, to), as the
// decode engine counts them (compressed blocks, and the window at 8 bytes per K+V element; the
// window shrinks as each chunk fills); `blocks`: the blocks of the prompt alone.
uint64_t CacheBytes(const model::LlamaModel& m, const std::string& codec,
                    const std::vector<uint32_t>& prompt, uint32_t from, uint32_t to,
                    uint64_t* blocks) {
  auto cache = *m.NewCache({.codec = codec, .chunk_tokens = kChunk});
  std::vector<float> logits = *m.Prefill(prompt, cache.get());
  if (blocks != nullptr) *blocks = cache->block_bytes();
  const model::ModelConfig& c = m.config();
  uint64_t most = 0;
  for (uint32_t i = 0;; ++i) {
    if (i >= from) {
      most = std::max<uint64_t>(most, cache->block_bytes() + uint64_t{cache->window_tokens()} *
                                                                c.num_layers * c.num_kv_heads *
                                                                c.head_dim * 8);
    }
    if (i + 1 >= to) break;
    const uint32_t t = model::Sampler({}).Sample(logits, i);
    logits = *m.Step({&t, 1}, cache.get());
  }
  return most;
}

TEST_F(ServingEngineTest, AdmissionCountsAPrefixThatSequencesShareOnce) {
  // A long cached prefix held by a running sequence, questions that add a few tokens to it, and a
  // KV budget that holds the first sequence and every question's own blocks and window, but not
  // the first sequence and another copy of the prefix. Counted per sequence, no question would
  // run beside the first; counted once, they all do, and nothing is preempted.
  // (fp16 blocks: with 2-bit codes the tiny model's fp32 windows outweigh any prefix.)
  std::string prefix;
  for (int i = 0; i < 16; ++i) prefix += std::string(kText) + " ";
  constexpr int kQuestions = 5;
  constexpr uint32_t kHolderTokens = 160, kQuestionTokens = 28;
  const std::string codec = "fp16";
  const std::vector<uint32_t> holder_prompt = Prompt(prefix + "Why?");
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; i < kQuestions; ++i) prompts.push_back(Prompt(absl::StrCat(prefix, "Q", i, "?")));
  size_t common = 0;
  while (common < holder_prompt.size() && common < prompts[0].size() &&
         holder_prompt[common] == prompts[0][common]) {
    ++common;
  }
  uint64_t shared = 0;
  CacheBytes(*model_, codec,
             std::vector<uint32_t>(holder_prompt.begin(),
                                   holder_prompt.begin() + common / kChunk * kChunk),
             0, 1, &shared);
  const uint64_t one = CacheBytes(*model_, codec, prompts[0], 0, 1, nullptr);
  const uint64_t question = CacheBytes(*model_, codec, prompts[0], 0, kQuestionTokens, nullptr);
  const uint64_t holder = CacheBytes(*model_, codec, holder_prompt, 0, kHolderTokens, nullptr);
  const uint64_t budget = holder + kQuestions * (question - shared);
  ASSERT_LT(budget, holder + one - shared / 4)
      << "the premise: the budget holds no second copy of the prefix (holder " << holder
      << ", a question " << one << " to " << question << ", shared " << shared << ")";
  Build(codec, /*max_batch=*/8, budget);
  auto first = Serve("h", holder_prompt, kHolderTokens, nullptr, "", /*ignore_eos=*/true);
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  std::vector<prefill::PrefillResult> results(kQuestions);
  for (int i = 0; i < kQuestions; ++i) {
    sinks.push_back(Serve(absl::StrCat("q", i), prompts[i], kQuestionTokens, &results[i], "",
                          /*ignore_eos=*/true));
  }
  for (int i = 0; i < kQuestions; ++i) {
    ASSERT_TRUE(sinks[i]->Wait(absl::Minutes(5)));
    ASSERT_TRUE(sinks[i]->status().ok()) << sinks[i]->status();
    EXPECT_GE(results[i].cached_tokens, common / kChunk * kChunk) << i;
  }
  ASSERT_TRUE(first->Wait(absl::Minutes(5)));
  ASSERT_TRUE(first->status().ok()) << first->status();
  const decode::DecodeStats st = decode_->stats();
  EXPECT_GT(st.peak_batch, 2u) << "the shared prefix was counted once per sequence (budget "
                               << budget << ", holder " << holder << ", a question " << one
                               << ", shared " << shared << ")";
  EXPECT_EQ(st.preemptions, 0u);
  EXPECT_GT(st.blocks_shared, 0u);
  // Sharing changes no output. (Solo stops at the end-of-sequence token; the questions ran on.)
  for (int i = 0; i < kQuestions; ++i) {
    const std::vector<uint32_t> solo = Solo(prompts[i], kQuestionTokens);
    std::vector<uint32_t> served = sinks[i]->tokens();
    ASSERT_GE(served.size(), solo.size());
    served.resize(solo.size());
    EXPECT_EQ(served, solo) << "question " << i;
  }
}

TEST_F(ServingEngineTest, PreemptedSequencesResumeFromTheStoreWithTheSameOutput) {
  // A budget that holds about one sequence: the others are preempted to the store and resumed.
  Build("fp16", /*max_batch=*/8, /*budget=*/300 << 10);
  constexpr int kStreams = 4;
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(Prompt(absl::StrCat(i, " ", kText)));
    sinks.push_back(Serve(absl::StrCat("p", i), prompts.back(), 70));
  }
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    ASSERT_TRUE(sinks[i]->status().ok()) << sinks[i]->status();
    EXPECT_EQ(sinks[i]->tokens(), Solo(prompts[i], 70)) << "stream " << i;
  }
  EXPECT_GT(decode_->stats().preemptions, 0u);
  EXPECT_EQ(decode_->stats().resumed, decode_->stats().preemptions);
}

TEST_F(ServingEngineTest, UnknownRequestsAndBadShipmentsAreRefused) {
  Build("fp16");
  // Prefill for a request the decode node never registered: its blocks are refused.
  absl::StatusOr<prefill::PrefillResult> r = prefill_->Prefill(
      {.request_id = "nobody", .tokens = Prompt(kText), .decode_address = dt_->address()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  // Bad requests.
  EXPECT_EQ(prefill_->Prefill({.request_id = "x", .tokens = {}, .decode_address = dt_->address()})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      prefill_
          ->Prefill({.request_id = "has space", .tokens = {1}, .decode_address = dt_->address()})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      prefill_->Prefill({.request_id = "y", .tokens = {999999}, .decode_address = dt_->address()})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  auto sink = std::make_shared<CollectingSink>();
  ASSERT_TRUE(decode_->Start({.request_id = "dup", .prompt = {1, 2}}, sink).ok());
  EXPECT_EQ(decode_->Start({.request_id = "dup", .prompt = {1, 2}}, sink).code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(ServingEngineTest, CancelledPrefillTellsTheDecodeNodeToDropTheRequest) {
  Build("fp16");
  auto sink = std::make_shared<CollectingSink>();
  const std::vector<uint32_t> prompt = Prompt(kText);
  ASSERT_TRUE(decode_->Start({.request_id = "cx", .prompt = prompt, .max_tokens = 8}, sink).ok());
  int polls = 0;
  absl::StatusOr<prefill::PrefillResult> r =
      prefill_->Prefill({.request_id = "cx", .tokens = prompt, .decode_address = dt_->address()},
                        [&] { return ++polls > 2; });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(sink->Wait(absl::Seconds(10)));
  EXPECT_EQ(sink->status().code(), absl::StatusCode::kAborted) << sink->status();
  EXPECT_EQ(decode_->load().waiting, 0u);
}

}  // namespace
}  // namespace strata
