// model_bench: prefill and decode speed of the model engine on this machine, with the KV cache
// at fp16 and compressed by codecs, at a given context (default 2048 tokens).
// Prints a table and writes JSON to --out (default bench/results). Flags: kUsage below (--help).
#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "model/llama.h"

namespace strata::bench {
namespace {

constexpr char kUsage[] =
    "usage: model_bench [--model DIR] [--context N] [--decode N] [--codecs a,b]\n"
    "                   [--commit SHA] [--out DIR (default bench/results)]\n";

int Main(int argc, char** argv) {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  std::string model_dir = STRATA_DEFAULT_MODEL, commit = "unknown", out_dir = "bench/results",
              codecs = "fp16,kivi:k2v2:g32,gear:k2v2:kcvt:r2:s1";
  uint32_t context = 2048, decode = 32;
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
    else if (f == "--context" && absl::SimpleAtoi(v, &context))
      continue;
    else if (f == "--decode" && absl::SimpleAtoi(v, &decode))
      continue;
    else {
      std::fprintf(stderr, "bad flag %s %s\n%s", f.c_str(), v.c_str(), kUsage);
      return 2;
    }
  }
  absl::StatusOr<std::unique_ptr<model::LlamaModel>> m = model::LlamaModel::Load(model_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", std::string(m.status().message()).c_str());
    return 1;
  }
  const model::ModelConfig& c = (*m)->config();
  const RunInfo info = CollectRunInfo(commit);
  std::printf(
      "model_bench  %s  %s  commit %s\nmodel %s: %u layers, hidden %u, %u/%u heads, head "
      "dim %u; context %u, %u decode steps, KV chunks of 256\n",
      info.machine.c_str(), info.date.c_str(), commit.c_str(), model_dir.c_str(), c.num_layers,
      c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, context, decode);
  std::vector<uint32_t> ids(context);
  for (uint32_t i = 0; i < context; ++i) ids[i] = (i * 2654435761u) % c.vocab_size;
  std::printf("%-24s %14s %14s %12s\n", "KV codec", "prefill tok/s", "decode tok/s", "KV bytes");
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
    const auto t1 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < decode; ++i) {
      const uint32_t next = (i * 7919u) % c.vocab_size;
      if (!(*m)->Step({&next, 1}, cache->get()).ok()) return 1;
    }
    const double dec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::printf("%-24s %14.1f %14.2f %12zu\n", std::string(spec).c_str(), context / prefill,
                decode / dec, (*cache)->block_bytes());
    rows.push_back(Json()
                       .Str("codec", std::string(spec))
                       .Num("prefill_tokens_per_s", context / prefill)
                       .Num("decode_tokens_per_s", decode / dec)
                       .Num("kv_block_bytes", (*cache)->block_bytes())
                       .Done());
  }
  const std::string json = ResultJson("model_bench", info)
                               .Str("model", model_dir)
                               .Num("context", context)
                               .Raw("rows", JsonArray(rows))
                               .Done();
  const std::string path = ResultPath(out_dir, "model_bench", info) + ".json";
  if (!WriteResultFile(path, json + "\n")) return 1;
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
