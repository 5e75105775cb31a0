#include "model/served_format.h"

#include "gtest/gtest.h"

namespace strata::model {
namespace {

TEST(ServedFormatTest, ValidatesTheCodecAndTheKeysAgainstTheChunkSize) {
  EXPECT_TRUE((ServedFormat{.codec = "kivi:k4v4:g32", .chunk_tokens = 64}.Validate().ok()));
  EXPECT_EQ(ServedFormat{.codec = "no-such-codec"}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  // Chunks must hold whole hash blocks (16 tokens by default).
  EXPECT_EQ((ServedFormat{.chunk_tokens = 40}.Validate().code()),
            absl::StatusCode::kInvalidArgument);
}

TEST(ServedFormatTest, CacheOptionsAndKeysCarryTheFormat) {
  const ServedFormat f{.codec = "kivi:k2v2:g32", .chunk_tokens = 128};
  const KvCacheOptions c = f.CacheOptions();
  EXPECT_EQ(c.codec, "kivi:k2v2:g32");
  EXPECT_EQ(c.chunk_tokens, 128u);
  EXPECT_EQ(c.window_tokens, 0u);
  const PrefixKeyOptions k = f.KeysFor("tenant-a");
  EXPECT_EQ(k.chunk_tokens, 128u);
  EXPECT_EQ(k.cache_salt, "tenant-a");
  EXPECT_EQ(k.block_tokens, f.keys.block_tokens);
}

}  // namespace
}  // namespace strata::model
