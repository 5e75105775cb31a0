#include "kernels/codec_spec.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::kernels {
namespace {

using testing::HasSubstr;

TEST(CodecSpecTest, CanonicalSpecsRoundTrip) {
  for (const char* text :
       {"fp16", "bf16", "int8", "fp8e4m3", "kivi:k2v2:g32", "kivi:k4v2:g128", "kivi:k3v3:g64",
        "kivi:k8v8:g16", "kcvt:k2v2", "kcvt:k4v4", "gear:k2v2:g32:r4:s2", "gear:k4v4:kcvt:r4:s2",
        "gear:k2v2:g64:r2:s0.5:i5", "gearl:k2v2:g32:r4", "gearl:k3v2:kcvt:r8:i1"}) {
    absl::StatusOr<CodecSpec> s = CodecSpec::Parse(text);
    ASSERT_TRUE(s.ok()) << text << ": " << s.status();
    EXPECT_EQ(s->ToString(), text);
    EXPECT_EQ(*CodecSpec::Parse(s->ToString()), *s);
  }
}

TEST(CodecSpecTest, FieldsAreParsed) {
  const CodecSpec g = *CodecSpec::Parse("gear:k2v4:g64:r3:s1.5:i2");
  EXPECT_EQ(g.id, CodecId::kGear);
  EXPECT_EQ(g.k_bits, 2);
  EXPECT_EQ(g.v_bits, 4);
  EXPECT_EQ(g.group, 64);
  EXPECT_EQ(g.rank, 3);
  EXPECT_DOUBLE_EQ(g.outlier_percent, 1.5);
  EXPECT_EQ(g.power_iterations, 2);
  EXPECT_DOUBLE_EQ(g.nominal_bits(), 3.0);
  EXPECT_EQ(CodecSpec::Parse("gear:k2v2:g32:r4:s2:i3")->ToString(), "gear:k2v2:g32:r4:s2");
  EXPECT_EQ(CodecSpec::Parse("kcvt:k2v2")->group, 0);
}

TEST(CodecSpecTest, BadSpecsSayWhatIsWrong) {
  struct Case {
    const char* text;
    const char* message;
  } cases[] = {
      {"", "unknown codec ''"},
      {"zstd", "unknown codec 'zstd'"},
      {"fp16:k2v2", "takes no parameters"},
      {"kivi", "bits"},
      {"kivi:k5v2:g32", "bits must be 2, 3, 4 or 8"},
      {"kivi:k2v2", "missing the group"},
      {"kivi:k2v2:g30", "multiple of 8"},
      {"kivi:k2v2:kcvt", "group 'kcvt'"},
      {"kivi:k2v2:g32:r4", "unexpected field 'r4'"},
      {"gear:k2v2:g32:s2", "rank"},
      {"gear:k2v2:g32:r4", "outlier field"},
      {"gear:k2v2:g32:r4:s0", "outlier field"},
      {"gear:k2v2:g32:r4:s60", "outlier field"},
      {"gear:k2v2:g32:r99:s2", "rank"},
      {"gearl:k2v2:g32:r4:i0", "power iterations"},
      {"kcvt:k2v2:g32", "unexpected field 'g32'"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<CodecSpec> s = CodecSpec::Parse(c.text);
    ASSERT_FALSE(s.ok()) << c.text;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.message)) << c.text;
  }
}

}  // namespace
}  // namespace strata::kernels
