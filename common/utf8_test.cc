#include "common/utf8.h"

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace strata {
namespace {

TEST(Utf8Test, AcceptsWellFormedText) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"));
  EXPECT_TRUE(IsValidUtf8("\xf4\x8f\xbf\xbf"));  // U+10FFFF
  EXPECT_TRUE(IsValidUtf8(std::string("a\0b", 3)));
}

TEST(Utf8Test, RejectsMalformedTextAndSaysWhere) {
  size_t at = 99;
  EXPECT_FALSE(IsValidUtf8("ab\xc3", &at));  // truncated
  EXPECT_EQ(at, 2u);
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf", &at));  // overlong '/'
  EXPECT_EQ(at, 0u);
  EXPECT_FALSE(IsValidUtf8("x\xe0\x80\xaf", &at));  // overlong, 3 bytes
  EXPECT_EQ(at, 1u);
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate U+D800
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // U+110000
  EXPECT_FALSE(IsValidUtf8("\x80"));              // lone continuation
  EXPECT_FALSE(IsValidUtf8("\xe6\x97x"));         // bad continuation
  EXPECT_FALSE(IsValidUtf8("\xff"));
}

std::string Replaced(absl::string_view in, bool final = true) {
  std::string out;
  EXPECT_EQ(AppendUtf8Replacing(in, final, &out), in.size());
  return out;
}

TEST(Utf8Test, ReplacesEachMaximalIllFormedSubpartOnce) {
  // The Unicode Standard's example (chapter 3, "U+FFFD Substitution of Maximal Subparts").
  EXPECT_EQ(Replaced("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a\uFFFD\uFFFD\uFFFDb\uFFFDc\uFFFD\uFFFDd");
  EXPECT_EQ(Replaced("\xc0\xaf"), "\uFFFD\uFFFD");       // overlong: two subparts
  EXPECT_EQ(Replaced("\xed\xa0\x80"), "\uFFFD\uFFFD\uFFFD");  // a surrogate
  EXPECT_EQ(Replaced("ok \xe6\x97"), "ok \uFFFD");         // truncated at the end, final
  EXPECT_EQ(Replaced("caf\xc3\xa9 \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xf0\x9f\x98\x80");
}

TEST(Utf8Test, LeavesAnIncompleteTailForLaterUnlessFinal) {
  std::string out;
  EXPECT_EQ(AppendUtf8Replacing("ab\xe6\x97", /*final=*/false, &out), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(AppendUtf8Replacing("ab\xe6x", /*final=*/false, &out), 4u);  // cannot complete
  EXPECT_EQ(out, "ab\uFFFDx");
}

// Any bytes, cut anywhere and fed piece by piece (the unconsumed tail carried over), give
// well-formed UTF-8 equal to repairing the whole at once; well-formed input comes out unchanged.
TEST(Utf8Test, StreamedRepairEqualsWholeRepairOnRandomBytes) {
  std::mt19937 rng(std::random_device{}());
  const std::string alphabet = "a\x80\xbf\xc2\xc3\xe0\xe6\xed\xef\xf0\xf4\xf5\xa0\x90\x9f";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string in(rng() % 24, '\0');
    for (char& c : in) c = alphabet[rng() % alphabet.size()];
    const std::string whole = Replaced(in);
    ASSERT_TRUE(IsValidUtf8(whole));
    std::string streamed, carry;
    for (size_t i = 0; i < in.size();) {
      const size_t n = 1 + rng() % 4;
      carry += in.substr(i, n);
      i += n;
      carry.erase(0, AppendUtf8Replacing(carry, /*final=*/false, &streamed));
    }
    AppendUtf8Replacing(carry, /*final=*/true, &streamed);
    ASSERT_EQ(streamed, whole) << "trial " << trial;
    if (IsValidUtf8(in)) {
      ASSERT_EQ(whole, in);
    }
  }
}

}  // namespace
}  // namespace strata
