#include "decode_node/batch_planner.h"

#include <vector>

#include "gtest/gtest.h"

namespace strata::decode {
namespace {

TEST(BatchPlannerTest, AdmitsInQueueOrderWhileThereIsAPlaceAndBudget) {
  const BatchLimits limits{.max_batch = 4, .kv_budget_bytes = 100};
  const std::vector<uint64_t> need = {30, 30, 30, 30, 30};
  // Two running with 20 bytes: two places left, and 20 + 30 + 30 fits.
  EXPECT_EQ(PlanAdmission(limits, 2, 20, need), 2u);
  // Budget before places: 50 in use takes one more (80), not two (110).
  EXPECT_EQ(PlanAdmission(limits, 1, 50, need), 1u);
  // A full batch takes nobody, whatever the budget.
  EXPECT_EQ(PlanAdmission(limits, 4, 0, need), 0u);
  EXPECT_EQ(PlanAdmission(limits, 0, 0, {}), 0u);
}

TEST(BatchPlannerTest, NoOvertakingAndAnEmptyBatchTakesTheFirstWhateverItsSize) {
  const BatchLimits limits{.max_batch = 8, .kv_budget_bytes = 100};
  // The second does not fit: the small third waits behind it (first come, first served).
  EXPECT_EQ(PlanAdmission(limits, 1, 10, {50, 60, 1}), 1u);
  // An empty batch takes a sequence larger than the whole budget, and only that one.
  EXPECT_EQ(PlanAdmission(limits, 0, 0, {500, 1}), 1u);
  // Shared blocks cost nothing more: needs of 0 always fit.
  EXPECT_EQ(PlanAdmission(limits, 3, 100, {0, 0, 0}), 3u);
}

TEST(BatchPlannerTest, PreemptsTheNewestUntilTheRestFitNeverTheLast) {
  const BatchLimits limits{.max_batch = 8, .kv_budget_bytes = 100};
  // Each holds 40 of its own: 4 hold 160; keeping 2 (80) fits.
  auto own = [](size_t k) { return uint64_t{40} * k; };
  EXPECT_EQ(PlanPreemption(limits, 4, own), 2u);
  EXPECT_EQ(PlanPreemption(limits, 2, own), 2u);  // 80 fits: nobody goes
  // A shared prefix of 60 counts once: 60 + 10 per sequence; 4 hold 100 and fit.
  auto shared = [](size_t k) { return k == 0 ? 0 : 60 + uint64_t{10} * k; };
  EXPECT_EQ(PlanPreemption(limits, 4, shared), 4u);
  EXPECT_EQ(PlanPreemption(limits, 5, shared), 4u);
  // One sequence over the whole budget stays: it is the last.
  EXPECT_EQ(PlanPreemption(limits, 1, [](size_t) { return uint64_t{1000}; }), 1u);
  EXPECT_EQ(PlanPreemption(limits, 3, [](size_t) { return uint64_t{1000}; }), 1u);
  EXPECT_EQ(PlanPreemption(limits, 0, own), 0u);
}

}  // namespace
}  // namespace strata::decode
