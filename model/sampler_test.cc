#include "model/sampler.h"

#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "gtest/gtest.h"
#include "model/logprobs.h"
#include "model/text_stream.h"
#include "model/tokenizer.h"

namespace strata::model {
namespace {

TEST(SamplerTest, GreedyTakesTheArgmax) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.9f};
  EXPECT_EQ(Sampler({}).Sample(logits, 0), 1u);
  EXPECT_EQ(Sampler({.temperature = 1.0f, .top_k = 1}).Sample(logits, 5), 1u);
}

TEST(SamplerTest, DrawsDependOnlyOnSeedAndIndex) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 7) * 0.3f;
  const Sampler a({.temperature = 1.0f, .seed = 42}), b({.temperature = 1.0f, .seed = 42}),
      c({.temperature = 1.0f, .seed = 43});
  int differ = 0;
  for (uint64_t i = 0; i < 50; ++i) {
    EXPECT_EQ(a.Sample(logits, i), b.Sample(logits, i));
    differ += a.Sample(logits, i) != c.Sample(logits, i);
  }
  EXPECT_GT(differ, 10);  // another seed draws other tokens
  // Order does not matter: index 7 alone equals index 7 after others.
  EXPECT_EQ(a.Sample(logits, 7), Sampler({.temperature = 1.0f, .seed = 42}).Sample(logits, 7));
}

TEST(SamplerTest, TopKAndTopPKeepOnlyTheLikelyTokens) {
  std::vector<float> logits = {5.0f, 4.9f, 0.0f, -1.0f, 4.8f, -3.0f};
  std::map<uint32_t, int> seen;
  const Sampler k2({.temperature = 1.0f, .top_k = 2, .seed = 1});
  for (uint64_t i = 0; i < 400; ++i) ++seen[k2.Sample(logits, i)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[0], 100);
  EXPECT_GT(seen[1], 100);
  seen.clear();
  // Tokens 0, 1, 4 hold almost all the mass: p = 0.5 needs tokens 0 and 1 only.
  const Sampler p({.temperature = 1.0f, .top_p = 0.5f, .seed = 2});
  for (uint64_t i = 0; i < 400; ++i) ++seen[p.Sample(logits, i)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen.count(4), 0u);
}

TEST(SamplerTest, PenaltiesFollowVllmsDefinitions) {
  const std::vector<float> logits = {3.0f, 2.5f, 2.0f, -1.0f};
  const std::vector<uint32_t> prompt = {2};
  // Greedy picks 0; once 0 was generated twice, a frequency penalty of 0.3 per time costs it
  // 0.6 (3.0 - 0.6 = 2.4 < 2.5): token 1 wins.
  EXPECT_EQ(Sampler({.frequency_penalty = 0.3f}).Sample(logits, 2, prompt, {0, 0}), 1u);
  EXPECT_EQ(Sampler({.frequency_penalty = 0.3f}).Sample(logits, 1, prompt, {0}), 0u);  // 2.7
  // Presence counts once however often: 3.0 - 0.4 = 2.6 > 2.5.
  EXPECT_EQ(Sampler({.presence_penalty = 0.4f}).Sample(logits, 2, prompt, {0, 0, 0}), 0u);
  EXPECT_EQ(Sampler({.presence_penalty = 0.6f}).Sample(logits, 1, prompt, {0}), 1u);
  // Repetition: prompt and output tokens, positive logits divided: token 0 (output) 3.0 / 1.5 =
  // 2.0, token 2 (prompt) 2.0 / 1.5 = 1.33; token 1 is untouched at 2.5 and wins.
  EXPECT_EQ(Sampler({.repetition_penalty = 1.5f}).Sample(logits, 1, prompt, {0}), 1u);
  // A negative logit is multiplied: more negative.
  const std::vector<float> negative = {-1.0f, -1.2f};
  EXPECT_EQ(Sampler({.repetition_penalty = 1.5f}).Sample(negative, 0, {0}, {}), 1u);
  // A negative frequency penalty favours repeats.
  EXPECT_EQ(Sampler({.frequency_penalty = -1.0f}).Sample(logits, 1, prompt, {3, 3, 3, 3, 3}), 3u);
  // Without penalties the history changes nothing.
  EXPECT_EQ(Sampler({}).Sample(logits, 1, prompt, {0, 0, 0}), 0u);
}

TEST(SamplerTest, MinPKeepsTokensNearTheMostLikely) {
  // exp(-0.5) = 0.61, exp(-3) = 0.05 of the top token's probability.
  const std::vector<float> logits = {5.0f, 4.5f, 2.0f, 1.9f};
  std::map<uint32_t, int> seen;
  const Sampler m({.temperature = 1.0f, .seed = 3, .min_p = 0.1f});
  for (uint64_t i = 0; i < 400; ++i) ++seen[m.Sample(logits, i)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[1], 50);
  seen.clear();
  const Sampler all({.temperature = 1.0f, .seed = 3});
  for (uint64_t i = 0; i < 2000; ++i) ++seen[all.Sample(logits, i)];
  EXPECT_EQ(seen.size(), 4u);  // without min-p the unlikely ones are drawn too
}

TEST(LogprobsTest, LogSoftmaxAtTheTokenAndTheTopTokensInOrder) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  double z = 0;
  for (float x : logits) z += std::exp(x);
  const TokenLogprobs lp = LogprobsOf(logits, 2, 3);
  EXPECT_EQ(lp.token, 2u);
  EXPECT_NEAR(lp.logprob, 2.0 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  // Ties by id: 1 before 3.
  EXPECT_EQ(lp.top[0].first, 1u);
  EXPECT_EQ(lp.top[1].first, 3u);
  EXPECT_EQ(lp.top[2].first, 2u);
  EXPECT_FLOAT_EQ(lp.top[2].second, lp.logprob);
  double total = 0;
  for (size_t t = 0; t < logits.size(); ++t) total += std::exp(LogprobsOf(logits, t, 0).logprob);
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_TRUE(LogprobsOf(logits, 0, 0).top.empty());
  EXPECT_EQ(LogprobsOf(logits, 0, 100).top.size(), logits.size());  // clamped to the vocabulary
}

TEST(SamplerTest, OptionsAreValidated) {
  EXPECT_EQ(SamplingOptions{.temperature = -1}.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SamplingOptions{.top_p = 0}.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((SamplingOptions{.temperature = 0.7f, .top_p = 0.9f}.Validate().ok()));
  EXPECT_NE(SamplingOptions{.min_p = 1.5f}.Validate().message().find("min_p"), std::string::npos);
  EXPECT_NE(SamplingOptions{.presence_penalty = 3}.Validate().message().find("presence_penalty"),
            std::string::npos);
  EXPECT_NE(SamplingOptions{.frequency_penalty = -3}.Validate().message().find("frequency_penalty"),
            std::string::npos);
  EXPECT_NE(SamplingOptions{.repetition_penalty = 0}.Validate().message().find("repetition"),
            std::string::npos);
}

class TextStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::Load(absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny"));
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = *std::move(t);
  }
  // Streams `text`'s tokens; returns what was emitted and whether it stopped.
  std::pair<std::string, bool> Stream(const std::string& text, std::vector<std::string> stop) {
    TextStream s(tok_.get(), std::move(stop));
    std::string out;
    for (uint32_t id : tok_->Encode(text, false)) {
      TextStream::Piece p = *s.Add(id);
      out += p.text;
      if (p.stopped) return {out, true};
    }
    return {out + s.Finish(), false};
  }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(TextStreamTest, EmitsTheTextWholeWithoutStops) {
  const std::string text = "Hello, wörld — naïve café ✓ done";
  EXPECT_EQ(Stream(text, {}), std::make_pair(text, false));
}

TEST_F(TextStreamTest, StopsBeforeTheFirstStopString) {
  EXPECT_EQ(Stream("one two three four", {"three", "zzz"}), std::make_pair(std::string("one two "), true));
  EXPECT_EQ(Stream("abc\n\nnext", {"\n\n"}), std::make_pair(std::string("abc"), true));
  EXPECT_EQ(Stream("no stop here", {"xyz"}), std::make_pair(std::string("no stop here"), false));
}

TEST_F(TextStreamTest, NeverEmitsHalfACharacter) {
  TextStream s(tok_.get(), {});
  std::string out;
  for (uint32_t id : tok_->Encode("✓✓✓ é", false)) {
    const std::string piece = (*s.Add(id)).text;
    for (size_t i = 0; i < piece.size();) {  // each piece is whole UTF-8 on its own
      const unsigned char c = piece[i];
      const size_t n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
      ASSERT_LE(i + n, piece.size()) << "a split character";
      i += n;
    }
    out += piece;
  }
  EXPECT_EQ(out + s.Finish(), "✓✓✓ é");
}

// The id of the token that decodes to exactly `bytes`.
uint32_t IdOf(const Tokenizer& tok, const std::string& bytes) {
  for (uint32_t id = 0; id < tok.vocab_size(); ++id) {
    absl::StatusOr<std::string> d = tok.Decode({id});
    if (d.ok() && *d == bytes) return id;
  }
  ADD_FAILURE() << "no token decodes to the " << bytes.size() << " bytes asked for";
  return 0;
}

// A byte-level model can emit any byte: bytes that form no character reach the client as U+FFFD
// (once per maximal ill-formed subpart), never as ill-formed UTF-8 (which a protobuf string field
// refuses and a JSON encoder must not send); an unfinished character at the end too.
TEST_F(TextStreamTest, ShowsBytesThatFormNoCharacterAsReplacementCharacters) {
  const uint32_t a = IdOf(*tok_, "a"), lone = IdOf(*tok_, "\x80"), lead = IdOf(*tok_, "\xe6"),
                 cont = IdOf(*tok_, "\x97");
  TextStream s(tok_.get(), {});
  std::string out;
  for (uint32_t id : {a, lone, a, lead, cont, a, lead, cont}) {
    const std::string piece = (*s.Add(id)).text;
    EXPECT_TRUE(IsValidUtf8(piece)) << "a piece of ill-formed UTF-8";
    out += piece;
  }
  EXPECT_EQ(out, "a\uFFFDa\uFFFDa");  // the last character is still unfinished
  EXPECT_EQ(s.Finish(), "\uFFFD");
  // A stop string is matched in the text as shown.
  TextStream t(tok_.get(), {"a\uFFFDb"});
  std::string shown;
  bool stopped = false;
  for (uint32_t id : {a, a, lone, IdOf(*tok_, "b"), a}) {
    TextStream::Piece p = *t.Add(id);
    shown += p.text;
    stopped = stopped || p.stopped;
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(shown, "a");
}

}  // namespace
}  // namespace strata::model
