#include "tools/model_commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

namespace strata::tools {
namespace {

struct Loaded {
  std::unique_ptr<model::LlamaModel> model;
  std::unique_ptr<model::Tokenizer> tokenizer;
};

absl::StatusOr<Loaded> Load(const ModelCommandOptions& o) {
  Loaded l;
  STRATA_ASSIGN_OR_RETURN(l.model, model::LlamaModel::Load(o.model_dir));
  STRATA_ASSIGN_OR_RETURN(l.tokenizer, model::Tokenizer::Load(o.model_dir));
  return l;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<uint32_t> WithBos(const model::ModelConfig& c, std::vector<uint32_t> ids) {
  if (c.bos_token_id >= 0 && (ids.empty() || ids[0] != c.bos_token_id)) {
    ids.insert(ids.begin(), static_cast<uint32_t>(c.bos_token_id));
  }
  return ids;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

absl::Status RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& info) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  const std::vector<uint32_t> prompt = WithBos(c, l.tokenizer->Encode(o.prompt));
  STRATA_ASSIGN_OR_RETURN(auto cache,
                          l.model->NewCache({.codec = o.codec, .chunk_tokens = o.chunk_tokens}));
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_ASSIGN_OR_RETURN(std::vector<float> logits, l.model->Step(prompt, cache.get()));
  const double prefill_s = Seconds(t0);
  std::mt19937_64 rng(o.seed);
  std::vector<uint32_t> generated;
  out << o.prompt;
  const auto t1 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < o.max_tokens; ++i) {
    const float* last = &logits[logits.size() - c.vocab_size];
    uint32_t next;
    if (o.temperature <= 0) {
      next = static_cast<uint32_t>(std::max_element(last, last + c.vocab_size) - last);
    } else {
      std::vector<double> p(c.vocab_size);
      const float mx = *std::max_element(last, last + c.vocab_size);
      for (uint32_t v = 0; v < c.vocab_size; ++v) p[v] = std::exp((last[v] - mx) / o.temperature);
      next = static_cast<uint32_t>(std::discrete_distribution<uint32_t>(p.begin(), p.end())(rng));
    }
    if (c.eos_token_id >= 0 && next == c.eos_token_id) break;
    generated.push_back(next);
    STRATA_ASSIGN_OR_RETURN(std::string piece, l.tokenizer->Decode({next}));
    out << piece << std::flush;
    STRATA_ASSIGN_OR_RETURN(logits, l.model->Step({&next, 1}, cache.get()));
  }
  out << "\n";
  const double decode_s = Seconds(t1);
  info << absl::StrFormat(
      "[%d prompt tokens in %.3f s (%.1f tok/s), %d generated in %.3f s (%.1f tok/s); KV cache %s: "
      "%d blocks of %d tokens per layer (%d bytes) + %d-token window]\n",
      prompt.size(), prefill_s, prompt.size() / prefill_s, generated.size(), decode_s,
      generated.size() / std::max(decode_s, 1e-9), o.codec, cache->blocks_per_layer(),
      o.chunk_tokens, cache->block_bytes(), cache->window_tokens());
  return absl::OkStatus();
}

absl::Status RunPpl(const PplOptions& o, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  if (ids.size() < 2) return absl::InvalidArgumentError("ppl: the text has fewer than 2 tokens");
  if (o.context < 2) return absl::InvalidArgumentError("ppl: --context must be >= 2");
  double nll = 0;
  size_t scored = 0, windows = 0, block_bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t start = 0; start + 1 < ids.size(); start += o.context) {
    if (o.max_windows != 0 && windows == o.max_windows) break;
    const size_t end = std::min(ids.size(), start + o.context);
    STRATA_ASSIGN_OR_RETURN(auto cache,
                            l.model->NewCache({.codec = o.codec, .chunk_tokens = o.chunk_tokens}));
    // As in serving: chunk by chunk, each chunk attending over the compressed earlier chunks.
    for (size_t s = start; s < end; s += o.chunk_tokens) {
      const size_t e = std::min(end, s + o.chunk_tokens);
      STRATA_ASSIGN_OR_RETURN(
          std::vector<float> logits,
          l.model->Step(absl::MakeConstSpan(ids).subspan(s, e - s), cache.get()));
      for (size_t t = s; t < e && t + 1 < end; ++t) {
        const float* row = &logits[(t - s) * c.vocab_size];
        const float mx = *std::max_element(row, row + c.vocab_size);
        double sum = 0;
        for (uint32_t v = 0; v < c.vocab_size; ++v) sum += std::exp(double{row[v]} - mx);
        nll += -(row[ids[t + 1]] - mx - std::log(sum));
        ++scored;
      }
    }
    block_bytes += cache->block_bytes();
    ++windows;
  }
  const double ppl = std::exp(nll / scored);
  absl::StatusOr<std::unique_ptr<kernels::Codec>> codec = kernels::Codec::Create(o.codec);
  const double bits = *(*codec)->BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim);
  out << absl::StrFormat(
      "perplexity %.4f over %d tokens (%d windows of up to %d) with KV codec %s at %.3f bits "
      "per element (%d-token chunks); %.1f s\n",
      ppl, scored, windows, o.context, o.codec, bits, o.chunk_tokens, Seconds(t0));
  return absl::OkStatus();
}

absl::Status RunDumpKv(const DumpKvOptions& o, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  if (ids.size() > o.max_tokens) ids.resize(o.max_tokens);
  std::vector<model::LayerKv> kv;
  STRATA_RETURN_IF_ERROR(l.model->Forward(ids, &kv).status());
  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  std::vector<model::TensorToWrite> tensors;
  const int64_t t = static_cast<int64_t>(ids.size());
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  tensors.push_back(
      {"token_ids",
       model::TensorDType::kI32,
       {t},
       absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(ids32.data()), ids32.size() * 4)});
  for (uint32_t i = 0; i < kv.size(); ++i) {
    for (const auto& [name, v] : {std::pair{"k", &kv[i].k}, std::pair{"v", &kv[i].v}}) {
      tensors.push_back(
          {absl::StrCat("layers.", i, ".", name),
           model::TensorDType::kF32,
           {t, c.num_kv_heads, c.head_dim},
           absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v->data()), v->size() * 4)});
    }
  }
  const std::string path = o.out_dir + "/kv.safetensors";
  STRATA_RETURN_IF_ERROR(model::WriteSafetensors(path, tensors));
  out << absl::StrFormat(
      "wrote %s: %d tokens, %d layers of K (after RoPE) and V, [%d, %d, %d] "
      "fp32 each\n",
      path, t, kv.size(), t, c.num_kv_heads, c.head_dim);
  return absl::OkStatus();
}

}  // namespace strata::tools
