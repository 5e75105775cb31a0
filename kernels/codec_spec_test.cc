#include "kernels/codec_spec.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::kernels {
namespace {

using testing::HasSubstr;

TEST(CodecSpecTest, CanonicalSpecsRoundTrip) {
  for (const char* text : {"fp16",
                           "bf16",
                           "int8",
                           "fp8e4m3",
                           "kivi:k2v2:g32",
                           "kivi:k4v2:g128",
                           "kivi:k3v3:g64",
                           "kivi:k8v8:g16",
                           "kcvt:k2v2",
                           "kcvt:k4v4",
                           "cq:c4:b6",
                           "cq:c8:b8:sink4",
                           "cq:c2:b4",
                           "cq:c4:b6:norm",
                           "gear:k2v2:g32:r4:s2",
                           "gear:k4v4:kcvt:r4:s2",
                           "gear:k2v2:g64:r2:s0.5:i5",
                           "gearl:k2v2:g32:r4",
                           "gearl:k3v2:kcvt:r8:i1",
                           "zipcache:k2v2:h4:s10",
                           "zipcache:k3v2:h8:s12.5:p10",
                           "kivi:k2v2:g32:sink4",
                           "int8:sink1",
                           "gear:k2v2:g32:r4:s2:i5:sink8",
                           "zipcache:k2v2:h4:s10:sink4",
                           "tada:k2v2:g32",
                           "tada:k4v2:kcvt:sink2",
                           "skvq:k2v2:g16",
                           "kivi:k2v2:g32:m8:sink4",
                           "strata:b3",
                           "strata:b2.25",
                           "kivi:k2v2:g32:rot",
                           "int8:rot",
                           "fp8e4m3:rot:sink4",
                           "gear:k2v2:g32:r4:s2:m8:rot:sink4",
                           "tada:k2v2:g32:rot",
                           "zipcache:k2v2:h4:s10:rot"}) {
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
  const CodecSpec z = *CodecSpec::Parse("zipcache:k2v2:h4:s10:sink4");
  EXPECT_EQ(z.id, CodecId::kZipCache);
  EXPECT_EQ(z.hi_bits, 4);
  EXPECT_DOUBLE_EQ(z.salient_percent, 10);
  EXPECT_DOUBLE_EQ(z.probe_percent, 5);
  EXPECT_EQ(z.sink_tokens, 4);
  EXPECT_EQ(z.SalientTokens(256), 26u);
  const std::vector<CodecSpec> parts = z.PartSpecs();  // sinks, salient, the rest
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].id, CodecId::kFp16);
  EXPECT_EQ(parts[1].k_bits, 4);
  EXPECT_EQ(parts[2].k_bits, 2);
  for (const CodecSpec& p : parts) EXPECT_FALSE(p.has_parts());
  EXPECT_EQ(CodecSpec::Parse("kivi:k2v2:g32")->PartSpecs().size(), 1u);
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
      {"cq:c3:b6", "c2, c4 or c8"},
      {"cq:c4", "c2, c4 or c8"},
      {"cq:c4:b9", "4..8"},
      {"cq:c4:b6:rot", "calibrated"},
      {"cq:c4:b6:m8", "m8"},
      {"gear:k2v2:g32:s2", "rank"},
      {"gear:k2v2:g32:r4", "outlier field"},
      {"gear:k2v2:g32:r4:s0", "outlier field"},
      {"gear:k2v2:g32:r4:s60", "outlier field"},
      {"gear:k2v2:g32:r99:s2", "rank"},
      {"gearl:k2v2:g32:r4:i0", "power iterations"},
      {"kcvt:k2v2:g32", "unexpected field 'g32'"},
      {"fp16:sink4", "sinks are for quantizing codecs"},
      {"int8:m8", "int8 takes no parameters but rot and sinkN"},
      {"fp16:rot", "rot is for quantizing codecs"},
      {"skvq:k2v2:g32:rot", "rot is not for calibrated codecs"},
      {"kivi:k2v2:g32:sink4:rot", "unexpected field 'rot'"},
      {"kivi:k2v2:g32:sink4:m8", "unexpected field 'm8'"},
      {"strata", "strata takes one field bX"},
      {"strata:b1", "strata takes one field bX"},
      {"kivi:k2v2:g32:sink0", "sinkN needs N in [1, 1024]"},
      {"kivi:k2v2:g32:sink4:r2", "unexpected field 'r2'"},
      {"zipcache:k2v2:s10", "salient bits"},
      {"zipcache:k4v4:h4:s10", "salient bits"},
      {"zipcache:k2v2:h4", "salient share"},
      {"zipcache:k2v2:h4:s100", "salient share"},
      {"zipcache:k2v2:h4:s10:p0", "probe share"},
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
