#include "tools/model_commands.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tools/replay_command.h"

namespace strata::tools {
namespace {

using testing::HasSubstr;

const std::string kModel = absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama");
// A head dim the GPU path takes (tiny-llama's 32 is refused by shape before any device is asked).
const std::string kGpuShapedModel = absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny");

// CTest runs these tests as parallel processes: each writes its own file (one shared name let a
// test read the text while another was rewriting it).
std::string WriteText() {
  const std::string path =
      absl::StrCat(testing::TempDir(), "/ppl-",
                   testing::UnitTest::GetInstance()->current_test_info()->name(), ".txt");
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
    EXPECT_THAT(out.str(), HasSubstr(" s on cpu\n"));
    double v = 0;
    std::sscanf(out.str().c_str(), "perplexity %lf", &v);
    return v;
  };
  const double fp16 = ppl("fp16"), kivi8 = ppl("kivi:k8v8:g32"), kivi2 = ppl("kivi:k2v2:g32");
  EXPECT_GT(fp16, 1.0);
  EXPECT_NEAR(kivi8, fp16, 0.02 * fp16);
  EXPECT_GT(kivi2, kivi8);
}

TEST(ModelCommandsTest, EvalReportsEveryCodecAndWritesJson) {
  EvalOptions o;
  o.model_dir = kModel;
  o.text_file = WriteText();
  o.context = 128;
  o.chunk_tokens = 32;
  o.max_windows = 2;
  o.continuations = 2;
  o.prompt_tokens = 70;
  o.generate_tokens = 6;
  o.error_queries = 16;
  o.codecs = {"fp16", "kivi:k8v8:g32", "kivi:k2v2:g32", "zipcache:k2v2:h4:s10:sink2"};
  o.json_out = absl::StrCat(testing::TempDir(), "/eval.json");
  std::ostringstream out;
  const absl::Status s = RunEval(o, out);
  ASSERT_TRUE(s.ok()) << s;
  std::ifstream f(o.json_out);
  std::stringstream ss;
  ss << f.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str());
  ASSERT_EQ(j["codecs"].size(), 4u);
  const nlohmann::json& fp16 = j["codecs"][0];
  const nlohmann::json& k8 = j["codecs"][1];
  const nlohmann::json& k2 = j["codecs"][2];
  EXPECT_NEAR(fp16["perplexity_change_percent"].get<double>(), 0.0, 1e-9);
  EXPECT_DOUBLE_EQ(fp16["greedy_agreement"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(fp16["greedy_agreement_stderr"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(fp16["top1_agreement_teacher_forced"].get<double>(), 1.0);
  // Each continuation's agreement, and their mean the whole figure (equal lengths).
  for (const nlohmann::json& c : j["codecs"]) {
    const nlohmann::json& each = c["greedy_agreement_per_continuation"];
    ASSERT_EQ(each.size(), 2u);
    double mean = 0;
    for (const nlohmann::json& a : each) {
      EXPECT_GE(a.get<double>(), 0.0);
      EXPECT_LE(a.get<double>(), 1.0);
      mean += a.get<double>() / 2;
    }
    EXPECT_NEAR(mean, c["greedy_agreement"].get<double>(), 1e-12) << c["codec"];
    const double a0 = each[0].get<double>(), a1 = each[1].get<double>();
    EXPECT_NEAR(c["greedy_agreement_stderr"].get<double>(), std::fabs(a0 - a1) / 2, 1e-12)
        << c["codec"];
  }
  EXPECT_LT(fp16["attn_rel_error"]["worst"].get<double>(), 1e-3);
  EXPECT_NEAR(fp16["kl_to_fp16_nats"].get<double>(), 0.0, 1e-6);
  EXPECT_GT(k8["kl_to_fp16_nats"].get<double>(), 0.0);
  EXPECT_GT(k2["kl_to_fp16_nats"].get<double>(), k8["kl_to_fp16_nats"].get<double>());
  // Fewer bits: smaller blocks, larger errors.
  EXPECT_LT(k2["bits_per_element"].get<double>(), k8["bits_per_element"].get<double>());
  EXPECT_GT(k2["k_rel_error"]["mean"].get<double>(), k8["k_rel_error"]["mean"].get<double>());
  EXPECT_GT(k2["attn_rel_error"]["mean"].get<double>(), k8["attn_rel_error"]["mean"].get<double>());
  EXPECT_EQ(k2["k_rel_error"]["per_layer"].size(), 2u);  // the test model's layers
  EXPECT_GE(k2["attn_rel_error"]["worst"].get<double>(), k2["attn_rel_error"]["mean"].get<double>());
  EXPECT_THAT(out.str(), HasSubstr("zipcache:k2v2:h4:s10:sink2"));
  // The mix: calibrated on the same text here (a test), its per-layer choice is reported.
  o.codecs = {"fp16", "strata:b4"};
  o.calib_text_file = o.text_file;
  o.max_windows = 1;
  std::ostringstream mix;
  const absl::Status ms = RunEval(o, mix);
  ASSERT_TRUE(ms.ok()) << ms;
  EXPECT_THAT(mix.str(), HasSubstr("strata:b4"));
  EXPECT_THAT(mix.str(), HasSubstr("layers: "));
  std::ifstream f2(o.json_out);
  std::stringstream ss2;
  ss2 << f2.rdbuf();
  const nlohmann::json j2 = nlohmann::json::parse(ss2.str());
  ASSERT_EQ(j2["codecs"].size(), 2u);
  ASSERT_EQ(j2["codecs"][1]["layer_codecs"].size(), 2u);  // the test model's layers
  EXPECT_LE(j2["codecs"][1]["bits_per_element"].get<double>(), 4.0 + 0.2);  // sinks amortized
  o.calib_text_file.clear();
  o.max_windows = 2;
  // A codec that does not parse is refused before any work.
  o.codecs = {"fp16", "kivi:k9v9:g32"};
  EXPECT_EQ(RunEval(o, out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModelCommandsTest, CalibrateWritesAFileThatPplAndEvalUse) {
  CalibrateOptions o;
  o.model_dir = kModel;
  o.codec = "skvq:k2v2:g16";
  o.text_file = WriteText();
  o.out_file = absl::StrCat(testing::TempDir(), "/skvq.json");
  o.context = 96;
  o.chunk_tokens = 32;
  o.error_queries = 16;
  std::ostringstream out;
  absl::Status s = RunCalibrate(o, out);
  ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<kernels::Calibration> cal = kernels::Calibration::Load(o.out_file);
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->codec, "skvq:k2v2:g16");
  EXPECT_EQ(cal->layers.size(), 2u);
  EXPECT_NE(cal->model_fingerprint, 0u);
  EXPECT_THAT(out.str(), HasSubstr("layer 1: clip K"));
  // ppl needs it: refused without, runs with it.
  PplOptions p;
  p.model_dir = kModel;
  p.text_file = o.text_file;
  p.context = 128;
  p.chunk_tokens = 32;
  p.codec = "skvq:k2v2:g16";
  EXPECT_EQ(RunPpl(p, out).code(), absl::StatusCode::kFailedPrecondition);
  p.calibration = std::make_shared<kernels::Calibration>(*cal);
  s = RunPpl(p, out);
  EXPECT_TRUE(s.ok()) << s;
  // A calibration for another codec is refused too.
  p.codec = "skvq:k4v4:g16";
  EXPECT_EQ(RunPpl(p, out).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ReplayCommandTest, SweepsEveryConfigurationAndCompressionRaisesHits) {
  const std::string trace = absl::StrCat(testing::TempDir(), "/trace.jsonl");
  {
    std::ofstream f(trace);
    for (int turn = 1; turn <= 4; ++turn) {  // 30 interleaved conversations, a shared prompt
      for (int c = 0; c < 30; ++c) {
        f << "{\"timestamp\": 0, \"input_length\": " << 512 * (2 + 2 * turn)
          << ", \"output_length\": 10, \"hash_ids\": [0, 1";
        for (int k = 0; k < 2 * turn; ++k) f << ", " << 1000 * (c + 1) + k;
        f << "]}\n";
      }
    }
  }
  ReplayOptions o;
  o.trace_file = trace;
  o.codecs = {"fp16", "kivi:k2v2:g32"};
  o.ram_bytes = {uint64_t{1} << 30, uint64_t{4} << 30};
  o.disk_bytes = uint64_t{64} << 30;
  o.json_out = absl::StrCat(testing::TempDir(), "/replay.json");
  std::ostringstream out;
  const absl::Status s = RunReplay(o, out);
  ASSERT_TRUE(s.ok()) << s;
  std::ifstream f(o.json_out);
  std::stringstream ss;
  ss << f.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str());
  ASSERT_EQ(j["runs"].size(), 2u * 2 * 2 * 2);  // codecs x disk or not x policies x RAM sizes
  auto hit = [&](const std::string& codec, uint64_t ram, uint64_t disk) {
    for (const auto& r : j["runs"]) {
      if (r["codec"] == codec && r["ram_bytes"] == ram && r["disk_bytes"] == disk &&
          r["policy"] == "s3fifo") {
        return r["token_hit_rate"].get<double>();
      }
    }
    ADD_FAILURE() << "no run";
    return 0.0;
  };
  // 1 GiB holds 15 fp16 chunks of this 8B-shaped model but ~80 at 3 bits.
  EXPECT_GT(hit("kivi:k2v2:g32", 1ull << 30, 0), hit("fp16", 1ull << 30, 0));
  EXPECT_GE(hit("fp16", 1ull << 30, 64ull << 30), hit("fp16", 1ull << 30, 0));
  o.trace_file = "/nonexistent";
  EXPECT_EQ(RunReplay(o, out).code(), absl::StatusCode::kNotFound);
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

// --device: a name that is no device is refused naming it; a CUDA device on a machine (or build)
// without one says so instead of running on the CPU unasked; a codec the GPU path does not keep
// yet is refused naming it.
TEST(ModelCommandsTest, GenerateOnADeviceItCannotUseSaysWhy) {
  GenerateOptions o;
  o.model_dir = kModel;
  o.prompt = "The manual";
  o.max_tokens = 2;
  std::ostringstream out, info;
  o.device = "gpu";
  absl::Status s = RunGenerate(o, out, info);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'gpu'"));
  o.device = "cuda:0";
  o.codec = "kivi:k4v4:g8";
  s = RunGenerate(o, out, info);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), testing::AnyOf(HasSubstr("kivi:k4v4:g8"), HasSubstr("no CUDA")));
  o.codec = "fp16";
  s = RunGenerate(o, out, info);
  if (s.ok()) GTEST_SKIP() << "a GPU is here: generate ran on it";
  EXPECT_THAT(s.code(), testing::AnyOf(absl::StatusCode::kFailedPrecondition,
                                       absl::StatusCode::kUnimplemented))
      << s;
  EXPECT_THAT(s.message(), testing::AnyOf(HasSubstr("no usable GPU"), HasSubstr("no CUDA")));
}

// ppl and eval on a device they cannot use say why (no GPU here, or no CUDA in this build; a head
// dim the GPU path does not take, named);
// calibrate and dump-kv run on the CPU only and say so.
TEST(ModelCommandsTest, PplAndEvalOnADeviceTheyCannotUseSayWhy) {
  PplOptions p;
  p.model_dir = kGpuShapedModel;
  p.text_file = WriteText();
  p.context = 64;
  p.max_windows = 1;
  p.chunk_tokens = 16;
  std::ostringstream out;
  p.device = "cuda:7x";
  EXPECT_EQ(RunPpl(p, out).code(), absl::StatusCode::kInvalidArgument);
  p.device = "cuda:0";
  p.model_dir = kModel;
  const absl::Status shape = RunPpl(p, out);
  EXPECT_THAT(shape.code(),
              testing::AnyOf(absl::StatusCode::kInvalidArgument, absl::StatusCode::kUnimplemented))
      << shape;
  EXPECT_THAT(shape.message(), testing::AnyOf(HasSubstr("head_dim 32"), HasSubstr("no CUDA")));
  p.model_dir = kGpuShapedModel;
  const absl::Status s = RunPpl(p, out);
  if (s.ok()) GTEST_SKIP() << "a GPU is here: ppl ran on it";
  EXPECT_THAT(s.code(), testing::AnyOf(absl::StatusCode::kFailedPrecondition,
                                       absl::StatusCode::kUnimplemented))
      << s;
  EXPECT_THAT(s.message(), testing::AnyOf(HasSubstr("no usable GPU"), HasSubstr("no CUDA")));
  EvalOptions e;
  e.model_dir = kGpuShapedModel;
  e.text_file = p.text_file;
  e.context = 64;
  e.prompt_tokens = 20;
  e.continuations = 1;
  e.chunk_tokens = 16;
  e.error_queries = 8;
  e.codecs = {"kivi:k4v4:g16"};
  e.device = "cuda:0";
  EXPECT_EQ(RunEval(e, out).code(), s.code());
  CalibrateOptions c;
  c.device = "cuda:0";
  EXPECT_EQ(RunCalibrate(c, out).code(), absl::StatusCode::kInvalidArgument);
  DumpKvOptions d;
  d.device = "cuda:0";
  const absl::Status ds = RunDumpKv(d, out);
  EXPECT_EQ(ds.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.message(), HasSubstr("dump-kv runs on the CPU"));
}

TEST(ModelCommandsTest, KvStructureReportsEveryLayerAndWritesJson) {
  KvStructureOptions o;
  o.model_dir = kModel;
  o.text_file = WriteText();
  o.context = 96;
  o.json_out = absl::StrCat(testing::TempDir(), "/kv-structure.json");
  std::ostringstream out;
  const absl::Status s = RunKvStructure(o, out);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_THAT(out.str(), HasSubstr("K spread"));
  std::ifstream f(o.json_out);
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["tokens"], 96);
  ASSERT_EQ(j["layers"].size(), 2u);  // tiny-llama's
  for (const auto& l : j["layers"]) {
    EXPECT_GE(l["k_spread"].get<double>(), 1.0);
    EXPECT_GE(l["k_spread_rotated"].get<double>(), 1.0);
    EXPECT_GT(l["first_token_mass"].get<double>(), 0.0);
    EXPECT_LT(l["first_token_mass"].get<double>(), 1.0);
  }
  o.device = "cuda";
  EXPECT_EQ(RunKvStructure(o, out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModelCommandsTest, MissingModelIsNotFound) {
  GenerateOptions o;
  o.model_dir = "/nonexistent-model";
  std::ostringstream out, info;
  EXPECT_EQ(RunGenerate(o, out, info).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::tools
