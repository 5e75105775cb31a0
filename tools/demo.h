// `strata demo`: the end-to-end path that exists so far, on one machine with no GPU.
//
// Two requests that share a system prompt are tokenized (bytes as token ids, until the bundled
// model's tokenizer lands), keyed chunk by chunk with vLLM-compatible prefix keys, and their KV
// (synthetic KV with real models' structure standing in for the model, which a later issue
// adds) is compressed by a codec into blocks in the Strata block format, written as files named
// by BlockName. The second request finds the shared prefix already on disk and writes only its
// own chunks; every block is read back and verified; decode attention for the second request
// runs over the compressed blocks from disk and is compared with fp16 attention over the same
// KV; then one file is corrupted on purpose to show the reader refusing it.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace strata::tools {

struct DemoOptions {
  // Directory for block files; created if missing, emptied of earlier demo blocks.
  std::string out_dir = "/tmp/strata-demo";
  // Model shape of the stand-in KV.
  uint32_t layers = 4;
  uint32_t kv_heads = 2;
  uint32_t head_dim = 64;  // a multiple of 8 for quantized codecs
  // Tokens per chunk (one block per chunk and layer) and per prefix-hash block.
  uint32_t chunk_tokens = 64;
  uint32_t hash_block_tokens = 16;
  // "sha256_cbor" or "sha256".
  std::string prefix_hash = "sha256_cbor";
  // Codec spec for the blocks (kernels/codec_spec.h).
  std::string codec = "gear:k2v2:kcvt:r2:s1";
  // Query heads for the attention check (a multiple of kv_heads).
  uint32_t q_heads = 8;
  // How the report tells the user to run the CLI (main passes argv[0]).
  std::string program = "strata";

  absl::Status Validate() const;
};

// Runs the demo, printing a report to `out`. Fails with the first error it meets (a failure to
// detect the planted corruption is kInternal).
absl::Status RunDemo(const DemoOptions& options, std::ostream& out);

}  // namespace strata::tools
