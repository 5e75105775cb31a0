// `strata generate`, `strata ppl`, `strata dump-kv`: the model engine from the command line,
// with the KV cache compressed by any codec as it would be in serving.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace strata::tools {

struct ModelCommandOptions {
  std::string model_dir;        // Hugging Face layout: config.json, *.safetensors, tokenizer.json
  std::string codec = "fp16";   // KV cache codec spec
  uint32_t chunk_tokens = 256;  // tokens per compressed block
};

struct GenerateOptions : ModelCommandOptions {
  std::string prompt;
  uint32_t max_tokens = 64;
  float temperature = 0;  // 0: greedy
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

absl::Status RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& info);
absl::Status RunPpl(const PplOptions& o, std::ostream& out);
absl::Status RunDumpKv(const DumpKvOptions& o, std::ostream& out);

}  // namespace strata::tools
