#include "model/llama.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

// Holds the engine to the logits PyTorch computed for the same (fp16-rounded) weights.
void CheckAgainstFixture(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> fx =
      SafetensorsFile::Open(dir + "/fixture.safetensors");
  ASSERT_TRUE(fx.ok()) << fx.status();
  const uint32_t vocab = (*model)->config().vocab_size;
  ASSERT_NE((*fx)->Find("ids.0"), nullptr);
  for (int s = 0; (*fx)->Find(absl::StrCat("ids.", s)) != nullptr; ++s) {
    const TensorInfo* ids_t = (*fx)->Find(absl::StrCat("ids.", s));
    const TensorInfo* logits_t = (*fx)->Find(absl::StrCat("logits.", s));
    ASSERT_NE(logits_t, nullptr);
    std::vector<int32_t> ids32(ids_t->numel());
    std::memcpy(ids32.data(), (*fx)->Data(*ids_t).data(), ids32.size() * 4);
    const std::vector<uint32_t> ids(ids32.begin(), ids32.end());
    std::vector<float> want(logits_t->numel());
    std::memcpy(want.data(), (*fx)->Data(*logits_t).data(), want.size() * 4);
    ASSERT_EQ(want.size(), ids.size() * vocab);
    std::vector<LayerKv> kv;
    absl::StatusOr<std::vector<float>> got = (*model)->Forward(ids, &kv);
    ASSERT_TRUE(got.ok()) << got.status();
    double max_err = 0, max_abs = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_err = std::max(max_err, std::fabs(double{(*got)[i]} - want[i]));
      max_abs = std::max(max_abs, std::fabs(double{want[i]}));
    }
    EXPECT_LT(max_err, 2e-3 * std::max(1.0, max_abs)) << dir << " sequence " << s;
    for (size_t t = 0; t < ids.size(); ++t) {  // greedy argmax agrees at every position
      const float* g = &(*got)[t * vocab];
      const float* w = &want[t * vocab];
      EXPECT_EQ(std::max_element(g, g + vocab) - g, std::max_element(w, w + vocab) - w)
          << dir << " sequence " << s << " position " << t;
    }
    ASSERT_EQ(kv.size(), (*model)->config().num_layers);
    EXPECT_EQ(kv[0].k.size(),
              ids.size() * (*model)->config().num_kv_heads * (*model)->config().head_dim);
  }
}

TEST(LlamaModelTest, MatchesPyTorchLogitsOnTheLlamaShapedTestModel) {
  CheckAgainstFixture(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
}

TEST(LlamaModelTest, MatchesPyTorchLogitsOnTheQwen2ShapedTestModel) {
  CheckAgainstFixture(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-qwen2"));
}

TEST(LlamaModelTest, BadInputsAreRejected) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  ASSERT_TRUE(model.ok());
  const std::vector<uint32_t> bad = {1, 99999};
  EXPECT_EQ((*model)->Forward(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->Forward({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LlamaModel::Load("/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::model
