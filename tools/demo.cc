#include "tools/demo.h"

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_reader.h"
#include "common/block_writer.h"
#include "common/half.h"
#include "common/prefix_key.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "tools/file_util.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

constexpr char kSystemPrompt[] =
    "You are Strata's demo assistant. Strata computes a prompt's KV cache once, compresses it "
    "into self-describing blocks, and serves those blocks to every later request that shares "
    "the prefix, from GPU memory, host RAM, local NVMe or a peer node. Answer briefly and "
    "accurately, cite the component that does the work, and say so when you do not know. ";
constexpr char kQuestionA[] =
    "Question: how does a decode node find the blocks for a prompt it has never seen, and what "
    "does it do when a block on disk fails its checksum?";
constexpr char kQuestionB[] =
    "Question: what does the router look at when it picks a decode node for a request whose "
    "system prompt many other requests already used?";

// Stand-in KV for one chunk and layer: a deterministic function of the chunk's prefix key, so
// equal prefixes give equal blocks, as a real model's would. [tokens, kv_heads, head_dim] fp16.
std::vector<Half> StandInKv(const BlockHash& key, uint32_t layer, uint32_t tensor, size_t n) {
  std::seed_seq seq{static_cast<uint32_t>(EventHash64(key)),
                    static_cast<uint32_t>(EventHash64(key) >> 32), layer, tensor};
  std::mt19937 rng(seq);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Half> v(n);
  for (Half& h : v) h = Half::FromFloat(normal(rng));
  return v;
}

absl::StatusOr<AlignedBuffer> MakeBlock(const DemoOptions& o, uint64_t model_fp,
                                        const BlockHash& key, uint32_t chunk, uint32_t layer) {
  const uint32_t n = o.chunk_tokens * o.kv_heads * o.head_dim;
  BlockHeader h;
  h.codec = CodecId::kFp16;
  h.codec_spec = "fp16";
  h.source_dtype = SourceDType::kFloat16;
  h.layer = layer;
  h.chunk_index = chunk;
  h.token_count = o.chunk_tokens;
  h.kv_heads = o.kv_heads;
  h.head_dim = o.head_dim;
  h.model_fingerprint = model_fp;
  const SectionDesc sections[] = {
      {SectionKind::kCodes, Tensor::kKey, ElemType::kFloat16, n, 64},
      {SectionKind::kCodes, Tensor::kValue, ElemType::kFloat16, n, 64},
  };
  STRATA_ASSIGN_OR_RETURN(BlockBuilder b, BlockBuilder::Create(h, sections));
  for (uint32_t t = 0; t < 2; ++t) {
    const std::vector<Half> kv = StandInKv(key, layer, t, n);
    std::memcpy(b.section(static_cast<int>(t)).data(), kv.data(), kv.size() * sizeof(Half));
  }
  return std::move(b).Finish();
}

std::vector<uint32_t> ByteTokens(absl::string_view text) {
  return std::vector<uint32_t>(reinterpret_cast<const uint8_t*>(text.data()),
                               reinterpret_cast<const uint8_t*>(text.data()) + text.size());
}

std::string BlockPath(const DemoOptions& o, const BlockName& name) {
  const std::string enc = name.Encode();
  return absl::StrCat(o.out_dir, "/",
                      ToHex(reinterpret_cast<const uint8_t*>(enc.data()), enc.size()), ".blk");
}

struct RequestStats {
  size_t tokens = 0, chunks = 0, hit_chunks = 0, blocks_written = 0, bytes_written = 0;
};

absl::StatusOr<RequestStats> ServeRequest(const DemoOptions& o, const PrefixHasher& hasher,
                                          uint64_t model_fp, uint64_t codec_fp,
                                          absl::string_view prompt, std::ostream& out) {
  const std::vector<uint32_t> tokens = ByteTokens(prompt);
  const std::vector<BlockHash> keys = hasher.ChunkKeys(tokens);
  RequestStats st;
  st.tokens = tokens.size();
  st.chunks = keys.size();
  bool prefix_intact = true;
  for (uint32_t c = 0; c < keys.size(); ++c) {
    bool all_layers_present = true;
    for (uint32_t l = 0; l < o.layers; ++l) {
      BlockName name{model_fp, codec_fp, 0, keys[c], l};
      const std::string path = BlockPath(o, name);
      if (fs::exists(path)) continue;
      all_layers_present = false;
      STRATA_ASSIGN_OR_RETURN(AlignedBuffer block, MakeBlock(o, model_fp, keys[c], c, l));
      STRATA_RETURN_IF_ERROR(WriteFileAtomic(path, block.span()));
      ++st.blocks_written;
      st.bytes_written += block.size();
    }
    // Only a leading run of present chunks is a usable prefix hit.
    prefix_intact = prefix_intact && all_layers_present;
    if (prefix_intact) ++st.hit_chunks;
    out << absl::StrFormat("  chunk %2d  key %s…  %s\n", c, ToHex(keys[c]).substr(0, 16),
                           prefix_intact ? "hit (reused from disk)" : "computed and stored");
  }
  // Read every block of the request back and verify it.
  for (uint32_t c = 0; c < keys.size(); ++c) {
    for (uint32_t l = 0; l < o.layers; ++l) {
      const BlockName name{model_fp, codec_fp, 0, keys[c], l};
      STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf,
                              ReadFileAligned(BlockPath(o, name), kMaxBlockBytes));
      STRATA_ASSIGN_OR_RETURN(BlockView v, BlockView::Parse(buf.span()));
      if (v.header().layer != l || v.header().chunk_index != c ||
          v.header().model_fingerprint != model_fp) {
        return absl::DataLossError(absl::StrCat("demo: block ", name.ToString(), " holds layer ",
                                                v.header().layer, " chunk ",
                                                v.header().chunk_index));
      }
    }
  }
  return st;
}

}  // namespace

absl::Status DemoOptions::Validate() const {
  if (out_dir.empty()) return absl::InvalidArgumentError("demo: --out must not be empty");
  if (layers < 1 || layers > 256) {
    return absl::InvalidArgumentError(absl::StrCat("demo: layers ", layers, " outside [1, 256]"));
  }
  if (kv_heads < 1 || kv_heads > 64 || head_dim < 1 || head_dim > 512) {
    return absl::InvalidArgumentError(absl::StrCat("demo: kv_heads ", kv_heads, " / head_dim ",
                                                   head_dim, " outside [1, 64] / [1, 512]"));
  }
  if (chunk_tokens < 1 || chunk_tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("demo: chunk_tokens ", chunk_tokens, " outside [1, 4096]"));
  }
  return absl::OkStatus();
}

absl::Status RunDemo(const DemoOptions& o, std::ostream& out) {
  STRATA_RETURN_IF_ERROR(o.Validate());
  PrefixKeyOptions ko;
  STRATA_ASSIGN_OR_RETURN(ko.algorithm, ParsePrefixHashAlgorithm(o.prefix_hash));
  ko.block_tokens = o.hash_block_tokens;
  ko.chunk_tokens = o.chunk_tokens;
  STRATA_ASSIGN_OR_RETURN(PrefixHasher hasher, PrefixHasher::Create(ko));

  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec)
    return absl::InternalError(absl::StrCat("demo: cannot create ", o.out_dir, ": ", ec.message()));
  for (const auto& entry : fs::directory_iterator(o.out_dir, ec)) {
    if (entry.path().extension() == ".blk") fs::remove(entry.path(), ec);
  }

  const uint64_t model_fp = Fingerprint64(absl::StrFormat(
      "stand-in:layers=%d:kv_heads=%d:head_dim=%d", o.layers, o.kv_heads, o.head_dim));
  const uint64_t codec_fp = Fingerprint64("fp16");
  out << absl::StrFormat(
      "Strata demo: %d layers x %d KV heads x head dim %d, %d-token chunks, prefix keys %s "
      "(B=%d), blocks in %s\n",
      o.layers, o.kv_heads, o.head_dim, o.chunk_tokens, o.prefix_hash, o.hash_block_tokens,
      o.out_dir);

  const std::pair<const char*, const char*> requests[] = {{"A", kQuestionA}, {"B", kQuestionB}};
  std::vector<std::pair<std::string, RequestStats>> rows;
  for (const auto& [label, question] : requests) {
    out << absl::StrFormat("\nrequest %s:\n", label);
    STRATA_ASSIGN_OR_RETURN(
        RequestStats st,
        ServeRequest(o, hasher, model_fp, codec_fp, absl::StrCat(kSystemPrompt, question), out));
    rows.emplace_back(label, st);
  }
  out << "\n  request  tokens  chunks  prefix-hit  blocks-written  bytes-written\n";
  for (const auto& [label, st] : rows) {
    out << absl::StrFormat("  %-7s  %6d  %6d  %10d  %14d  %13d\n", label, st.tokens, st.chunks,
                           st.hit_chunks, st.blocks_written, st.bytes_written);
  }

  // Plant a corruption in one stored block and show that the reader refuses it.
  const std::vector<BlockHash> keys =
      hasher.ChunkKeys(ByteTokens(absl::StrCat(kSystemPrompt, kQuestionA)));
  const BlockName victim{model_fp, codec_fp, 0, keys.at(0), 0};
  const std::string path = BlockPath(o, victim);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, ReadFileAligned(path, kMaxBlockBytes));
  buf.data()[buf.size() / 2] ^= 0x10;
  STRATA_RETURN_IF_ERROR(WriteFileAtomic(path, buf.span()));
  absl::StatusOr<BlockView> bad = BlockView::Parse(buf.span());
  if (bad.ok()) return absl::InternalError("demo: a corrupted block was not detected");
  out << absl::StrFormat("\nflipped one bit in %s\n  reader: %s\n", path, bad.status().ToString());
  const BlockName good{model_fp, codec_fp, 0, keys.at(1), 0};
  out << absl::StrFormat("\nInspect a block:       %s inspect %s\n", o.program, BlockPath(o, good));
  out << absl::StrFormat("and the corrupted one: %s inspect %s\n", o.program, path);
  return absl::OkStatus();
}

}  // namespace strata::tools
