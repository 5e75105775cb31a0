// model_bench: prefill and decode speed of the model engine on this machine, with the KV cache
// at fp16 and compressed by codecs, at a given context (default 2048 tokens), and the share of
// the prefill spent compressing the cache. The model is the bundled one (--model), or with
// --random_model a randomly initialised one of a given attention shape, where the cache rather
// than the weights dominates what a decode step reads (an 8B's is 32:32:8:128: 32 layers, 32
// query heads over 8 KV heads of 128). With --batch N, decode steps run N sequences together
// (continuous batching), each with a cache of its own: the weights are read once per step and
// the caches N times, as on a serving decode node.
// Prints a table and writes JSON to --out (default bench/results). Flags: kUsage below (--help).
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/aligned_buffer.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "model/llama.h"
#include "model/safetensors.h"

namespace strata::bench {
namespace {

constexpr char kUsage[] =
    "usage: model_bench [--model DIR | --random_model LAYERS:QHEADS:KVHEADS:HEADDIM[:HIDDEN]]\n"
    "                   [--context N] [--decode N] [--batch N] [--codecs a,b]\n"
    "                   [--commit SHA] [--out DIR (default bench/results)]\n"
    "  --random_model: a Llama of that attention shape with random weights (hidden 256 unless\n"
    "  given, MLP twice the hidden size, vocabulary 4096), written to a temporary folder;\n"
    "  32:32:8:128 is an 8B's attention (its hidden size and MLP would be 4096 and 14336: the\n"
    "  small ones here leave the KV cache most of what a decode step reads)\n"
    "  --batch: sequences per decode step (default 1), each a copy of the one prefilled, in\n"
    "  memory of its own; decode tok/s is then the tokens of all of them\n";

// Writes a random Llama checkpoint of the given attention shape into `dir`: weights normal with
// standard deviation 1/sqrt(fan-in), so activations keep their scale through the layers.
absl::Status WriteRandomModel(const std::string& dir, uint32_t layers, uint32_t q_heads,
                              uint32_t kv_heads, uint32_t head_dim, int64_t hidden,
                              uint32_t context) {
  const int64_t kHidden = hidden, kFf = 2 * hidden;
  constexpr int64_t kVocab = 4096;
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/config.json");
    f << "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
      << "\"hidden_size\": " << kHidden << ", \"intermediate_size\": " << kFf
      << ", \"num_hidden_layers\": " << layers << ", \"num_attention_heads\": " << q_heads
      << ", \"num_key_value_heads\": " << kv_heads << ", \"head_dim\": " << head_dim
      << ", \"vocab_size\": " << kVocab << ", \"max_position_embeddings\": " << context + 4096
      << ", \"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, \"hidden_act\": \"silu\", "
      << "\"tie_word_embeddings\": true, \"bos_token_id\": 0, \"eos_token_id\": 1}\n";
    if (!f) return absl::InternalError("cannot write " + dir + "/config.json");
  }
  std::mt19937 rng(7);
  std::vector<std::vector<Half>> data;
  std::vector<model::TensorToWrite> tensors;
  data.reserve(2 + 9 * size_t{layers});
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float stddev) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<float> x(n, 1.0f);
    if (stddev > 0) {
      std::normal_distribution<float> normal(0, stddev);
      for (float& v : x) v = normal(rng);
    }
    data.emplace_back(n);
    FloatToHalf(x.data(), data.back().data(), n);
    tensors.push_back({name, model::TensorDType::kF16, std::move(shape),
                       absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(data.back().data()),
                                           n * sizeof(Half))});
  };
  const int64_t qd = int64_t{q_heads} * head_dim, kvd = int64_t{kv_heads} * head_dim;
  const float in_h = 1.0f / std::sqrt(static_cast<float>(kHidden));
  add("model.embed_tokens.weight", {kVocab, kHidden}, 1.0f);
  add("model.norm.weight", {kHidden}, 0);
  for (uint32_t i = 0; i < layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {kHidden}, 0);
    add(p + "post_attention_layernorm.weight", {kHidden}, 0);
    add(p + "self_attn.q_proj.weight", {qd, kHidden}, in_h);
    add(p + "self_attn.k_proj.weight", {kvd, kHidden}, in_h);
    add(p + "self_attn.v_proj.weight", {kvd, kHidden}, in_h);
    add(p + "self_attn.o_proj.weight", {kHidden, qd}, 1.0f / std::sqrt(static_cast<float>(qd)));
    add(p + "mlp.gate_proj.weight", {kFf, kHidden}, in_h);
    add(p + "mlp.up_proj.weight", {kFf, kHidden}, in_h);
    add(p + "mlp.down_proj.weight", {kHidden, kFf}, 1.0f / std::sqrt(static_cast<float>(kFf)));
  }
  return model::WriteSafetensors(dir + "/model.safetensors", tensors);
}

// A copy of `src`, blocks and window, in memory of its own: a batch of copies reads as many bytes
// per decode step as that many distinct sequences do (blocks shared between sequences, a cached
// prefix, are read once for all of them).
absl::StatusOr<std::unique_ptr<model::SequenceKvCache>> CopyCache(
    const model::LlamaModel& m, const model::SequenceKvCache& src) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::SequenceKvCache> dst, m.NewCache(src.options()));
  for (size_t b = 0; b < src.blocks_per_layer(); ++b) {
    for (uint32_t l = 0; l < src.layers(); ++l) {
      const SharedBytes& block = src.layer_blocks(l)[b];
      AlignedBuffer copy = AlignedBuffer::Uninitialized(block.size());
      std::memcpy(copy.data(), block.data(), block.size());
      STRATA_RETURN_IF_ERROR(dst->AdoptBlock(l, std::move(copy)));
    }
    STRATA_RETURN_IF_ERROR(dst->CommitAdopted());
  }
  for (uint32_t l = 0; l < src.layers(); ++l) {
    const std::string window = src.ExportWindow(l);
    STRATA_RETURN_IF_ERROR(dst->ImportWindow(
        l, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(window.data()), window.size())));
  }
  STRATA_RETURN_IF_ERROR(dst->CommitWindow());
  return dst;
}

int Main(int argc, char** argv) {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  std::string model_dir = STRATA_DEFAULT_MODEL, commit = "unknown", out_dir = "bench/results",
              codecs =
                  "fp16,kivi:k4v4:g32,kivi:k2v2:g32,kcvt:k2v2,gear:k2v2:kcvt:r2:s1,"
                  "zipcache:k2v2:h4:s10";
  std::string random_model, shape_name;  // shape_name: random_model with '-' for ':'

  uint32_t context = 2048, decode = 32, batch = 1;
  int exit_code = 0;
  const auto flags = FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  for (const auto& [f, v] : *flags) {
    if (f == "--model")
      model_dir = v;
    else if (f == "--commit")
      commit = v;
    else if (f == "--out")
      out_dir = v;
    else if (f == "--codecs")
      codecs = v;
    else if (f == "--random_model")
      random_model = v;
    else if (f == "--context" && absl::SimpleAtoi(v, &context))
      continue;
    else if (f == "--decode" && absl::SimpleAtoi(v, &decode))
      continue;
    else if (f == "--batch" && absl::SimpleAtoi(v, &batch) && batch >= 1 && batch <= 1024)
      continue;
    else {
      std::fprintf(stderr, "bad flag %s %s\n%s", f.c_str(), v.c_str(), kUsage);
      return 2;
    }
  }
  if (!random_model.empty()) {
    std::vector<uint32_t> shape;
    for (absl::string_view part : absl::StrSplit(random_model, ':')) {
      uint32_t x = 0;
      if (!absl::SimpleAtoi(part, &x) || x == 0) break;
      shape.push_back(x);
    }
    if (shape.size() == 4) shape.push_back(256);
    if (shape.size() != 5) {
      std::fprintf(stderr, "--random_model %s: want LAYERS:QHEADS:KVHEADS:HEADDIM[:HIDDEN]\n%s",
                   random_model.c_str(), kUsage);
      return 2;
    }
    model_dir = (std::filesystem::temp_directory_path() /
                 absl::StrCat("strata-model-bench-", random_model, "-", getpid()))
                    .string();
    for (char& ch : model_dir) ch = ch == ':' ? '-' : ch;
    shape_name = random_model;
    for (char& ch : shape_name) ch = ch == ':' ? '-' : ch;
    const absl::Status st =
        WriteRandomModel(model_dir, shape[0], shape[1], shape[2], shape[3], shape[4], context);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
      return 1;
    }
  }
  absl::StatusOr<std::unique_ptr<model::LlamaModel>> m = model::LlamaModel::Load(model_dir);
  if (!random_model.empty()) std::filesystem::remove_all(model_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", std::string(m.status().message()).c_str());
    return 1;
  }
  const model::ModelConfig& c = (*m)->config();
  const RunInfo info = CollectRunInfo(commit);
  std::printf(
      "model_bench  %s  %s  commit %s\nmodel %s: %u layers, hidden %u, %u/%u heads, head "
      "dim %u; context %u, %u decode steps of %u sequence%s, KV chunks of 256\n",
      info.machine.c_str(), info.date.c_str(), commit.c_str(),
      random_model.empty() ? model_dir.c_str() : absl::StrCat("random ", random_model).c_str(),
      c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, context, decode, batch,
      batch == 1 ? ""
                 : "s (copies of one prefill, each cache in memory of its own; decode tok/s "
                   "counts all of them; KV bytes are one sequence's)");
  std::vector<uint32_t> ids(context);
  for (uint32_t i = 0; i < context; ++i) ids[i] = (i * 2654435761u) % c.vocab_size;
  std::printf("%-24s %14s %12s %10s %14s %9s %12s\n", "KV codec", "prefill tok/s", "compress ms",
              "of prefill", "decode tok/s", "vs fp16", "KV bytes");
  double fp16_decode = 0;
  std::vector<std::string> rows;
  for (absl::string_view spec : absl::StrSplit(codecs, ',')) {
    auto cache = (*m)->NewCache({.codec = std::string(spec), .chunk_tokens = 256});
    if (!cache.ok()) {
      std::fprintf(stderr, "%s\n", std::string(cache.status().message()).c_str());
      return 1;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (!(*m)->Step(ids, cache->get()).ok()) return 1;
    const double prefill =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double compress = (*cache)->encode_seconds();  // the prefill's chunks
    std::vector<std::unique_ptr<model::SequenceKvCache>> copies;
    std::vector<model::SequenceKvCache*> caches = {cache->get()};
    for (uint32_t b = 1; b < batch; ++b) {
      auto copy = CopyCache(**m, **cache);
      if (!copy.ok()) {
        std::fprintf(stderr, "%s\n", std::string(copy.status().message()).c_str());
        return 1;
      }
      copies.push_back(std::move(*copy));
      caches.push_back(copies.back().get());
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < decode; ++i) {
      const uint32_t next = (i * 7919u) % c.vocab_size;
      const std::vector<absl::Span<const uint32_t>> tokens(batch, {&next, 1});
      const absl::Status st = batch == 1 ? (*m)->Step({&next, 1}, cache->get()).status()
                                         : (*m)->StepBatch(tokens, caches).status();
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
        return 1;
      }
    }
    const double dec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    const double tps = static_cast<double>(decode) * batch / dec;
    if (spec == "fp16") fp16_decode = tps;
    std::printf("%-24s %14.1f %12.1f %9.1f%% %14.2f %8.2fx %12zu\n", std::string(spec).c_str(),
                context / prefill, compress * 1e3, 100 * compress / prefill, tps,
                fp16_decode > 0 ? tps / fp16_decode : 0.0, (*cache)->block_bytes());
    std::fflush(stdout);
    rows.push_back(Json()
                       .Str("codec", std::string(spec))
                       .Num("prefill_tokens_per_s", context / prefill)
                       .Num("compress_seconds_in_prefill", compress)
                       .Num("compress_fraction_of_prefill", compress / prefill)
                       .Num("decode_tokens_per_s", tps)
                       .Num("decode_vs_fp16", fp16_decode > 0 ? tps / fp16_decode : 0.0)
                       .Num("kv_block_bytes", (*cache)->block_bytes())
                       .Done());
  }
  const std::string json =
      ResultJson("model_bench", info)
          .Str("model", random_model.empty() ? model_dir : "random " + random_model)
          .Num("context", context)
          .Num("batch", batch)
          .Raw("rows", JsonArray(rows))
          .Done();
  const std::string path =
      ResultPath(
          out_dir,
          absl::StrCat(random_model.empty() ? "model_bench" : "model_bench-random-" + shape_name,
                       batch == 1 ? "" : absl::StrCat("-batch", batch)),
          info) +
      ".json";
  if (!WriteResultFile(path, json + "\n")) return 1;
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
