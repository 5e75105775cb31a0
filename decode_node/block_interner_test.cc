#include "decode_node/block_interner.h"

#include <cstring>

#include "common/aligned_buffer.h"
#include "gtest/gtest.h"

namespace strata::decode {
namespace {

SharedBytes Bytes(const char* text) {
  AlignedBuffer b(std::strlen(text));
  std::memcpy(b.data(), text, b.size());
  return SharedBytes::FromBuffer(std::move(b));
}

TEST(BlockInternerTest, AHeldBlockIsSharedAndForgottenWithItsLastHolder) {
  BlockInterner in;
  bool shared = true;
  EXPECT_FALSE(in.Holds("a"));
  SharedBytes first = in.Intern("a", Bytes("block bytes"), &shared);
  EXPECT_FALSE(shared);
  EXPECT_TRUE(in.Holds("a"));
  EXPECT_FALSE(in.Holds("b"));
  // The same name and bytes in another buffer: the held bytes come back.
  SharedBytes second = in.Intern("a", Bytes("block bytes"), &shared);
  EXPECT_TRUE(shared);
  EXPECT_EQ(second.data(), first.data());
  // Offering the held bytes themselves is no sharing.
  in.Intern("a", first, &shared);
  EXPECT_FALSE(shared);
  // Once no one holds them, a new buffer is kept instead.
  first = SharedBytes();
  EXPECT_TRUE(in.Holds("a"));  // second still holds them
  second = SharedBytes();
  EXPECT_FALSE(in.Holds("a"));
  SharedBytes third = in.Intern("a", Bytes("block bytes"), &shared);
  EXPECT_FALSE(shared);
  EXPECT_NE(third.data(), nullptr);
}

TEST(BlockInternerTest, OtherBytesOrOtherNamesAreNotShared) {
  BlockInterner in;
  bool shared = true;
  SharedBytes a = in.Intern("a", Bytes("one"), &shared);
  SharedBytes b = in.Intern("a", Bytes("two"), &shared);  // never expected; kept apart
  EXPECT_FALSE(shared);
  EXPECT_EQ(std::memcmp(b.data(), "two", 3), 0);
  SharedBytes c = in.Intern("b", Bytes("one"), &shared);
  EXPECT_FALSE(shared);
  EXPECT_NE(c.data(), a.data());
  EXPECT_FALSE(static_cast<bool>(in.Intern("c", SharedBytes(), &shared)));
}

TEST(BlockInternerTest, DeadEntriesAreSweptAsTheMapGrows) {
  BlockInterner in;
  bool shared = false;
  for (int i = 0; i < 5000; ++i) in.Intern("n" + std::to_string(i), Bytes("x"), &shared);
  EXPECT_LT(in.size(), 2048u);  // none of them is held any more
}

}  // namespace
}  // namespace strata::decode
