#include "model/config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", what));
}

// Reads an optional unsigned field; absent leaves *out unchanged.
absl::Status GetUint(const Json& j, const char* key, uint32_t* out, bool required) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    return required ? Bad(absl::StrCat("missing '", key, "'")) : absl::OkStatus();
  }
  if (!it->is_number_unsigned() || it->get<uint64_t>() > (1ull << 31)) {
    return Bad(absl::StrCat("'", key, "' must be a non-negative integer"));
  }
  *out = static_cast<uint32_t>(it->get<uint64_t>());
  return absl::OkStatus();
}

absl::Status GetDouble(const Json& j, const char* key, double* out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return Bad(absl::StrCat("'", key, "' must be a number"));
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status GetBool(const Json& j, const char* key, bool* out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return Bad(absl::StrCat("'", key, "' must be true or false"));
  *out = it->get<bool>();
  return absl::OkStatus();
}

// bos/eos may be an integer or a list (Llama 3.1 lists several eos ids; the first is kept).
absl::Status GetTokenId(const Json& j, const char* key, int64_t* out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  const Json& v = it->is_array() && !it->empty() ? (*it)[0] : *it;
  if (!v.is_number_integer()) return Bad(absl::StrCat("'", key, "' must be a token id"));
  *out = v.get<int64_t>();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view text) {
  const Json j = Json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Bad("not a JSON object");
  ModelConfig c;
  if (const auto it = j.find("model_type"); it != j.end() && it->is_string()) {
    c.model_type = it->get<std::string>();
  }
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2") {
    return Bad(absl::StrCat("model_type '", c.model_type, "' is not one of llama, mistral, qwen2"));
  }
  STRATA_RETURN_IF_ERROR(GetUint(j, "vocab_size", &c.vocab_size, true));
  STRATA_RETURN_IF_ERROR(GetUint(j, "hidden_size", &c.hidden_size, true));
  STRATA_RETURN_IF_ERROR(GetUint(j, "intermediate_size", &c.intermediate_size, true));
  STRATA_RETURN_IF_ERROR(GetUint(j, "num_hidden_layers", &c.num_layers, true));
  STRATA_RETURN_IF_ERROR(GetUint(j, "num_attention_heads", &c.num_heads, true));
  c.num_kv_heads = c.num_heads;
  STRATA_RETURN_IF_ERROR(GetUint(j, "num_key_value_heads", &c.num_kv_heads, false));
  if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  STRATA_RETURN_IF_ERROR(GetUint(j, "head_dim", &c.head_dim, false));
  STRATA_RETURN_IF_ERROR(GetUint(j, "max_position_embeddings", &c.max_position_embeddings, false));
  STRATA_RETURN_IF_ERROR(GetDouble(j, "rope_theta", &c.rope_theta));
  STRATA_RETURN_IF_ERROR(GetDouble(j, "rms_norm_eps", &c.rms_norm_eps));
  STRATA_RETURN_IF_ERROR(GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings));
  c.attention_bias = c.model_type == "qwen2";
  STRATA_RETURN_IF_ERROR(GetBool(j, "attention_bias", &c.attention_bias));
  bool mlp_bias = false;
  STRATA_RETURN_IF_ERROR(GetBool(j, "mlp_bias", &mlp_bias));
  if (mlp_bias) return Bad("mlp_bias is not supported");
  {
    uint32_t window = 0;
    STRATA_RETURN_IF_ERROR(GetUint(j, "sliding_window", &window, false));
    bool use = c.model_type == "mistral";
    STRATA_RETURN_IF_ERROR(GetBool(j, "use_sliding_window", &use));
    if (use) c.sliding_window = window;
  }
  STRATA_RETURN_IF_ERROR(GetTokenId(j, "bos_token_id", &c.bos_token_id));
  STRATA_RETURN_IF_ERROR(GetTokenId(j, "eos_token_id", &c.eos_token_id));
  if (const auto it = j.find("torch_dtype"); it != j.end() && it->is_string()) {
    c.torch_dtype = it->get<std::string>();
  }
  if (const auto it = j.find("hidden_act");
      it != j.end() && it->is_string() && it->get<std::string>() != "silu") {
    return Bad(absl::StrCat("hidden_act '", it->get<std::string>(), "' is not silu"));
  }
  if (const auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return Bad("'rope_scaling' must be an object or null");
    const Json& rs = *it;
    const auto type = rs.contains("rope_type") ? rs.find("rope_type") : rs.find("type");
    if (type == rs.end() || !type->is_string()) return Bad("'rope_scaling' has no rope_type");
    c.rope_scaling_type = type->get<std::string>();
    if (c.rope_scaling_type != "llama3" && c.rope_scaling_type != "linear" &&
        c.rope_scaling_type != "default") {
      return Bad(absl::StrCat("rope_scaling type '", c.rope_scaling_type,
                              "' is not supported (llama3, linear)"));
    }
    if (c.rope_scaling_type == "default") c.rope_scaling_type.clear();
    STRATA_RETURN_IF_ERROR(GetDouble(rs, "factor", &c.rope_scaling_factor));
    STRATA_RETURN_IF_ERROR(GetDouble(rs, "low_freq_factor", &c.rope_low_freq_factor));
    STRATA_RETURN_IF_ERROR(GetDouble(rs, "high_freq_factor", &c.rope_high_freq_factor));
    STRATA_RETURN_IF_ERROR(
        GetUint(rs, "original_max_position_embeddings", &c.rope_original_max_position, false));
  }
  absl::Status s = c.Validate();
  if (!s.ok()) return s;
  return c;
}

absl::Status ModelConfig::Validate() const {
  if (vocab_size < 2 || vocab_size > (1u << 24)) return Bad("vocab_size out of range");
  if (num_layers < 1 || num_layers > 1024) return Bad("num_hidden_layers out of range");
  if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
    return Bad(absl::StrCat("num_attention_heads ", num_heads,
                            " must be a positive multiple of num_key_value_heads ", num_kv_heads));
  }
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > 1024) {
    return Bad(absl::StrCat("head_dim ", head_dim, " must be even and in [2, 1024]"));
  }
  if (hidden_size < 1 || intermediate_size < 1) return Bad("hidden/intermediate size is zero");
  if (!(rope_theta > 0) || !(rms_norm_eps > 0) || !(rope_scaling_factor > 0)) {
    return Bad("rope_theta, rms_norm_eps and rope scaling factor must be positive");
  }
  if (rope_scaling_type == "llama3" &&
      (!(rope_high_freq_factor > rope_low_freq_factor) || !(rope_low_freq_factor > 0) ||
       rope_original_max_position == 0)) {
    return Bad(
        "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and "
        "original_max_position_embeddings > 0");
  }
  if (torch_dtype != "float16" && torch_dtype != "bfloat16" && torch_dtype != "float32") {
    return Bad(absl::StrCat("torch_dtype '", torch_dtype, "' is not float16/bfloat16/float32"));
  }
  return absl::OkStatus();
}

uint64_t ModelConfig::Fingerprint() const {
  return Fingerprint64(absl::StrFormat(
      "%s:v%u:h%u:i%u:l%u:q%u:kv%u:d%u:theta%g:%s%g:eps%g:tie%d:bias%d", model_type, vocab_size,
      hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, rope_theta,
      rope_scaling_type, rope_scaling_factor, rms_norm_eps, tie_word_embeddings, attention_bias));
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<ModelConfig> c = ParseModelConfig(ss.str());
  if (!c.ok()) {
    return absl::Status(c.status().code(), absl::StrCat(c.status().message(), " (", path, ")"));
  }
  return c;
}

}  // namespace strata::model
