#include "router/retry_budget.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace strata::router {

absl::Status RetryBudgetOptions::Validate() const {
  if (!(ratio >= 0 && ratio <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry budget: ratio must be in [0, 1], got ", ratio));
  }
  if (!(min_per_second >= 0) || !std::isfinite(min_per_second)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry budget: min_per_second must be >= 0, got ", min_per_second));
  }
  if (window < absl::Seconds(1) || window > absl::Hours(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retry budget: window must be between 1 s and 1 h, got ", absl::FormatDuration(window)));
  }
  return absl::OkStatus();
}

RetryBudget::RetryBudget(RetryBudgetOptions options)
    : options_(options),
      buckets_(static_cast<size_t>(std::max<int64_t>(1, absl::ToInt64Seconds(options.window)))) {}

RetryBudget::Bucket& RetryBudget::At(int64_t second) {
  Bucket& b = buckets_[static_cast<size_t>(second) % buckets_.size()];
  if (b.second != second) b = Bucket{.second = second};
  return b;
}

double RetryBudget::BalanceLocked(int64_t second) {
  const int64_t oldest = second - static_cast<int64_t>(buckets_.size()) + 1;
  uint64_t requests = 0, retries = 0;
  for (const Bucket& b : buckets_) {
    if (b.second < oldest || b.second > second) continue;
    requests += b.requests;
    retries += b.retries;
  }
  const double allowed = options_.min_per_second * static_cast<double>(buckets_.size()) +
                         options_.ratio * static_cast<double>(requests);
  return allowed - static_cast<double>(retries);
}

void RetryBudget::Deposit(absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  ++At(absl::ToUnixSeconds(now)).requests;
}

bool RetryBudget::TryWithdraw(absl::Time now) {
  const int64_t second = absl::ToUnixSeconds(now);
  std::lock_guard<std::mutex> lock(mu_);
  if (BalanceLocked(second) < 1.0) return false;
  ++At(second).retries;
  return true;
}

double RetryBudget::Balance(absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  return BalanceLocked(absl::ToUnixSeconds(now));
}

}  // namespace strata::router
