#include "bench/bench_util.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::bench {
namespace {

// FlagPairs over a command line given as strings (argv[0] first).
std::optional<std::vector<std::pair<std::string, std::string>>> Parse(
    std::vector<std::string> args, int* exit_code) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return FlagPairs(static_cast<int>(argv.size()), argv.data(), "usage: x [--a N]\n", exit_code);
}

TEST(FlagPairsTest, PairsFlagsWithTheirValuesInOrder) {
  int code = -1;
  auto flags = Parse({"x", "--a", "1", "--b", "--c"}, &code);
  ASSERT_TRUE(flags.has_value());
  ASSERT_EQ(flags->size(), 2u);
  EXPECT_EQ((*flags)[0], std::make_pair(std::string("--a"), std::string("1")));
  EXPECT_EQ((*flags)[1], std::make_pair(std::string("--b"), std::string("--c")));
  EXPECT_EQ(code, -1);
  EXPECT_TRUE(Parse({"x"}, &code).value().empty());
}

TEST(FlagPairsTest, HelpAsksToExitCleanly) {
  for (const char* help : {"--help", "-h"}) {
    int code = -1;
    testing::internal::CaptureStdout();
    EXPECT_FALSE(Parse({"x", "--a", "1", help}, &code).has_value());
    EXPECT_EQ(testing::internal::GetCapturedStdout(), "usage: x [--a N]\n");
    EXPECT_EQ(code, 0);
  }
}

TEST(FlagPairsTest, AFlagWithoutItsValueOrAStrayArgumentIsAnError) {
  int code = -1;
  testing::internal::CaptureStderr();
  EXPECT_FALSE(Parse({"x", "--a", "1", "--b"}, &code).has_value());
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "--b wants a value\nusage: x [--a N]\n");
  EXPECT_EQ(code, 2);
  code = -1;
  testing::internal::CaptureStderr();
  EXPECT_FALSE(Parse({"x", "stray", "1"}, &code).has_value());
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "stray is not a flag\nusage: x [--a N]\n");
  EXPECT_EQ(code, 2);
}

}  // namespace
}  // namespace strata::bench
