#include "tools/progress.h"

#include <algorithm>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::tools {
namespace {

using testing::HasSubstr;

TEST(ProgressTest, LineShowsTheCountTheShareAndWhatIsLeft) {
  const std::string l =
      Progress::Line("eval", 3, 7, absl::Seconds(72), "kivi:k2v2:g32", /*bar=*/true);
  EXPECT_THAT(l, HasSubstr("eval: [##########..............] 3/7 (42%) 1m12s"));
  EXPECT_THAT(l, HasSubstr("about 1m36s left"));  // 24 s a step, 4 steps left
  EXPECT_THAT(l, HasSubstr(": kivi:k2v2:g32"));
  // No estimate before the first step or after the last; no bar off a terminal.
  EXPECT_THAT(Progress::Line("eval", 0, 7, absl::Seconds(3), "", false), testing::Not(HasSubstr("left")));
  EXPECT_EQ(Progress::Line("replay", 7, 7, absl::Seconds(3725), "", false),
            "replay: 7/7 (100%) 1h02m");
}

TEST(ProgressTest, OffATerminalItPrintsALineAtMostEveryIntervalAndAtTheEnd) {
  std::ostringstream err;
  {
    Progress p("calibrate", 4, &err, /*tty=*/0, absl::Hours(1));
    p.Advance(1, "layer 0");
    p.Advance(1, "layer 1");  // within the interval: nothing
    p.Advance(2, "layer 3");
  }  // Done: the last line
  EXPECT_EQ(err.str(), "calibrate: 0/4 (0%) 0s\ncalibrate: 4/4 (100%) 0s: layer 3\n");
}

TEST(ProgressTest, OnATerminalItRedrawsOneLine) {
  std::ostringstream err;
  {
    Progress p("eval", 2, &err, /*tty=*/1);
    p.Advance(1, "fp16");
    p.Advance(1, "kivi");
  }
  const std::string s = err.str();
  EXPECT_EQ(std::count(s.begin(), s.end(), '\r'), 4);  // start, two steps, the end
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 1);  // one line feed, at the end
  EXPECT_THAT(s, HasSubstr("[########################] 2/2 (100%)"));
}

}  // namespace
}  // namespace strata::tools
