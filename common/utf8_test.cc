#include "common/utf8.h"

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

}  // namespace
}  // namespace strata
