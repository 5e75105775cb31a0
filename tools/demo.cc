#include "tools/demo.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
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
#include "kernels/codec.h"
#include "kernels/decode_attention.h"
#include "kernels/synthetic_kv.h"
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

// Stand-in KV for one chunk and layer: a deterministic function of the chunk's prefix key and
// position, so equal prefixes give equal blocks, as a real model's would.
kernels::SyntheticKv StandInKv(const DemoOptions& o, const BlockHash& key, uint32_t chunk,
                               uint32_t layer) {
  return kernels::MakeSyntheticKv(o.chunk_tokens, o.kv_heads, o.head_dim,
                                  EventHash64(key) ^ (uint64_t{layer} << 56),
                                  chunk * o.chunk_tokens);
}

absl::StatusOr<AlignedBuffer> MakeBlock(const DemoOptions& o, const kernels::Codec& codec,
                                        uint64_t model_fp, const BlockHash& key, uint32_t chunk,
                                        uint32_t layer) {
  const kernels::SyntheticKv kv = StandInKv(o, key, chunk, layer);
  return codec.Encode(
      {kv.k.data(), kv.v.data(), SourceDType::kFloat32, o.chunk_tokens, o.kv_heads, o.head_dim},
      {.layer = layer, .chunk_index = chunk, .model_fingerprint = model_fp});
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
                                          const kernels::Codec& codec, uint64_t model_fp,
                                          uint64_t codec_fp, absl::string_view prompt,
                                          std::ostream& out) {
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
      STRATA_ASSIGN_OR_RETURN(AlignedBuffer block, MakeBlock(o, codec, model_fp, keys[c], c, l));
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

// Decode attention for one new token of request B, layer 0: over its compressed blocks read
// back from disk, and over the same KV at fp16, to show what the codec costs in accuracy.
absl::Status AttendOverStoredBlocks(const DemoOptions& o, const PrefixHasher& hasher,
                                    uint64_t model_fp, uint64_t codec_fp, absl::string_view system,
                                    absl::string_view question, std::ostream& out) {
  const std::vector<BlockHash> keys = hasher.ChunkKeys(ByteTokens(absl::StrCat(system, question)));
  std::vector<AlignedBuffer> files;
  std::vector<BlockView> views;
  std::vector<kernels::PreparedBlock> ops;
  std::vector<float> k_ref, v_ref;  // the same KV at fp16 precision, [tokens, heads, dim]
  size_t compressed_bytes = 0;
  for (uint32_t c = 0; c < keys.size(); ++c) {
    const BlockName name{model_fp, codec_fp, 0, keys[c], 0};
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, ReadFileAligned(BlockPath(o, name), kMaxBlockBytes));
    compressed_bytes += buf.size();
    files.push_back(std::move(buf));
    const kernels::SyntheticKv kv = StandInKv(o, keys[c], c, 0);
    for (float x : kv.k) k_ref.push_back(HalfBitsToFloat(FloatToHalfBits(x)));
    for (float x : kv.v) v_ref.push_back(HalfBitsToFloat(FloatToHalfBits(x)));
  }
  for (const AlignedBuffer& f : files) {
    STRATA_ASSIGN_OR_RETURN(BlockView v, BlockView::Parse(f.span()));
    views.push_back(v);
  }
  for (const BlockView& v : views) {
    STRATA_ASSIGN_OR_RETURN(kernels::PreparedBlock op, kernels::PrepareBlock(v));
    ops.push_back(std::move(op));
  }
  std::vector<const kernels::BlockOperands*> ptrs;
  for (const kernels::PreparedBlock& op : ops) {
    for (const kernels::BlockOperands& part : op.parts) ptrs.push_back(&part);
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> q(size_t{o.q_heads} * o.head_dim), out_c(q.size()), out_f(q.size());
  for (float& x : q) x = normal(rng);
  const kernels::DecodeAttentionParams params{o.q_heads, o.kv_heads, o.head_dim};
  kernels::DecodeSequence compressed;
  compressed.q = q.data();
  compressed.blocks = ptrs;
  compressed.out = out_c.data();
  STRATA_RETURN_IF_ERROR(kernels::DecodeAttention(params, {&compressed, 1}));
  kernels::DecodeSequence full;
  full.q = q.data();
  full.window = {k_ref.data(), v_ref.data(), static_cast<uint32_t>(keys.size() * o.chunk_tokens)};
  full.out = out_f.data();
  STRATA_RETURN_IF_ERROR(kernels::DecodeAttention(params, {&full, 1}));
  double num = 0, den = 0;
  for (size_t i = 0; i < out_c.size(); ++i) {
    num += (double{out_c[i]} - out_f[i]) * (double{out_c[i]} - out_f[i]);
    den += double{out_f[i]} * out_f[i];
  }
  const double fp16_bytes = 2.0 * 2 * k_ref.size();
  out << absl::StrFormat(
      "\ndecode attention for request B, layer 0, over %d compressed blocks read from disk "
      "(%d query heads over %d KV heads, %s kernels):\n  %d bytes instead of %.0f at fp16 "
      "(%.1fx smaller); output differs from fp16 attention by %.4f (relative L2)\n",
      ops.size(), o.q_heads, o.kv_heads, kernels::DecodeAttentionUsesAvx2() ? "AVX2" : "portable",
      compressed_bytes, fp16_bytes, fp16_bytes / compressed_bytes, std::sqrt(num / den));
  return absl::OkStatus();
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
  if (q_heads < 1 || q_heads % kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("demo: q_heads ", q_heads, " is not a multiple of kv_heads ", kv_heads));
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
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Codec> codec, kernels::Codec::Create(o.codec));
  const std::string codec_spec = codec->spec().ToString();
  const uint64_t codec_fp = Fingerprint64(codec_spec);
  out << absl::StrFormat(
      "Strata demo: %d layers x %d KV heads x head dim %d, %d-token chunks, codec %s "
      "(%.3f bits per element, everything counted), prefix keys %s (B=%d), blocks in %s\n",
      o.layers, o.kv_heads, o.head_dim, o.chunk_tokens, codec_spec,
      *codec->BitsPerElement(o.chunk_tokens, o.kv_heads, o.head_dim), o.prefix_hash,
      o.hash_block_tokens, o.out_dir);

  const std::pair<const char*, const char*> requests[] = {{"A", kQuestionA}, {"B", kQuestionB}};
  std::vector<std::pair<std::string, RequestStats>> rows;
  for (const auto& [label, question] : requests) {
    out << absl::StrFormat("\nrequest %s:\n", label);
    STRATA_ASSIGN_OR_RETURN(RequestStats st,
                            ServeRequest(o, hasher, *codec, model_fp, codec_fp,
                                         absl::StrCat(kSystemPrompt, question), out));
    rows.emplace_back(label, st);
  }
  out << "\n  request  tokens  chunks  prefix-hit  blocks-written  bytes-written\n";
  for (const auto& [label, st] : rows) {
    out << absl::StrFormat("  %-7s  %6d  %6d  %10d  %14d  %13d\n", label, st.tokens, st.chunks,
                           st.hit_chunks, st.blocks_written, st.bytes_written);
  }

  STRATA_RETURN_IF_ERROR(
      AttendOverStoredBlocks(o, hasher, model_fp, codec_fp, kSystemPrompt, kQuestionB, out));

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
