#include "model/tokenizer.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using testing::HasSubstr;

const std::vector<std::string>& TrickyTexts() {
  static const std::vector<std::string> kTexts = {
      "Hello, world!",
      "The quick brown fox jumps over the lazy dog.",
      "  leading spaces and   runs   of    spaces  ",
      "trailing spaces   ",
      "tabs\tand\t\ttabs",
      "line one\nline two\n\n\nline five\r\nwindows",
      "   \n   indented after newline",
      "numbers 1 12 123 1234 12345 3.14159 -42 1e10",
      "don't won't I'm we're they've she'll he'd IT'S DON'T",
      "caf\xc3\xa9 na\xc3\xaf"
      "ve r\xc3\xa9"
      "sum\xc3\xa9 \xc3\x9c"
      "ber",
      "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83"
      "\x88",
      "emoji \xf0\x9f\x98\x80\xf0\x9f\x9a\x80 and \xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb",
      "punctuation!!! ??? ... --- *** ((x)) [y] {z} <tag/>",
      "mixed\xc2\xa0"
      "nbsp and\xe2\x80\x83"
      "em space",
      "$ ls -la /usr/share/doc | grep -i readme && echo done",
      "",
      " ",
      "\n",
      "a",
  };
  return kTexts;
}

std::string TestModel() { return absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"); }

TEST(TokenizerTest, RoundTripsTrickyText) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(TestModel());
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (const std::string& text : TrickyTexts()) {
    const std::vector<uint32_t> ids = (*tok)->Encode(text);
    absl::StatusOr<std::string> back = (*tok)->Decode(ids);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, text);
    EXPECT_EQ(ids.empty(), text.empty());
  }
}

TEST(TokenizerTest, MatchesThePythonTokenizerWithRealLookahead) {
  const std::string dir = testing::TempDir();
  const std::string in = dir + "/tok_in.json", out = dir + "/tok_out.json";
  std::ofstream(in) << nlohmann::json(TrickyTexts()).dump();
  const std::string cmd =
      absl::StrCat(STRATA_PYTHON, " ", STRATA_SOURCE_DIR, "/tests/oracles/tokenizer_oracle.py ",
                   TestModel(), "/tokenizer.json < ", in, " > ", out);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << " (needs python3-regex: scripts/setup.sh)";
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  const nlohmann::json want = nlohmann::json::parse(ss.str());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(TestModel());
  ASSERT_TRUE(tok.ok());
  for (size_t i = 0; i < TrickyTexts().size(); ++i) {
    EXPECT_EQ((*tok)->Encode(TrickyTexts()[i], /*parse_special=*/false),
              want[i].get<std::vector<uint32_t>>())
        << "text: '" << TrickyTexts()[i] << "'";
  }
}

TEST(TokenizerTest, VeryLongWordsTokenizeQuickly) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(TestModel());
  ASSERT_TRUE(tok.ok());
  const std::string word(200000, 'e');  // one \p{L}+ piece: quadratic merging would hang
  const std::vector<uint32_t> ids = (*tok)->Encode(word);
  EXPECT_EQ(*(*tok)->Decode(ids), word);
  EXPECT_LT(ids.size(), word.size());
}

TEST(TokenizerTest, SpecialTokensAreParsedOnlyWhenAsked) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(TestModel());
  ASSERT_TRUE(tok.ok());
  const int64_t bos = (*tok)->TokenId("<|begin_of_text|>");
  ASSERT_GE(bos, 0);
  const std::vector<uint32_t> ids = (*tok)->Encode("<|begin_of_text|>hi");
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], static_cast<uint32_t>(bos));
  EXPECT_EQ(*(*tok)->Decode(ids), "<|begin_of_text|>hi");
  const std::vector<uint32_t> plain = (*tok)->Encode("<|begin_of_text|>hi", false);
  EXPECT_GT(plain.size(), ids.size());
  EXPECT_EQ(*(*tok)->Decode(plain), "<|begin_of_text|>hi");
  EXPECT_EQ((*tok)->Decode({999999}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerTest, UnsupportedTokenizersAreRejectedClearly) {
  EXPECT_THAT(std::string(Tokenizer::FromJson("{").status().message()), HasSubstr("not a JSON"));
  EXPECT_THAT(
      std::string(Tokenizer::FromJson(R"({"model":{"type":"Unigram"}})").status().message()),
      HasSubstr("not BPE"));
  EXPECT_THAT(std::string(Tokenizer::FromJson(
                              R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]},
                      "pre_tokenizer":{"type":"Metaspace"}})")
                              .status()
                              .message()),
              HasSubstr("'Metaspace' is not supported"));
  EXPECT_THAT(
      std::string(Tokenizer::FromJson(
                      R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[],"byte_fallback":true},
                      "pre_tokenizer":null})")
                      .status()
                      .message()),
      HasSubstr("byte_fallback"));
  EXPECT_THAT(
      std::string(
          Tokenizer::FromJson(
              R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"pre_tokenizer":null})")
              .status()
              .message()),
      HasSubstr("not a byte-level BPE"));
  EXPECT_THAT(
      std::string(
          Tokenizer::FromJson(
              R"({"normalizer":{"type":"NFC"},"model":{"type":"BPE","vocab":{"a":0},"merges":[]}})")
              .status()
              .message()),
      HasSubstr("normalizers are not supported"));
  EXPECT_THAT(std::string(Tokenizer::FromJson(
                              R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]},
                      "pre_tokenizer":{"type":"Sequence","pretokenizers":[
                        {"type":"Split","pattern":{"Regex":"(?<=a)b"}},
                        {"type":"ByteLevel","use_regex":false}]}})")
                              .status()
                              .message()),
              HasSubstr("does not compile in RE2"));
}

}  // namespace
}  // namespace strata::model
