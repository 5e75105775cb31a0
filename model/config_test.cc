#include "model/config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::model {
namespace {

using testing::HasSubstr;

TEST(ModelConfigTest, ParsesLlama3StyleConfig) {
  const char* text = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128u);
  EXPECT_EQ(c->num_kv_heads, 8u);
  EXPECT_EQ(c->rope_scaling_type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling_factor, 8.0);
  EXPECT_EQ(c->eos_token_id, 128001);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(ModelConfigTest, Qwen2ImpliesAttentionBiasAndDefaultsFillIn) {
  const char* text = R"({"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "tie_word_embeddings": true})";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ(c->num_kv_heads, 4u);  // defaults to num_heads
  EXPECT_EQ(c->head_dim, 16u);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_NE(c->Fingerprint(), 0u);
}

TEST(ModelConfigTest, BadConfigsNameTheField) {
  const std::string base = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4)";
  struct Case {
    std::string text;
    const char* message;
  } cases[] = {
      {"{", "not a JSON object"},
      {R"({"model_type": "gpt2", )" + base + "}", "model_type 'gpt2'"},
      {R"({"model_type": "llama", "hidden_size": 64})", "missing 'vocab_size'"},
      {"{" + base + R"(, "num_key_value_heads": 3})", "multiple of num_key_value_heads 3"},
      {"{" + base + R"(, "rope_theta": "big"})", "'rope_theta' must be a number"},
      {"{" + base + R"(, "hidden_act": "gelu"})", "hidden_act 'gelu'"},
      {"{" + base + R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4}})", "'yarn'"},
      {"{" + base + R"(, "head_dim": 7})", "head_dim 7"},
      {"{" + base + R"(, "vocab_size": -5})", "'vocab_size' must be a non-negative integer"},
      {"{" + base + R"(, "mlp_bias": true})", "mlp_bias"},
      {"{" + base +
           R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4}})",
       "low_freq_factor < high_freq_factor"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelConfig> r = ParseModelConfig(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message)) << c.text;
  }
}

}  // namespace
}  // namespace strata::model
