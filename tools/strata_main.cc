// The `strata` command line: one binary, one subcommand per task.
//
//   strata inspect FILE            print a block's header and sections
//   strata demo [--out DIR] ...    the end-to-end demo on this machine
//   strata generate --prompt TEXT [--model DIR] [--codec SPEC] [--max_tokens N] [--device cuda]
//   strata ppl --text FILE [--model DIR] [--codec SPEC] [--context N] [--device cuda]
//   strata dump-kv --text FILE --out DIR [--model DIR]
//   strata kv-structure FILE [--model DIR] [--context N] [--json FILE]
//
// Flags are parsed here and only here; each subcommand gets an Options struct.
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "tools/demo.h"
#include "tools/inspect.h"
#include "tools/model_commands.h"
#include "tools/replay_command.h"

constexpr char kDefaultOut[] = "/tmp/strata-demo";
ABSL_FLAG(std::string, out, kDefaultOut,
          "demo: directory for block files; dump-kv: output folder; calibrate: output file");
ABSL_FLAG(uint32_t, layers, 4, "demo: layers of the stand-in model");
ABSL_FLAG(uint32_t, kv_heads, 2, "demo: KV heads");
ABSL_FLAG(uint32_t, head_dim, 64, "demo: head dimension");
ABSL_FLAG(uint32_t, chunk_tokens, 64, "demo: tokens per chunk (one block per chunk and layer)");
ABSL_FLAG(uint32_t, hash_block_tokens, 16, "demo: tokens per prefix-hash block (vLLM's B)");
ABSL_FLAG(std::string, prefix_hash, "sha256_cbor", "demo: sha256_cbor (default) or sha256");
ABSL_FLAG(std::string, codec, "",
          "codec spec for KV blocks (demo default gear:k2v2:kcvt:r2:s1, "
          "model commands fp16)");
ABSL_FLAG(uint32_t, q_heads, 8, "demo: query heads (a multiple of --kv_heads)");
ABSL_FLAG(std::string, model, STRATA_DEFAULT_MODEL,
          "generate/ppl/dump-kv: model folder (config.json, *.safetensors, tokenizer.json)");
ABSL_FLAG(std::string, prompt, "", "generate: the prompt");
ABSL_FLAG(uint32_t, max_tokens, 64, "generate: tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "generate: sampling temperature (0: greedy)");
ABSL_FLAG(uint64_t, seed, 1,
          "generate: sampling seed; replay: the seed of the router's ties, broken at random");
ABSL_FLAG(std::string, device, "cpu",
          "generate/ppl/eval: where the model runs: cpu, or cuda[:N] (a CUDA build; generate: KV "
          "at full precision on the device, codec fp16 only; ppl/eval: codecs with GPU pages)");
ABSL_FLAG(uint32_t, top_k, 0, "generate: sample from the k most likely tokens (0: all)");
ABSL_FLAG(float, top_p, 1.0f, "generate: nucleus sampling mass in (0, 1]");
ABSL_FLAG(float, min_p, 0.0f, "generate: keep tokens at least this fraction as likely as the top");
ABSL_FLAG(float, presence_penalty, 0.0f, "generate: OpenAI's presence penalty, in [-2, 2]");
ABSL_FLAG(float, frequency_penalty, 0.0f, "generate: OpenAI's frequency penalty, in [-2, 2]");
ABSL_FLAG(float, repetition_penalty, 1.0f,
          "generate: vLLM's repetition penalty over prompt and output (1: off)");
ABSL_FLAG(std::string, text, "", "ppl/dump-kv: text file");
ABSL_FLAG(uint32_t, context, 2048, "ppl: tokens per evaluation window; dump-kv: tokens to run");
ABSL_FLAG(uint32_t, windows, 0, "ppl: evaluate at most this many windows (0: the whole text)");
ABSL_FLAG(uint32_t, kv_chunk_tokens, 256, "generate/ppl/eval: tokens per compressed KV block");
ABSL_FLAG(uint32_t, kv_window, 0,
          "generate/ppl/eval: newest tokens always kept at full precision in the KV cache");
ABSL_FLAG(std::vector<std::string>, codecs, {}, "eval: comma-separated codec specs");
ABSL_FLAG(std::string, trace, "", "replay: Mooncake trace (JSON lines)");
ABSL_FLAG(std::vector<std::string>, ram_sizes,
          std::vector<std::string>({"8G", "16G", "32G", "64G", "128G", "256G", "512G", "1T"}),
          "replay: RAM tier sizes to sweep");
ABSL_FLAG(std::string, disk_size, "4T", "replay: disk tier of the runs with a disk (0: none)");
ABSL_FLAG(bool, durable_puts, true,
          "replay: as strata-store's --durable_puts (its default with a disk): every chunk is "
          "written to disk as it arrives; false: only when RAM evicts it");
ABSL_FLAG(uint32_t, model_layers, 32, "replay: layers of the model whose KV is stored");
ABSL_FLAG(uint32_t, model_kv_heads, 8, "replay: KV heads");
ABSL_FLAG(uint32_t, model_head_dim, 128, "replay: head dimension");
ABSL_FLAG(uint32_t, trace_block_tokens, 512,
          "replay: tokens per hash id of the trace (Mooncake's: 512; a trace scaled down to a "
          "small model's context has fewer)");
ABSL_FLAG(std::vector<std::string>, layouts, std::vector<std::string>({"central"}),
          "replay: where the stores are: central (one store for the cluster), per-host (a store "
          "per host), shared-tier (a store per host and a Redis Cluster behind them); a list "
          "compares them");
ABSL_FLAG(uint32_t, hosts, 4, "replay: hosts of the per-host and shared-tier layouts");
ABSL_FLAG(std::string, shared_size, "256G",
          "replay: the shared tier's memory (all Redis masters together)");
ABSL_FLAG(uint32_t, shared_masters, 3,
          "replay: the shared tier's Redis masters (--shared_size split evenly among them)");
ABSL_FLAG(std::string, shared_baseline, "3M",
          "replay: what each Redis master takes beside its keys (used_memory less "
          "used_memory_dataset: 3.0 MB per master of the live 3-master cluster with replicas: "
          "1.6 MB at startup in cluster mode, the 1 MB replication backlog, clients' buffers)");
ABSL_FLAG(uint32_t, shared_lru_samples, 5,
          "replay: Redis's maxmemory-samples (keys sampled per eviction; 0: an exact LRU)");
ABSL_FLAG(double, host_prefill_tokens_per_s, 0,
          "replay: each host's prefill rate, for the router's load term (0: route by overlap "
          "alone)");
ABSL_FLAG(bool, decode_puts, true,
          "replay: decode nodes store the chunks they complete (and the prompt's, where their "
          "host's store lacks it), as DecodeEngine does with --put_to_store");
ABSL_FLAG(bool, in_flight, false,
          "replay: with --host_prefill_tokens_per_s, a request's chunks are stored once its host "
          "has prefilled it (a request arriving meanwhile misses them), not on arrival");
ABSL_FLAG(std::vector<std::string>, policies, {},
          "replay: RAM eviction policies to compare (default lru,s3fifo)");
ABSL_FLAG(std::string, calibration, "",
          "generate/ppl: calibration file for codecs that need one (strata calibrate)");
ABSL_FLAG(std::string, calib_text, "",
          "eval: calibration text (disjoint from the evaluated text) for codecs that need it");
ABSL_FLAG(std::string, json, "", "eval: also write the report as JSON to this file");
ABSL_FLAG(std::string, cq_weights, "attention",
          "calibrate/eval: how CQ's k-means weighs each calibration token: attention (by the "
          "attention it receives, CQ's Fisher-guided centroids estimated) or uniform");
ABSL_FLAG(std::string, cq_key_metric, "plain",
          "calibrate/eval: the distance CQ's key codebooks are learned and keys encoded by: plain, "
          "or query (each channel weighted by its RMS over the calibration's queries: a key's "
          "error counted by how much it moves q.k)");
ABSL_FLAG(std::string, cq_value_metric, "plain",
          "calibrate/eval: the distance CQ's value codebooks are learned and values encoded by: "
          "plain, or output (each channel weighted by the norm of the output projection's columns "
          "that read it: a value's error counted by how much it moves the layer's output)");
ABSL_FLAG(uint32_t, continuations, 8, "eval: greedy continuations compared with fp16");
ABSL_FLAG(uint32_t, prompt_tokens, 600, "eval: prompt tokens of each continuation");
ABSL_FLAG(uint32_t, generate_tokens, 32, "eval: tokens generated per continuation");

namespace {

constexpr char kUsage[] =
    "strata COMMAND [ARGS] [FLAGS]\n"
    "commands:\n"
    "  inspect FILE   print a block's header and sections\n"
    "  demo           compute, store, reuse and verify prefix-keyed blocks (see --helpfull)\n"
    "  generate TEXT  continue a prompt with the model (--model, --codec, --max_tokens)\n"
    "  ppl FILE       perplexity of a text with the KV cache compressed by --codec\n"
    "  eval FILE      quality report of --codecs on a text (errors, perplexity, greedy "
    "agreement)\n"
    "  dump-kv FILE   write each layer's K and V for a text to --out/kv.safetensors\n"
    "  kv-structure FILE  per layer: K's and V's outlier channels (before and after rotation) "
    "and the attention on the first token (--context, --json)\n"
    "  calibrate FILE calibration of --codec on a text, written to --out FILE\n"
    "  replay TRACE   offload-capacity sweep of a Mooncake trace (--codecs, --ram_sizes, ...)\n";

int Fail(const absl::Status& s) {
  std::cerr << "strata: " << s << "\n";
  return 1;
}

// The flags every model command takes (--model, --codec, --kv_chunk_tokens, --kv_window,
// --device, --calibration).
absl::Status ModelOptions(strata::tools::ModelCommandOptions& o) {
  o.model_dir = absl::GetFlag(FLAGS_model);
  if (!absl::GetFlag(FLAGS_codec).empty()) o.codec = absl::GetFlag(FLAGS_codec);
  o.chunk_tokens = absl::GetFlag(FLAGS_kv_chunk_tokens);
  o.window_tokens = absl::GetFlag(FLAGS_kv_window);
  o.device = absl::GetFlag(FLAGS_device);
  if (!absl::GetFlag(FLAGS_calibration).empty()) {
    absl::StatusOr<strata::kernels::Calibration> c =
        strata::kernels::Calibration::Load(absl::GetFlag(FLAGS_calibration));
    if (!c.ok()) return c.status();
    o.calibration = std::make_shared<strata::kernels::Calibration>(*std::move(c));
  }
  return absl::OkStatus();
}

int InspectCommand(const std::vector<char*>& args) {
  if (args.size() != 3) {
    std::cerr << "usage: strata inspect FILE\n";
    return 2;
  }
  const absl::Status s = strata::tools::InspectBlockFile(args[2], std::cout);
  return s.ok() ? 0 : Fail(s);
}

int DemoCommand(const std::vector<char*>& args) {
  strata::tools::DemoOptions o;
  o.out_dir = absl::GetFlag(FLAGS_out);
  o.layers = absl::GetFlag(FLAGS_layers);
  o.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  o.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.chunk_tokens = absl::GetFlag(FLAGS_chunk_tokens);
  o.hash_block_tokens = absl::GetFlag(FLAGS_hash_block_tokens);
  o.prefix_hash = absl::GetFlag(FLAGS_prefix_hash);
  o.program = args[0];
  if (!absl::GetFlag(FLAGS_codec).empty()) o.codec = absl::GetFlag(FLAGS_codec);
  o.q_heads = absl::GetFlag(FLAGS_q_heads);
  const absl::Status s = strata::tools::RunDemo(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

// --cq_weights, --cq_key_metric and --cq_value_metric: how CQ's codebooks are learned.
absl::Status CqCalibrationFlags(bool* attention, bool* query_metric, bool* output_metric) {
  const std::string w = absl::GetFlag(FLAGS_cq_weights);
  if (w != "attention" && w != "uniform") {
    return absl::InvalidArgumentError(
        absl::StrCat("--cq_weights: '", w, "' is not attention or uniform"));
  }
  *attention = w == "attention";
  const std::string m = absl::GetFlag(FLAGS_cq_key_metric);
  if (m != "plain" && m != "query") {
    return absl::InvalidArgumentError(
        absl::StrCat("--cq_key_metric: '", m, "' is not plain or query"));
  }
  *query_metric = m == "query";
  const std::string v = absl::GetFlag(FLAGS_cq_value_metric);
  if (v != "plain" && v != "output") {
    return absl::InvalidArgumentError(
        absl::StrCat("--cq_value_metric: '", v, "' is not plain or output"));
  }
  *output_metric = v == "output";
  return absl::OkStatus();
}

int CalibrateCommand(const std::vector<char*>& args) {
  strata::tools::CalibrateOptions o;
  if (absl::Status s = ModelOptions(o); !s.ok()) return Fail(s);
  o.text_file = absl::GetFlag(FLAGS_text);
  if (args.size() > 2) o.text_file = args[2];
  o.out_file = absl::GetFlag(FLAGS_out);
  if (o.out_file == kDefaultOut) {
    std::cerr << "usage: strata calibrate --codec SPEC --out FILE [--model DIR] TEXT\n";
    return 2;
  }
  o.context = absl::GetFlag(FLAGS_context);
  if (absl::GetFlag(FLAGS_windows) != 0) o.windows = absl::GetFlag(FLAGS_windows);
  if (absl::Status s =
          CqCalibrationFlags(&o.cq_attention_weights, &o.cq_query_metric, &o.cq_output_metric);
      !s.ok()) {
    return Fail(s);
  }
  const absl::Status s = strata::tools::RunCalibrate(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

int GenerateCommand(const std::vector<char*>& args) {
  strata::tools::GenerateOptions o;
  if (absl::Status s = ModelOptions(o); !s.ok()) return Fail(s);
  o.prompt = absl::GetFlag(FLAGS_prompt);
  if (args.size() > 2) o.prompt = args[2];
  o.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  o.temperature = absl::GetFlag(FLAGS_temperature);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.top_k = absl::GetFlag(FLAGS_top_k);
  o.top_p = absl::GetFlag(FLAGS_top_p);
  o.min_p = absl::GetFlag(FLAGS_min_p);
  o.presence_penalty = absl::GetFlag(FLAGS_presence_penalty);
  o.frequency_penalty = absl::GetFlag(FLAGS_frequency_penalty);
  o.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  const absl::Status s = strata::tools::RunGenerate(o, std::cout, std::cerr);
  return s.ok() ? 0 : Fail(s);
}

int PplCommand(const std::vector<char*>& args) {
  strata::tools::PplOptions o;
  if (absl::Status s = ModelOptions(o); !s.ok()) return Fail(s);
  o.text_file = absl::GetFlag(FLAGS_text);
  if (args.size() > 2) o.text_file = args[2];
  o.context = absl::GetFlag(FLAGS_context);
  o.max_windows = absl::GetFlag(FLAGS_windows);
  const absl::Status s = strata::tools::RunPpl(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

int EvalCommand(const std::vector<char*>& args) {
  strata::tools::EvalOptions o;
  if (absl::Status s = ModelOptions(o); !s.ok()) return Fail(s);
  o.text_file = absl::GetFlag(FLAGS_text);
  if (args.size() > 2) o.text_file = args[2];
  o.codecs = absl::GetFlag(FLAGS_codecs);
  o.context = absl::GetFlag(FLAGS_context);
  o.max_windows = absl::GetFlag(FLAGS_windows) == 0 ? 8 : absl::GetFlag(FLAGS_windows);
  o.continuations = absl::GetFlag(FLAGS_continuations);
  o.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  o.generate_tokens = absl::GetFlag(FLAGS_generate_tokens);
  o.json_out = absl::GetFlag(FLAGS_json);
  o.calib_text_file = absl::GetFlag(FLAGS_calib_text);
  if (absl::Status s =
          CqCalibrationFlags(&o.cq_attention_weights, &o.cq_query_metric, &o.cq_output_metric);
      !s.ok()) {
    return Fail(s);
  }
  const absl::Status s = strata::tools::RunEval(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

int ReplayCommand(const std::vector<char*>& args) {
  strata::tools::ReplayOptions o;
  o.trace_file = absl::GetFlag(FLAGS_trace);
  if (args.size() > 2) o.trace_file = args[2];
  if (!absl::GetFlag(FLAGS_codecs).empty()) o.codecs = absl::GetFlag(FLAGS_codecs);
  o.layers = absl::GetFlag(FLAGS_model_layers);
  o.kv_heads = absl::GetFlag(FLAGS_model_kv_heads);
  o.head_dim = absl::GetFlag(FLAGS_model_head_dim);
  o.json_out = absl::GetFlag(FLAGS_json);
  o.block_tokens = absl::GetFlag(FLAGS_trace_block_tokens);
  if (o.block_tokens == 0) {
    std::cerr << "strata: --trace_block_tokens must be >= 1\n";
    return 2;
  }
  if (!absl::GetFlag(FLAGS_policies).empty()) o.policies = absl::GetFlag(FLAGS_policies);
  for (const std::string& r : absl::GetFlag(FLAGS_ram_sizes)) {
    uint64_t b = 0;
    if (!strata::ParseByteSize(r, &b)) {
      std::cerr << "strata: --ram_sizes: '" << r << "' is not a size like 64G\n";
      return 2;
    }
    o.ram_bytes.push_back(b);
  }
  o.durable_puts = absl::GetFlag(FLAGS_durable_puts);
  o.layouts = absl::GetFlag(FLAGS_layouts);
  o.hosts = absl::GetFlag(FLAGS_hosts);
  o.prefill_tokens_per_s = absl::GetFlag(FLAGS_host_prefill_tokens_per_s);
  o.in_flight = absl::GetFlag(FLAGS_in_flight);
  o.decode_puts = absl::GetFlag(FLAGS_decode_puts);
  o.seed = absl::GetFlag(FLAGS_seed);
  if (!strata::ParseByteSize(absl::GetFlag(FLAGS_shared_size), &o.shared_bytes)) {
    std::cerr << "strata: --shared_size: not a size like 256G\n";
    return 2;
  }
  if (!strata::ParseByteSize(absl::GetFlag(FLAGS_shared_baseline), &o.shared_baseline_bytes)) {
    std::cerr << "strata: --shared_baseline: not a size like 1600K\n";
    return 2;
  }
  o.shared_masters = absl::GetFlag(FLAGS_shared_masters);
  o.shared_lru_samples = absl::GetFlag(FLAGS_shared_lru_samples);
  if (o.shared_masters == 0) {
    std::cerr << "strata: --shared_masters must be at least 1\n";
    return 2;
  }
  if (!strata::ParseByteSize(absl::GetFlag(FLAGS_disk_size), &o.disk_bytes)) {
    std::cerr << "strata: --disk_size: not a size like 4T\n";
    return 2;
  }
  const absl::Status s = strata::tools::RunReplay(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

int KvStructureCommand(const std::vector<char*>& args) {
  strata::tools::KvStructureOptions o;
  if (absl::Status s = ModelOptions(o); !s.ok()) return Fail(s);
  o.text_file = absl::GetFlag(FLAGS_text);
  if (args.size() > 2) o.text_file = args[2];
  o.context = absl::GetFlag(FLAGS_context);
  o.json_out = absl::GetFlag(FLAGS_json);
  const absl::Status s = strata::tools::RunKvStructure(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

int DumpKvCommand(const std::vector<char*>& args) {
  strata::tools::DumpKvOptions o;
  if (absl::Status s = ModelOptions(o); !s.ok()) return Fail(s);
  o.text_file = absl::GetFlag(FLAGS_text);
  if (args.size() > 2) o.text_file = args[2];
  o.out_dir = absl::GetFlag(FLAGS_out);
  o.max_tokens = absl::GetFlag(FLAGS_context);
  const absl::Status s = strata::tools::RunDumpKv(o, std::cout);
  return s.ok() ? 0 : Fail(s);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string command = args[1];
  static const std::map<std::string, int (*)(const std::vector<char*>&)> kCommands = {
      {"inspect", InspectCommand},
      {"demo", DemoCommand},
      {"calibrate", CalibrateCommand},
      {"generate", GenerateCommand},
      {"ppl", PplCommand},
      {"eval", EvalCommand},
      {"replay", ReplayCommand},
      {"kv-structure", KvStructureCommand},
      {"dump-kv", DumpKvCommand}};
  if (auto it = kCommands.find(command); it != kCommands.end()) return it->second(args);
  std::cerr << "strata: unknown command '" << command << "'\n" << kUsage;
  return 2;
}
