#include "common/status_macros.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace strata {
namespace {

int g_calls = 0;

absl::Status Fail(absl::string_view msg) {
  ++g_calls;
  return absl::DataLossError(msg);
}
absl::Status Succeed() {
  ++g_calls;
  return absl::OkStatus();
}
absl::StatusOr<std::unique_ptr<int>> MakeInt(int v) {
  ++g_calls;
  if (v < 0) return absl::InvalidArgumentError("negative");
  return std::make_unique<int>(v);
}

absl::Status ReturnIfError(bool fail) {
  STRATA_RETURN_IF_ERROR(fail ? Fail("boom") : Succeed());
  return absl::OkStatus();
}

absl::StatusOr<int> AssignOrReturn(int v) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<int> p, MakeInt(v));  // move-only value
  int sum = *p;
  STRATA_ASSIGN_OR_RETURN(p, MakeInt(v + 1));  // assignment to an existing lvalue
  return sum + *p;
}

TEST(StatusMacrosTest, ReturnIfErrorPropagatesTheErrorAndEvaluatesOnce) {
  g_calls = 0;
  absl::Status s = ReturnIfError(true);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "boom");
  EXPECT_EQ(g_calls, 1);
  EXPECT_TRUE(ReturnIfError(false).ok());
  EXPECT_EQ(g_calls, 2);
}

TEST(StatusMacrosTest, AssignOrReturnMovesValuesAndPropagatesErrors) {
  g_calls = 0;
  absl::StatusOr<int> ok = AssignOrReturn(3);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 7);
  EXPECT_EQ(g_calls, 2);
  absl::StatusOr<int> bad = AssignOrReturn(-5);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "negative");
  EXPECT_EQ(g_calls, 3);  // stopped after the first failure
}

}  // namespace
}  // namespace strata
