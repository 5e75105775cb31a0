// The `strata` command line: one binary, one subcommand per task.
//
//   strata inspect FILE            print a block's header and sections
//   strata demo [--out DIR] ...    the end-to-end demo on this machine
//
// Flags are parsed here and only here; each subcommand gets an Options struct.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "tools/demo.h"
#include "tools/inspect.h"

ABSL_FLAG(std::string, out, "/tmp/strata-demo", "demo: directory for block files");
ABSL_FLAG(uint32_t, layers, 4, "demo: layers of the stand-in model");
ABSL_FLAG(uint32_t, kv_heads, 2, "demo: KV heads");
ABSL_FLAG(uint32_t, head_dim, 64, "demo: head dimension");
ABSL_FLAG(uint32_t, chunk_tokens, 64, "demo: tokens per chunk (one block per chunk and layer)");
ABSL_FLAG(uint32_t, hash_block_tokens, 16, "demo: tokens per prefix-hash block (vLLM's B)");
ABSL_FLAG(std::string, prefix_hash, "sha256_cbor", "demo: sha256_cbor (default) or sha256");
ABSL_FLAG(std::string, codec, "gear:k2v2:kcvt:r2:s1", "demo: codec spec for the blocks");
ABSL_FLAG(uint32_t, q_heads, 8, "demo: query heads (a multiple of --kv_heads)");

namespace {

constexpr char kUsage[] =
    "strata COMMAND [ARGS] [FLAGS]\n"
    "commands:\n"
    "  inspect FILE   print a block's header and sections\n"
    "  demo           compute, store, reuse and verify prefix-keyed blocks (see --helpfull)\n";

int Fail(const absl::Status& s) {
  std::cerr << "strata: " << s << "\n";
  return 1;
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
  if (command == "inspect") {
    if (args.size() != 3) {
      std::cerr << "usage: strata inspect FILE\n";
      return 2;
    }
    const absl::Status s = strata::tools::InspectBlockFile(args[2], std::cout);
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "demo") {
    strata::tools::DemoOptions o;
    o.out_dir = absl::GetFlag(FLAGS_out);
    o.layers = absl::GetFlag(FLAGS_layers);
    o.kv_heads = absl::GetFlag(FLAGS_kv_heads);
    o.head_dim = absl::GetFlag(FLAGS_head_dim);
    o.chunk_tokens = absl::GetFlag(FLAGS_chunk_tokens);
    o.hash_block_tokens = absl::GetFlag(FLAGS_hash_block_tokens);
    o.prefix_hash = absl::GetFlag(FLAGS_prefix_hash);
    o.program = argv[0];
    o.codec = absl::GetFlag(FLAGS_codec);
    o.q_heads = absl::GetFlag(FLAGS_q_heads);
    const absl::Status s = strata::tools::RunDemo(o, std::cout);
    return s.ok() ? 0 : Fail(s);
  }
  std::cerr << "strata: unknown command '" << command << "'\n" << kUsage;
  return 2;
}
