// codec_bench: the three tables of the codec issue, on this machine, in one run.
//   1. compression throughput per codec (GB/s of fp16 input), one thread and all threads;
//   2. decode attention per codec vs fp16 attention over the same context (8k and 32k tokens,
//      head_dim 128, 8 KV heads, GQA 4): time, KV bytes read per second, fraction of the
//      memory read bandwidth measured in the same run, speedup over fp16 and the target
//      (0.6 x compression ratio);
//   3. error on synthetic KV with real models' structure (kernels/synthetic_kv.h): relative
//      Frobenius error of K and V, relative error of attention output, and bits per element
//      (everything counted) next to the nominal bits papers quote.
// Prints the tables and writes JSON to --out (default bench/results).
// Flags: kUsage below (--help).
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/cpu_features.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"
#include "kernels/decode_attention.h"
#include "kernels/synthetic_kv.h"

namespace strata::bench {
namespace {

using kernels::BlockOperands;
using kernels::Codec;

constexpr uint32_t kChunk = 256, kKvHeads = 8, kQHeads = 32, kDim = 128;

const char* kDefaultCodecs =
    "fp16,int8,fp8e4m3,kivi:k8v8:g32,kivi:k4v4:g32,kivi:k3v3:g32,kivi:k2v2:g32,kivi:k2v2:g128,"
    "kcvt:k4v4,kcvt:k2v2,gearl:k2v2:g32:r4,gearl:k2v2:kcvt:r4,gear:k2v2:kcvt:r2:s1,"
    "gear:k2v2:kcvt:r4:s2,gear:k2v2:g32:r4:s2,gear:k4v4:g32:r4:s2,skvq:k2v2:g32,skvq:k2v2:g64:m8,"
    "zipcache:k2v2:h4:s10,tada:k2v2:g32,strata:b3,strata:b2.25";

// The Strata mix has one codec per layer, chosen by calibration on a model; here each budget
// stands for the layers the bundled model's calibration chose (docs/codecs.md, "What the mix
// chose"), and its row is the mean over those layers of one pass over each layer's blocks.
std::vector<std::string> MixLayers(absl::string_view spec) {
  if (spec == "strata:b3") {
    return {"skvq:k2v2:g32:m8:sink4", "skvq:k2v2:g64:m8", "kivi:k4v2:g32:sink4"};
  }
  if (spec == "strata:b2.25") return {"skvq:k2v2:g64:m8", "kcvt:k2v2:m8", "kcvt:k2v2:m8"};
  return {};
}

// A codec of this spec for head dim `dim`, calibrated when it needs it.
absl::StatusOr<std::unique_ptr<Codec>> MakeCodec(const std::string& spec, uint32_t dim) {
  STRATA_ASSIGN_OR_RETURN(kernels::CodecSpec parsed, kernels::CodecSpec::Parse(spec));
  // A stand-in calibration: the attention kernels' and the encoder's speed do not depend on it.
  if (parsed.needs_calibration()) {
    return Codec::Create(spec, kernels::MakeSyntheticCalibration(parsed, kKvHeads, dim, 3));
  }
  return Codec::Create(spec);
}

struct Chunks {
  std::vector<std::vector<Half>> k, v;  // fp16 input, [tokens, heads, dim] per chunk
  std::vector<std::vector<float>> q;    // when asked for: [tokens, kQHeads, dim] per chunk
  uint32_t dim = kDim;
};

// `queries`: each chunk carries its tokens' queries too, as the model hands them to the cache
// (ZipCache's probe attention uses them; the other codecs ignore them).
Chunks MakeChunks(uint32_t n, uint64_t seed, uint32_t dim = kDim, bool queries = false) {
  Chunks c;
  c.dim = dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  for (uint32_t i = 0; i < n; ++i) {
    if (queries) {
      c.q.emplace_back(size_t{kChunk} * kQHeads * dim);
      for (float& x : c.q.back()) x = normal(rng);
    }
    const kernels::SyntheticKv kv =
        kernels::MakeSyntheticKv(kChunk, kKvHeads, dim, seed, i * kChunk);
    c.k.emplace_back(kv.k.size());
    c.v.emplace_back(kv.v.size());
    FloatToHalf(kv.k.data(), c.k.back().data(), kv.k.size());
    FloatToHalf(kv.v.data(), c.v.back().data(), kv.v.size());
  }
  return c;
}

kernels::KvChunkView View(const Chunks& c, size_t i) {
  kernels::KvChunkView v{c.k[i].data(), c.v[i].data(), SourceDType::kFloat16,
                         kChunk,        kKvHeads,      c.dim};
  if (i < c.q.size()) {
    v.q = c.q[i].data();
    v.q_heads = kQHeads;
  }
  return v;
}

struct Encoded {
  std::vector<AlignedBuffer> buffers;
  std::vector<BlockView> views;
  std::vector<kernels::PreparedBlock> ops;
  std::vector<const BlockOperands*> ptrs;
  size_t bytes = 0;
};

// Compresses every chunk (what table 1 times); Encode below also prepares the blocks.
void CompressAll(const Codec& codec, const Chunks& c, ThreadPool& pool,
                 std::vector<AlignedBuffer>& out) {
  out.resize(c.k.size());
  pool.ParallelFor(c.k.size(), [&](size_t i) {
    absl::StatusOr<AlignedBuffer> b =
        codec.Encode(View(c, i), {.chunk_index = static_cast<uint32_t>(i)});
    if (!b.ok()) {
      std::fprintf(stderr, "encode failed: %s\n", std::string(b.status().message()).c_str());
      std::abort();
    }
    out[i] = *std::move(b);
  });
}

Encoded Encode(const Codec& codec, const Chunks& c, ThreadPool& pool,
               const kernels::Calibration* calibration = nullptr) {
  Encoded e;
  CompressAll(codec, c, pool, e.buffers);
  for (const AlignedBuffer& b : e.buffers) {
    e.views.push_back(*BlockView::Parse(b.span()));
    e.bytes += b.size();
  }
  for (const BlockView& v : e.views) e.ops.push_back(*kernels::PrepareBlock(v, calibration));
  for (const kernels::PreparedBlock& o : e.ops) {
    for (const BlockOperands& part : o.parts) e.ptrs.push_back(&part);
  }
  return e;
}

// Rescales each query head so that its attention logits q.k/sqrt(D) over the context have a
// standard deviation of `logit_std`, as real models' do (1-3); random unit queries against keys
// with outlier channels would otherwise give one-hot attention.
void ScaleQueries(std::vector<float>& q, const std::vector<float>& k, uint32_t tokens,
                  double logit_std) {
  const uint32_t g = kQHeads / kKvHeads;
  for (uint32_t qh = 0; qh < kQHeads; ++qh) {
    const uint32_t h = qh / g;
    double sum = 0, sq = 0;
    for (uint32_t t = 0; t < tokens; ++t) {
      double dot = 0;
      for (uint32_t d = 0; d < kDim; ++d)
        dot += double{q[qh * kDim + d]} * k[(size_t{t} * kKvHeads + h) * kDim + d];
      dot /= std::sqrt(double{kDim});
      sum += dot;
      sq += dot * dot;
    }
    const double mean = sum / tokens, sd = std::sqrt(std::max(1e-12, sq / tokens - mean * mean));
    for (uint32_t d = 0; d < kDim; ++d) q[qh * kDim + d] *= static_cast<float>(logit_std / sd);
  }
}

double RelErr(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

constexpr char kUsage[] =
    "usage: codec_bench [--commit SHA] [--out DIR (default bench/results)]\n"
    "                   [--contexts 8192,32768] [--codecs a,b,...] [--tables 1,2,3]\n"
    "                   [--threads N (the 'all threads' runs; default one per hardware thread)]\n"
    "                   [--split TOKENS (attention's flash-decoding part size; default the "
    "kernel's)]\n"
    "                   [--isa native|avx2|portable (hide the CPU's features above it)]\n"
    "                   [--integer_dot auto|avx2+vpmaddubsw|avx2+avx-vnni|avx2+avx512-vnni|"
    "avx512-vnni-zmm]\n";

int Main(int argc, char** argv) {
  // Keep freed memory in the heap: codecs allocate per-chunk scratch, and glibc's default of
  // returning every block over 128 KiB to the kernel turns each chunk into page faults. Serving
  // processes get the same from their allocator (or this setting).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  std::string commit = "unknown", out_dir = "bench/results", codec_list = kDefaultCodecs;
  std::vector<uint32_t> contexts = {8192, 32768};
  bool table[4] = {false, true, true, true};
  int threads = 0;
  uint32_t split = kernels::DecodeAttentionOptions{}.tokens_per_split;
  std::string isa = "native", integer_dot = "auto";
  int exit_code = 0;
  const auto flags = FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  for (const auto& [flag, val] : *flags) {
    if (flag == "--commit")
      commit = val;
    else if (flag == "--out")
      out_dir = val;
    else if (flag == "--codecs")
      codec_list = val;
    else if (flag == "--tables") {
      table[1] = table[2] = table[3] = false;
      for (absl::string_view s : absl::StrSplit(val, ',')) {
        int t;
        if (!absl::SimpleAtoi(s, &t) || t < 1 || t > 3) {
          std::fprintf(stderr, "bad --tables entry '%s' (1, 2 or 3)\n", std::string(s).c_str());
          return 2;
        }
        table[t] = true;
      }
    } else if (flag == "--threads") {
      if (!absl::SimpleAtoi(val, &threads) || threads < 1 || threads > 1024) {
        std::fprintf(stderr, "bad --threads '%s' (1 to 1024)\n", val.c_str());
        return 2;
      }
    } else if (flag == "--split") {
      if (!absl::SimpleAtoi(val, &split) || split < 1) {
        std::fprintf(stderr, "bad --split '%s' (tokens, >= 1)\n", val.c_str());
        return 2;
      }
    } else if (flag == "--isa") {
      isa = val;
    } else if (flag == "--integer_dot") {
      integer_dot = val;
    } else if (flag == "--contexts") {
      contexts.clear();
      for (absl::string_view s : absl::StrSplit(val, ',')) {
        uint32_t c;
        if (!absl::SimpleAtoi(s, &c) || c < kChunk) {
          std::fprintf(stderr, "bad --contexts entry '%s'\n", std::string(s).c_str());
          return 2;
        }
        contexts.push_back(c / kChunk * kChunk);
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n%s", flag.c_str(), kUsage);
      return 2;
    }
  }
  // Before any kernel reads the CPU's features.
  IsaCap cap;
  if (!ParseIsaCap(isa, &cap)) {
    std::fprintf(stderr, "bad --isa '%s' (native, avx2 or portable)\n", isa.c_str());
    return 2;
  }
  CapCpuFeatures(cap);
  if (!kernels::SelectIntegerDot(integer_dot)) {
    std::fprintf(stderr, "--integer_dot '%s': not a path this CPU runs\n", integer_dot.c_str());
    return 2;
  }
  const RunInfo info = CollectRunInfo(commit);
  ThreadPool pool(threads), one(1);
  std::printf("codec_bench  %s  %s  commit %s\n", info.machine.c_str(), info.date.c_str(),
              info.commit.c_str());
  std::printf("attention kernels: %s\n", kernels::DecodeAttentionPath());
  const double read_bw = MeasureReadBandwidth(pool.size()), copy_bw = MeasureCopyBandwidth();
  const double read_bw_1 = MeasureReadBandwidth(1);
  std::printf(
      "memory: streaming read %.1f GB/s (%d threads), %.1f GB/s (1 thread); memcpy %.1f GB/s "
      "(read+write)\n\n",
      read_bw / 1e9, pool.size(), read_bw_1 / 1e9, copy_bw / 1e9);

  // Tables 1 and 3 take the single codecs (a mix is a choice of them per layer).
  std::vector<std::unique_ptr<Codec>> codecs;
  for (absl::string_view s : absl::StrSplit(codec_list, ',')) {
    if (!MixLayers(s).empty()) continue;
    absl::StatusOr<std::unique_ptr<Codec>> c = MakeCodec(std::string(s), kDim);
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", std::string(c.status().message()).c_str());
      return 2;
    }
    codecs.push_back(*std::move(c));
  }

  // ---- 1. compression throughput ----
  std::vector<std::string> j_compress;
  const Chunks tput_chunks = MakeChunks(32, 11, kDim, /*queries=*/true);
  const double in_bytes = 32.0 * 2 * kChunk * kKvHeads * kDim * sizeof(Half);
  std::printf(
      "1. compression throughput: %u chunks of %u tokens x %u KV heads x %u, fp16 input (and "
      "the tokens' queries, %u heads, for ZipCache's probes)\n",
      32u, kChunk, kKvHeads, kDim, kQHeads);
  std::printf("%-24s %10s %12s %12s\n", "codec", "bits/elem", "1 thread", "all threads");
  for (const auto& c : codecs) {
    if (!table[1]) break;
    const double bits = *c->BitsPerElement(kChunk, kKvHeads, kDim);
    std::vector<AlignedBuffer> blocks;
    const double t1 = MedianSeconds(3, [&] { CompressAll(*c, tput_chunks, one, blocks); });
    const double tn = MedianSeconds(3, [&] { CompressAll(*c, tput_chunks, pool, blocks); });
    std::printf("%-24s %10.3f %9.3f GB/s %9.3f GB/s\n", c->spec().ToString().c_str(), bits,
                in_bytes / t1 / 1e9, in_bytes / tn / 1e9);
    j_compress.push_back(Json()
                             .Str("codec", c->spec().ToString())
                             .Num("bits_per_element", bits)
                             .Num("gbps_1_thread", in_bytes / t1 / 1e9)
                             .Num("gbps_all_threads", in_bytes / tn / 1e9)
                             .Num("threads", pool.size())
                             .Done());
  }

  // ---- 2. attention throughput ----
  // Configurations: head dim 128 and 64 at each context (batch 1, all threads); one thread at
  // the longest context; 16 sequences over one shared prefix (a cached prompt) at the shortest.
  struct AttnConfig {
    uint32_t dim, ctx, batch;
    bool one_thread;
  };
  std::vector<AttnConfig> configs;
  for (uint32_t ctx : contexts) {
    configs.push_back({kDim, ctx, 1, false});
    configs.push_back({64, ctx, 1, false});
  }
  configs.push_back({kDim, *std::max_element(contexts.begin(), contexts.end()), 1, true});
  configs.push_back({kDim, *std::min_element(contexts.begin(), contexts.end()), 16, false});
  std::vector<std::string> j_attention;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> out(size_t{kQHeads} * kDim);
  for (const AttnConfig& cfg : configs) {
    if (!table[2]) break;
    ThreadPool& tp = cfg.one_thread ? one : pool;
    const Chunks chunks = MakeChunks(cfg.ctx / kChunk, 21, cfg.dim);
    const kernels::DecodeAttentionParams params{kQHeads, kKvHeads, cfg.dim};
    std::vector<std::vector<float>> qs(cfg.batch, std::vector<float>(size_t{kQHeads} * cfg.dim));
    std::vector<std::vector<float>> outs(cfg.batch, std::vector<float>(qs[0].size()));
    for (auto& q : qs) {
      for (float& x : q) x = normal(rng);
    }
    std::printf(
        "\n2. decode attention, %u tokens, %u query heads over %u KV heads, head dim %u, "
        "batch %u%s, %d thread%s\n",
        cfg.ctx, kQHeads, kKvHeads, cfg.dim, cfg.batch, cfg.batch > 1 ? " (one shared prefix)" : "",
        tp.size(), tp.size() > 1 ? "s" : "");
    std::printf("%-24s %10s %10s %12s %9s %9s %9s %7s%s\n", "codec", "KV MiB", "time ms", "KV GB/s",
                "of read", "speedup", "target", "met",
                cfg.batch > 1 ? "   apart ms  shared/apart" : "");
    double fp16_time = 0, fp16_bytes = 0;
    for (absl::string_view name : absl::StrSplit(codec_list, ',')) {
      std::vector<std::string> layers = MixLayers(name);
      if (layers.empty()) layers.push_back(std::string(name));
      double t = 0, t_apart = 0, bytes = 0, nominal = 0;
      for (const std::string& spec : layers) {
        absl::StatusOr<std::unique_ptr<Codec>> c = MakeCodec(spec, cfg.dim);
        if (!c.ok()) {
          std::fprintf(stderr, "%s: %s\n", spec.c_str(), std::string(c.status().message()).c_str());
          return 2;
        }
        nominal = std::max(nominal, (*c)->spec().nominal_bits());
        Encoded e = Encode(**c, chunks, pool, (*c)->calibration());
        std::vector<kernels::DecodeSequence> batch(cfg.batch);
        for (uint32_t i = 0; i < cfg.batch; ++i) {
          batch[i].q = qs[i].data();
          batch[i].blocks = e.ptrs;
          batch[i].out = outs[i].data();
        }
        const int reps = cfg.ctx * cfg.batch > 16384 ? 9 : 21;
        t += MedianSeconds(reps, [&] {
          const absl::Status st =
              kernels::DecodeAttention(params, batch, {.tokens_per_split = split, .pool = &tp});
          if (!st.ok()) std::abort();
        });
        if (cfg.batch > 1) {  // the same batch with every sequence read apart
          t_apart += MedianSeconds(reps, [&] {
            const absl::Status st = kernels::DecodeAttention(
                params, batch, {.tokens_per_split = split, .pool = &tp, .share_prefixes = false});
            if (!st.ok()) std::abort();
          });
        }
        bytes += e.bytes;
      }
      // A mix: per layer (the mean over its layers), comparable with one layer of the others.
      t /= layers.size();
      t_apart /= layers.size();
      bytes /= layers.size();
      const std::string label(name);
      if (label == "fp16") {
        fp16_time = t;
        fp16_bytes = bytes;
      }
      const double speedup = fp16_time > 0 ? fp16_time / t : 0;
      const double target = fp16_bytes > 0 ? 0.6 * fp16_bytes / bytes : 0;
      const bool compressed = nominal <= 4;
      // Bytes attended: every sequence's whole KV (a shared prefix counted once per sequence,
      // as if read apart).
      const double streamed = bytes * cfg.batch;
      const double bw = cfg.one_thread ? read_bw_1 : read_bw;
      std::printf("%-24s %10.1f %10.3f %12.2f %8.0f%% %8.2fx %8.2fx %7s", label.c_str(),
                  bytes / 1048576.0, t * 1e3, streamed / t / 1e9, 100 * streamed / t / bw, speedup,
                  target, compressed && fp16_time > 0 ? (speedup >= target ? "yes" : "NO") : "-");
      if (cfg.batch > 1) std::printf(" %10.3f %13.2fx", t_apart * 1e3, t_apart / t);
      std::printf("\n");
      std::fflush(stdout);
      j_attention.push_back(Json()
                                .Str("codec", label)
                                .Num("context", cfg.ctx)
                                .Num("head_dim", cfg.dim)
                                .Num("batch", cfg.batch)
                                .Num("threads", tp.size())
                                .Num("kv_bytes", bytes)
                                .Num("seconds", t)
                                .Num("kv_gbps", streamed / t / 1e9)
                                .Num("fraction_of_read_bandwidth", streamed / t / bw)
                                .Num("speedup_vs_fp16", speedup)
                                .Num("seconds_sequences_apart", t_apart)
                                .Num("target_speedup", target)
                                .Done());
    }
  }

  // ---- 3. error on synthetic KV ----
  const kernels::DecodeAttentionParams params{kQHeads, kKvHeads, kDim};
  std::vector<std::string> j_error;
  constexpr uint32_t kErrChunks = 8, kQueries = 8;
  const uint32_t tokens = kErrChunks * kChunk;
  std::vector<float> k_all(size_t{tokens} * kKvHeads * kDim), v_all(k_all.size());
  Chunks err_chunks;
  for (uint32_t i = 0; i < kErrChunks; ++i) {
    const kernels::SyntheticKv kv =
        kernels::MakeSyntheticKv(kChunk, kKvHeads, kDim, 31, i * kChunk);
    std::copy(kv.k.begin(), kv.k.end(), k_all.begin() + size_t{i} * kv.k.size());
    std::copy(kv.v.begin(), kv.v.end(), v_all.begin() + size_t{i} * kv.v.size());
    err_chunks.k.emplace_back(kv.k.size());
    err_chunks.v.emplace_back(kv.v.size());
    FloatToHalf(kv.k.data(), err_chunks.k.back().data(), kv.k.size());
    FloatToHalf(kv.v.data(), err_chunks.v.back().data(), kv.v.size());
  }
  // Reference: attention over the original fp32 KV (as one full-precision segment).
  std::vector<std::vector<float>> queries(kQueries, std::vector<float>(size_t{kQHeads} * kDim));
  std::vector<std::vector<float>> ref(kQueries, std::vector<float>(size_t{kQHeads} * kDim));
  for (uint32_t i = 0; i < kQueries; ++i) {
    for (float& x : queries[i]) x = normal(rng);
    ScaleQueries(queries[i], k_all, tokens, 2.5);
    kernels::DecodeSequence s;
    s.q = queries[i].data();
    s.window = {k_all.data(), v_all.data(), tokens};
    s.out = ref[i].data();
    if (!kernels::DecodeAttentionRef(params, {&s, 1}).ok()) std::abort();
  }
  std::printf(
      "\n3. error on synthetic KV (%u tokens, %u KV heads, head dim %u; attention: %u "
      "queries x %u heads, logit std 2.5, vs fp32 attention)\n",
      tokens, kKvHeads, kDim, kQueries, kQHeads);
  std::printf("%-24s %9s %9s %10s %10s %12s %12s\n", "codec", "bits", "nominal", "K rel err",
              "V rel err", "attn rel err", "int vs fp32");
  for (const auto& c : codecs) {
    if (!table[3]) break;
    Encoded e = Encode(*c, err_chunks, pool, c->calibration());
    std::vector<float> k_dec(k_all.size()), v_dec(v_all.size());
    const size_t per = size_t{kChunk} * kKvHeads * kDim;
    for (uint32_t i = 0; i < kErrChunks; ++i) {
      if (!kernels::DecodePreparedRef(e.ops[i], &k_dec[i * per], &v_dec[i * per]).ok())
        std::abort();
    }
    const double ek = RelErr(k_dec.data(), k_all.data(), k_all.size());
    const double ev = RelErr(v_dec.data(), v_all.data(), v_all.size());
    // The attention error against fp32 attention, and the integer kernels' own share: their
    // output against the same kernels with fp32 dot products (DecodeAttentionOptions).
    double ea = 0, eint = 0;
    std::vector<float> exact(out.size());
    for (uint32_t i = 0; i < kQueries; ++i) {
      kernels::DecodeSequence s;
      s.q = queries[i].data();
      s.blocks = e.ptrs;
      s.out = out.data();
      if (!kernels::DecodeAttention(params, {&s, 1}, {.pool = &pool}).ok()) std::abort();
      ea += RelErr(out.data(), ref[i].data(), out.size()) / kQueries;
      s.out = exact.data();
      if (!kernels::DecodeAttention(params, {&s, 1}, {.pool = &pool, .integer_dot = false}).ok())
        std::abort();
      eint += RelErr(out.data(), exact.data(), out.size()) / kQueries;
    }
    const double bits = e.bytes * 8.0 / (2.0 * tokens * kKvHeads * kDim);
    std::printf("%-24s %9.3f %9.1f %10.4f %10.4f %12.5f %12.2e\n", c->spec().ToString().c_str(),
                bits, c->spec().nominal_bits(), ek, ev, ea, eint);
    j_error.push_back(Json()
                          .Str("codec", c->spec().ToString())
                          .Num("bits_per_element", bits)
                          .Num("nominal_bits", c->spec().nominal_bits())
                          .Num("k_rel_error", ek)
                          .Num("v_rel_error", ev)
                          .Num("attention_rel_error", ea)
                          .Num("integer_dot_rel_error", eint)
                          .Done());
  }

  const std::string json = ResultJson("codec_bench", info)
                               .Num("read_bandwidth_gbps", read_bw / 1e9)
                               .Num("read_bandwidth_1_thread_gbps", read_bw_1 / 1e9)
                               .Num("copy_bandwidth_gbps", copy_bw / 1e9)
                               .Str("attention_kernels", kernels::DecodeAttentionPath())
                               .Raw("compression", JsonArray(j_compress))
                               .Raw("attention", JsonArray(j_attention))
                               .Raw("error", JsonArray(j_error))
                               .Done();
  // A run with the CPU features capped (--isa avx2), or with the 512-bit integer kernels (the
  // path "avx512-vnni-zmm": --integer_dot on an AVX512-VNNI CPU), gets a file of its own.
  std::string tag = isa != "native" ? absl::StrCat("isa-", isa) : "";
  if (std::string_view(kernels::DecodeAttentionPath()) == "avx512-vnni-zmm") {
    absl::StrAppend(&tag, tag.empty() ? "" : "-", "zmm");
  }
  const std::string path = ResultPath(out_dir, "codec_bench", info, tag) + ".json";
  if (!WriteResultFile(path, json + "\n")) return 1;
  std::printf("\nwrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
