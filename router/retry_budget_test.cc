#include "router/retry_budget.h"

#include "gtest/gtest.h"

namespace strata::router {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'800'000'000);

TEST(RetryBudgetTest, ValidateNamesTheField) {
  EXPECT_EQ(RetryBudgetOptions{.ratio = 1.5}.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(RetryBudgetOptions{.ratio = -1}.Validate().message().find("ratio"), std::string::npos);
  EXPECT_NE(RetryBudgetOptions{.min_per_second = -1}.Validate().message().find("min_per_second"),
            std::string::npos);
  EXPECT_NE(
      RetryBudgetOptions{.window = absl::Milliseconds(10)}.Validate().message().find("window"),
      std::string::npos);
  EXPECT_TRUE(RetryBudgetOptions{}.Validate().ok());
}

TEST(RetryBudgetTest, RetriesAreAFractionOfRequestsAboveTheFloor) {
  RetryBudget budget({.ratio = 0.1, .min_per_second = 0.2, .window = absl::Seconds(10)});
  // Floor: 0.2/s x 10 s = 2 retries with no traffic at all.
  EXPECT_TRUE(budget.TryWithdraw(kT0));
  EXPECT_TRUE(budget.TryWithdraw(kT0));
  EXPECT_FALSE(budget.TryWithdraw(kT0));
  // 100 requests buy 10 more, and no more than that however many fail.
  for (int i = 0; i < 100; ++i) budget.Deposit(kT0);
  int allowed = 0;
  for (int i = 0; i < 100; ++i) allowed += budget.TryWithdraw(kT0 + absl::Seconds(1));
  EXPECT_EQ(allowed, 10);
  EXPECT_LT(budget.Balance(kT0 + absl::Seconds(1)), 1.0);
}

TEST(RetryBudgetTest, TheWindowForgetsOldTrafficAndOldRetries) {
  RetryBudget budget({.ratio = 0.5, .min_per_second = 0, .window = absl::Seconds(5)});
  for (int i = 0; i < 10; ++i) budget.Deposit(kT0);
  int allowed = 0;
  while (budget.TryWithdraw(kT0)) ++allowed;
  EXPECT_EQ(allowed, 5);
  // Within the window: still spent.
  EXPECT_FALSE(budget.TryWithdraw(kT0 + absl::Seconds(4)));
  // Past it: the old requests no longer pay for retries (and no floor is set).
  EXPECT_FALSE(budget.TryWithdraw(kT0 + absl::Seconds(6)));
  budget.Deposit(kT0 + absl::Seconds(6));
  budget.Deposit(kT0 + absl::Seconds(6));
  EXPECT_TRUE(budget.TryWithdraw(kT0 + absl::Seconds(6)));
  EXPECT_FALSE(budget.TryWithdraw(kT0 + absl::Seconds(6)));
}

TEST(RetryBudgetTest, ZeroRatioAndFloorNeverRetries) {
  RetryBudget budget({.ratio = 0, .min_per_second = 0});
  for (int i = 0; i < 1000; ++i) budget.Deposit(kT0);
  EXPECT_FALSE(budget.TryWithdraw(kT0));
}

}  // namespace
}  // namespace strata::router
