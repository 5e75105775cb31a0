#include "tools/model_commands.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"

namespace strata::tools {
namespace {

using testing::HasSubstr;

const std::string kModel = absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama");

std::string WriteText() {
  const std::string path = absl::StrCat(testing::TempDir(), "/ppl.txt");
  std::ofstream f(path);
  for (int i = 0; i < 20; ++i) {
    f << "The kernel loads modules at boot. Use the command line to list files and read the "
         "manual page of each program before you change its configuration.\n";
  }
  return path;
}

TEST(ModelCommandsTest, GenerateIsDeterministicAndReportsSpeed) {
  GenerateOptions o;
  o.model_dir = kModel;
  o.prompt = "The manual";
  o.max_tokens = 12;
  o.chunk_tokens = 8;
  o.codec = "kivi:k4v4:g8";
  std::ostringstream out1, out2, info;
  ASSERT_TRUE(RunGenerate(o, out1, info).ok());
  ASSERT_TRUE(RunGenerate(o, out2, info).ok());
  EXPECT_EQ(out1.str(), out2.str());
  EXPECT_THAT(out1.str(), testing::StartsWith("The manual"));
  EXPECT_GT(out1.str().size(), o.prompt.size() + 1);
  EXPECT_THAT(info.str(), HasSubstr("tok/s"));
}

TEST(ModelCommandsTest, PerplexityRisesWithCoarserCodecs) {
  PplOptions o;
  o.model_dir = kModel;
  o.text_file = WriteText();
  o.context = 256;
  o.chunk_tokens = 32;
  auto ppl = [&](const std::string& codec) {
    o.codec = codec;
    std::ostringstream out;
    EXPECT_TRUE(RunPpl(o, out).ok()) << codec;
    double v = 0;
    std::sscanf(out.str().c_str(), "perplexity %lf", &v);
    return v;
  };
  const double fp16 = ppl("fp16"), kivi8 = ppl("kivi:k8v8:g32"), kivi2 = ppl("kivi:k2v2:g32");
  EXPECT_GT(fp16, 1.0);
  EXPECT_NEAR(kivi8, fp16, 0.02 * fp16);
  EXPECT_GT(kivi2, kivi8);
}

TEST(ModelCommandsTest, DumpKvWritesEveryLayer) {
  DumpKvOptions o;
  o.model_dir = kModel;
  o.text_file = WriteText();
  o.out_dir = absl::StrCat(testing::TempDir(), "/dumpkv");
  o.max_tokens = 100;
  std::ostringstream out;
  ASSERT_TRUE(RunDumpKv(o, out).ok());
  auto f = model::SafetensorsFile::Open(o.out_dir + "/kv.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  const model::TensorInfo* k1 = (*f)->Find("layers.1.k");
  ASSERT_NE(k1, nullptr);
  EXPECT_THAT(k1->shape, testing::ElementsAre(100, 2, 32));
  EXPECT_NE((*f)->Find("token_ids"), nullptr);
}

TEST(ModelCommandsTest, MissingModelIsNotFound) {
  GenerateOptions o;
  o.model_dir = "/nonexistent-model";
  std::ostringstream out, info;
  EXPECT_EQ(RunGenerate(o, out, info).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::tools
