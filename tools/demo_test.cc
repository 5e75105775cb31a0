#include "tools/demo.h"

#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::tools {
namespace {

using testing::HasSubstr;

TEST(DemoTest, SecondRequestReusesTheSharedPrefixAndCorruptionIsCaught) {
  DemoOptions o;
  // Per process: the sanitizer builds' runs and another checkout's may share TempDir.
  o.out_dir = absl::StrCat(testing::TempDir(), "/demo_blocks-", getpid());
  o.layers = 3;
  std::ostringstream out;
  const absl::Status s = RunDemo(o, out);
  ASSERT_TRUE(s.ok()) << s << "\n" << out.str();
  const std::string text = out.str();
  // The shared system prompt spans several 64-token chunks: request B hits them.
  EXPECT_THAT(text, HasSubstr("hit (reused from disk)"));
  EXPECT_THAT(text, HasSubstr("checksum mismatch"));
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(o.out_dir)) {
    if (e.path().extension() == ".blk") ++files;
  }
  EXPECT_GT(files, 0u);
  EXPECT_EQ(files % o.layers, 0u);  // every chunk has every layer
  // Running again starts clean and gives the same report.
  std::ostringstream again;
  ASSERT_TRUE(RunDemo(o, again).ok());
  EXPECT_EQ(again.str(), text);
  std::filesystem::remove_all(o.out_dir);
}

TEST(DemoTest, BadOptionsAreRejected) {
  DemoOptions o;
  o.layers = 0;
  std::ostringstream out;
  EXPECT_EQ(RunDemo(o, out).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.prefix_hash = "md5";
  EXPECT_EQ(RunDemo(o, out).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.chunk_tokens = 40;  // not a multiple of the 16-token hash block
  EXPECT_EQ(RunDemo(o, out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::tools
