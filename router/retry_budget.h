// RetryBudget: how many requests the router may send again, as a fraction of recent traffic
// (gRPC's retry throttling and Finagle's RetryBudget are the models). Each new request deposits
// `ratio` of a retry; each retry withdraws one. A floor of `min_per_second` retries keeps a
// quiet router able to retry at all. Deposits and withdrawals expire after `window`, so the
// budget follows the traffic of the last window only: when a node is lost under load, at most
// ratio x the requests of the last window (plus the floor) are sent again, never all of them.
//
//   RetryBudget budget({.ratio = 0.1});
//   budget.Deposit(now);                      // a request started
//   if (budget.TryWithdraw(now)) Retry(...);  // else fail it: the budget is spent
//
// Thread-safe. Memory: one bucket per second of `window`.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace strata::router {

struct RetryBudgetOptions {
  double ratio = 0.1;                         // retries per request, over the window; in [0, 1]
  double min_per_second = 1.0;                // retries always allowed per second of window; >= 0
  absl::Duration window = absl::Seconds(10);  // >= 1 s, whole seconds

  absl::Status Validate() const;  // kInvalidArgument naming the field
};

class RetryBudget {
 public:
  explicit RetryBudget(RetryBudgetOptions options);

  void Deposit(absl::Time now);
  // True (and the retry counted) while the window's retries stay within
  // min_per_second x window + ratio x its requests.
  bool TryWithdraw(absl::Time now);
  // What TryWithdraw would allow now, in whole retries (for metrics and tests).
  double Balance(absl::Time now);

 private:
  struct Bucket {
    int64_t second = -1;  // Unix second the counts belong to
    uint64_t requests = 0, retries = 0;
  };
  Bucket& At(int64_t second);            // under mu_; resets a stale bucket
  double BalanceLocked(int64_t second);  // under mu_

  const RetryBudgetOptions options_;
  std::mutex mu_;                // guards buckets_
  std::vector<Bucket> buckets_;  // ring, one per second of the window
};

}  // namespace strata::router
