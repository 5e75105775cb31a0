// `strata generate`, `strata ppl`, `strata dump-kv`: the model engine from the command line,
// with the KV cache compressed by any codec as it would be in serving.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/calibration.h"

namespace strata::tools {

struct ModelCommandOptions {
  std::string model_dir;        // Hugging Face layout: config.json, *.safetensors, tokenizer.json
  std::string codec = "fp16";   // KV cache codec spec
  uint32_t chunk_tokens = 256;  // tokens per compressed block
  uint32_t window_tokens = 0;   // newest tokens always kept at full precision
  // For codecs that need one (strata calibrate --out FILE; --calibration FILE).
  std::shared_ptr<const kernels::Calibration> calibration;
  // Where the model runs: "cpu", or "cuda[:N]" (a CUDA build). generate: the forward pass on the
  // GPU with a full-precision KV cache there (codec fp16 only), sampling on the host. ppl and
  // eval: the CUDA compute backend (model/cuda/cuda_backend.h) with the codec's blocks as device
  // pages, for the codecs that have a GPU page layout (eval reports the others as refused);
  // eval's per-layer errors and calibration searches stay on the CPU. calibrate, dump-kv: cpu.
  std::string device = "cpu";
};

struct GenerateOptions : ModelCommandOptions {
  std::string prompt;
  uint32_t max_tokens = 64;
  float temperature = 0;  // 0: greedy
  uint32_t top_k = 0;     // 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;  // model/sampler.h
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  uint64_t seed = 1;
};

struct PplOptions : ModelCommandOptions {
  std::string text_file;
  uint32_t context = 2048;   // tokens per evaluation window
  uint32_t max_windows = 0;  // 0: the whole text
};

struct DumpKvOptions : ModelCommandOptions {
  std::string text_file;
  std::string out_dir;
  uint32_t max_tokens = 2048;
};

// `strata eval`: every codec on the same text — bits per element (all metadata), relative error
// of K, V and attention output per layer, perplexity and its change against fp16, agreement of
// greedy continuations with fp16, encode throughput — as a table and as JSON.
struct EvalOptions : ModelCommandOptions {
  std::string text_file;
  std::vector<std::string> codecs;
  uint32_t context = 1024;         // tokens per perplexity window (and the error window)
  uint32_t max_windows = 8;        // perplexity windows (0: the whole text)
  uint32_t continuations = 8;      // greedy continuations compared with fp16
  uint32_t prompt_tokens = 600;    // prompt of each continuation (longer than a chunk)
  uint32_t generate_tokens = 32;   // tokens generated per continuation
  uint32_t error_queries = 64;     // queries at the end of the error window
  std::string json_out;            // write the report here as JSON ("" = don't)
  std::string calib_text_file;     // calibration text for codecs that need it (disjoint!)
  bool cq_attention_weights = true;  // CQ's k-means weighs tokens by attention received
  bool cq_query_metric = false;      // CQ's keys under the queries' per-channel metric
  bool cq_output_metric = false;     // CQ's values under the output projection's metric
};

// `strata calibrate`: learns what a codec needs from the model's KV on calibration text and
// writes the calibration file (SKVQ: channel orders by range, clip ratios by attention error).
struct CalibrateOptions : ModelCommandOptions {
  std::string text_file;
  std::string out_file;
  uint32_t context = 1024;      // tokens per forward window
  uint32_t windows = 2;         // windows of calibration text
  uint32_t error_queries = 64;  // queries whose attention output the clip search minimizes
  std::string source;           // recorded in the file ("" = the text file's name)
  bool cq_attention_weights = true;  // CQ's k-means weighs tokens by attention received
  bool cq_query_metric = false;      // CQ's keys under the queries' per-channel metric
  bool cq_output_metric = false;     // CQ's values under the output projection's metric
};

// `strata kv-structure`: what makes a model's KV hard to compress, per layer (MeasureKvStructure
// in model/kv_evaluation.h): K's and V's largest channel over the median one, before and after
// the rotation stage, and the attention mass on the first token; as a table and as JSON.
struct KvStructureOptions : ModelCommandOptions {
  std::string text_file;
  uint32_t context = 2048;  // tokens of the text run
  std::string json_out;     // "" = don't
};

absl::Status RunCalibrate(const CalibrateOptions& o, std::ostream& out);
absl::Status RunKvStructure(const KvStructureOptions& o, std::ostream& out);

absl::Status RunEval(const EvalOptions& o, std::ostream& out);

absl::Status RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& info);
absl::Status RunPpl(const PplOptions& o, std::ostream& out);
absl::Status RunDumpKv(const DumpKvOptions& o, std::ostream& out);

}  // namespace strata::tools
