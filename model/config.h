// ModelConfig: the Llama-family shape Strata's engine runs, read from a Hugging Face
// config.json (Llama, Mistral and Qwen2 naming).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::model {

struct ModelConfig {
  std::string model_type = "llama";  // llama, mistral, qwen2
  uint32_t vocab_size = 0;
  uint32_t hidden_size = 0;
  uint32_t intermediate_size = 0;
  uint32_t num_layers = 0;
  uint32_t num_heads = 0;     // query heads
  uint32_t num_kv_heads = 0;  // key/value heads (GQA); defaults to num_heads
  uint32_t head_dim = 0;      // defaults to hidden_size / num_heads
  uint32_t max_position_embeddings = 2048;
  double rope_theta = 10000.0;
  // RoPE scaling as Llama 3 does it ("llama3"); "" for none, "linear" also understood.
  std::string rope_scaling_type;
  double rope_scaling_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  uint32_t rope_original_max_position = 8192;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases (Qwen2 always has them; Llama's also o_proj)
  // Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window): 0 when off. The
  // engine attends over full context, so it refuses sequences longer than the window.
  uint32_t sliding_window = 0;
  std::string torch_dtype = "float16";
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;

  // Every field within sense and consistent (heads divide, GQA divides); kInvalidArgument
  // naming the field.
  absl::Status Validate() const;

  // Fingerprint64 of the canonical shape. (Blocks are named by LlamaModel::fingerprint(), which
  // also covers the weights.)
  uint64_t Fingerprint() const;
};

// Parses config.json text. kInvalidArgument naming the field that is missing or wrong.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text);
// Reads DIR/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace strata::model
