// The serving path on the GPU (model/cuda/cuda_backend.h) at an 8B model's shape with random
// bf16 weights, as the nodes run it: KIVI 4-bit g32 blocks of 256-token chunks.
//   - TTFT: a prompt of a 4k prefix plus a 64-token suffix prefilled whole (the prefix recomputed)
//     against the prefix's blocks adopted from host memory (as from a node's RAM tier or the
//     store) and only the suffix prefilled: the issue's >= 5x target.
//   - prefill throughput of the whole prompt (pieces of one chunk, each chunk compressed by the
//     host codec before the next attends to it), and the share the host's compression takes;
//   - decode: one StepBatch of 16 and of 64 sequences at 4k context (pages adopted), against
//     CudaLlamaModel::DecodePaged's time at the same shape in cuda_model_bench (the backend's own
//     cost: the new K and V back to the host caches, their appends, the block tables).
// Times are medians of host-clock runs (every call returns with its work done).
//
//   cuda_backend_bench [--out DIR] [--runs N]
// Writes DIR/cuda_backend_bench-<device>-<date>-<commit>.{txt,json} (commit from
// $STRATA_COMMIT). Exits 1 without a GPU, saying so.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/eight_b_config.h"
#include "bench/gpu_run_info.h"
#include "model/compute_backend.h"
#include "model/cuda/cuda_backend.h"
#include "model/kv_cache.h"

namespace {

using strata::SharedBytes;
using strata::model::ComputeBackend;
using strata::model::KvCache;
using strata::model::KvCacheOptions;

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "cuda_backend_bench: %s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}

void Must(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_backend_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Median milliseconds of `runs` runs of `fn` after one warm-up run; `setup` (untimed) before each.
double MedianMs(int runs, const std::function<void()>& setup, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int r = 0; r < runs + 1; ++r) {
    setup();
    const auto a = std::chrono::steady_clock::now();
    fn();
    const auto b = std::chrono::steady_clock::now();
    if (r >= 1) t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir;
  int runs = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (a == "--runs" && i + 1 < argc) {
      runs = std::max(3, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: cuda_backend_bench [--out DIR] [--runs N]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cuda_backend_bench: no GPU here: nothing to measure\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int driver = 0;
  cudaDriverGetVersion(&driver);

  const strata::model::ModelConfig cfg = strata::bench::EightBConfig();
  const uint32_t L = cfg.num_layers;
  constexpr uint32_t kChunk = 256, kPrefix = 4096, kSuffix = 64;
  std::unique_ptr<ComputeBackend> backend =
      Must(strata::model::cuda::MakeRandomCudaBackend(
               cfg, {.kv_pool_bytes = uint64_t{24} << 30, .max_sequences = 80}),
           "the 8B-shaped backend");
  const KvCacheOptions o{.codec = "kivi:k4v4:g32", .chunk_tokens = kChunk};
  std::vector<uint32_t> prompt(kPrefix + kSuffix);
  for (size_t i = 0; i < prompt.size(); ++i) {
    prompt[i] = static_cast<uint32_t>((i * 7919 + 13) % cfg.vocab_size);
  }

  // The whole prompt, recomputed; the host codec's share (the cache's encode_seconds).
  std::unique_ptr<KvCache> whole;
  double encode_ms = 0;
  const double recompute_ms = MedianMs(
      runs, [&] { whole = Must(backend->NewCache(o), "cache"); },
      [&] {
        Must(backend->Prefill(prompt, whole.get()).status(), "prefill");
        encode_ms = whole->encode_seconds() * 1e3;
      });
  // The prefix's blocks, as a store would hand them back: adopted, then the suffix.
  std::vector<std::vector<SharedBytes>> prefix(L);
  for (uint32_t l = 0; l < L; ++l) {
    prefix[l].assign(whole->layer_blocks(l).begin(),
                     whole->layer_blocks(l).begin() + kPrefix / kChunk);
  }
  whole.reset();
  std::unique_ptr<KvCache> reuse;
  auto adopt = [&](KvCache* c) {
    for (uint32_t i = 0; i < kPrefix / kChunk; ++i) {
      for (uint32_t l = 0; l < L; ++l) {
        Must(c->AdoptBlock(l, prefix[l][i], /*checksum_verified=*/true), "adopt");
      }
      Must(c->CommitAdopted(), "commit adopted");
    }
  };
  const double reuse_ms = MedianMs(
      runs, [&] { reuse = Must(backend->NewCache(o), "cache"); },
      [&] {
        adopt(reuse.get());
        Must(backend->Prefill(absl::MakeConstSpan(prompt).subspan(kPrefix), reuse.get()).status(),
             "suffix");
      });
  reuse.reset();

  // Decode: a token per sequence, every sequence at 4k (the prefix adopted, then one token).
  struct DecodeRow {
    int batch = 0;
    double ms = 0;
  };
  std::vector<DecodeRow> decode;
  for (int batch : {16, 64}) {
    std::vector<std::unique_ptr<KvCache>> caches;
    std::vector<KvCache*> ptrs;
    for (int b = 0; b < batch; ++b) {
      caches.push_back(Must(backend->NewCache(o), "cache"));
      adopt(caches.back().get());
      ptrs.push_back(caches.back().get());
    }
    std::vector<uint32_t> tokens(batch, 1000);
    std::vector<absl::Span<const uint32_t>> spans;
    for (int b = 0; b < batch; ++b) spans.push_back({&tokens[b], 1});
    const double ms = MedianMs(
        std::max(runs, 10), [] {},
        [&] { Must(backend->StepBatch(spans, ptrs).status(), "decode step"); });
    decode.push_back({batch, ms});
  }

  const strata::bench::GpuRunInfo info = strata::bench::CollectGpuRunInfo(prop, driver);
  std::ostringstream txt;
  char line[256];
  txt << info.Header("cuda_backend_bench") << "\n";
  txt << "8B shape, random bf16 weights; kivi:k4v4:g32 blocks of " << kChunk
      << " tokens; medians of " << runs << " runs\n";
  std::snprintf(line, sizeof(line),
                "TTFT, %u-token prefix + %u-token suffix: recomputed %.1f ms, prefix adopted "
                "from host memory %.1f ms: %.2fx\n",
                kPrefix, kSuffix, recompute_ms, reuse_ms, recompute_ms / reuse_ms);
  txt << line;
  std::snprintf(line, sizeof(line),
                "prefill of %u tokens: %.0f tokens/s, the host codec's compression %.1f ms of "
                "it (%.0f%%)\n",
                kPrefix + kSuffix, (kPrefix + kSuffix) / (recompute_ms * 1e-3), encode_ms,
                100 * encode_ms / recompute_ms);
  txt << line;
  for (const DecodeRow& r : decode) {
    std::snprintf(line, sizeof(line),
                  "decode step, batch %d x %u context: %.3f ms, %.0f tokens/s (StepBatch)\n",
                  r.batch, kPrefix, r.ms, r.batch / (r.ms * 1e-3));
    txt << line;
  }
  std::fputs(txt.str().c_str(), stdout);
  if (!out_dir.empty()) {
    const std::string base = info.ResultBase(out_dir, "cuda_backend_bench");
    std::ofstream(base + ".txt") << txt.str();
    std::ofstream json(base + ".json");
    json << "{" << info.JsonFields() << ", \"codec\": \"" << o.codec
         << "\", \"chunk_tokens\": " << kChunk << ", \"ttft\": {\"prefix\": " << kPrefix
         << ", \"suffix\": " << kSuffix << ", \"recompute_ms\": " << recompute_ms
         << ", \"adopted_ms\": " << reuse_ms << "}, \"prefill\": {\"tokens\": " << kPrefix + kSuffix
         << ", \"ms\": " << recompute_ms << ", \"encode_ms\": " << encode_ms << "}, \"decode\": [";
    for (size_t i = 0; i < decode.size(); ++i) {
      json << (i ? ", " : "") << "{\"batch\": " << decode[i].batch << ", \"context\": " << kPrefix
           << ", \"ms\": " << decode[i].ms << "}";
    }
    json << "]}\n";
  }
  return 0;
}
