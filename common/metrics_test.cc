#include "common/metrics.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using testing::HasSubstr;

TEST(MetricsTest, HistogramsRenderCumulativeBucketsSumAndCount) {
  LatencyHistogram h;
  h.Record(10e-6);   // first bucket (<= 25 us)
  h.Record(30e-6);   // second (<= 50 us)
  h.Record(100.0);   // beyond the last bound: +Inf only
  std::string out;
  h.Render("strata_test_seconds", "op=\"get\"", true, "test latency", &out);
  EXPECT_THAT(out, HasSubstr("# TYPE strata_test_seconds histogram"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_bucket{op=\"get\",le=\"2.5e-05\"} 1\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_bucket{op=\"get\",le=\"5e-05\"} 2\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_bucket{op=\"get\",le=\"+Inf\"} 3\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_count{op=\"get\"} 3\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_sum{op=\"get\"} 100.00004"));
}

}  // namespace
}  // namespace strata
