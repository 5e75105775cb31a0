#include "common/sha256.h"

#include <string>

#include "gtest/gtest.h"

namespace strata {
namespace {

// FIPS 180-2 appendix B test vectors.
TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(ToHex(Sha256::Hash("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(ToHex(Sha256::Hash("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(ToHex(Sha256::Hash("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256Test, IncrementalEqualsOneShot) {
  std::string msg(1'000'003, '\0');
  for (size_t i = 0; i < msg.size(); ++i) msg[i] = static_cast<char>(i * 131 + 7);
  Sha256 h;
  for (size_t pos = 0; pos < msg.size(); pos += 4099) {
    h.Update(absl::string_view(msg).substr(pos, 4099));
  }
  EXPECT_EQ(h.Finish(), Sha256::Hash(msg));
  std::string million_a(1'000'000, 'a');
  EXPECT_EQ(ToHex(Sha256::Hash(million_a)),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256Test, Fingerprint64IsTheLittleEndianDigestPrefix) {
  // sha256("abc") begins ba 78 16 bf 8f 01 cf ea.
  EXPECT_EQ(Fingerprint64("abc"), 0xeacf018fbf1678baull);
  EXPECT_NE(Fingerprint64("kivi:k2v2:g32"), Fingerprint64("kivi:k2v2:g64"));
}

}  // namespace
}  // namespace strata
