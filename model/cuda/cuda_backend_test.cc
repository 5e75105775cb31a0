// The CUDA compute backend (cuda_backend.h) against the CPU backend on the bundled model: a
// prefill in chunk pieces and greedy decode steps across a chunk boundary (fp16 and KIVI blocks),
// a prefill node's per-layer hook, a prefix adopted from the CPU engine's blocks, a window moved
// from a CPU cache, batched steps against solo ones, and the refusals. Skipped, saying why,
// without a GPU (but for the refusal without one).
#include "model/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/calibration.h"
#include "kernels/cuda/block_pages.h"
#include "kernels/cuda/paged_decode.h"
#include "model/calibration_search.h"
#include "model/cpu_backend.h"
#include "model/cuda/test_helpers.h"
#include "model/cuda_plugin.h"
#include "model/kv_cache.h"
#include "model/kv_evaluation.h"
#include "model/llama.h"

namespace strata::model::cuda {
namespace {

using testing_helpers::Dir;
using testing_helpers::Prompt;

// max |got - want| over max(1, max |want|).
double RelErr(absl::Span<const float> got, absl::Span<const float> want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0, mx = 1;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::fabs(double{got[i]} - want[i]));
    mx = std::max(mx, std::fabs(double{want[i]}));
  }
  return err / mx;
}

uint32_t Argmax(absl::Span<const float> v) {
  return static_cast<uint32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

TEST(CudaBackendNoGpuTest, WithoutAGpuTheBackendSaysWhy) {
  std::string why;
  if (HaveCudaDevice(&why)) GTEST_SKIP() << "a GPU is here: the refusal is not reachable";
  absl::StatusOr<std::unique_ptr<ComputeBackend>> b =
      LoadCudaBackend(Dir("models/strata-tiny"), Device{.kind = Device::Kind::kCuda});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find("no usable GPU"), std::string::npos) << b.status();
}

class CudaBackendTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
    absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(Dir("models/strata-tiny"));
    ASSERT_TRUE(host.ok()) << host.status();
    host_ = *std::move(host);
    cpu_ = std::make_unique<CpuBackend>(host_.get());
  }
  // fp16 weights: the closest to the CPU's fp32.
  std::unique_ptr<ComputeBackend> Gpu(uint32_t max_sequences = 8) {
    absl::StatusOr<std::unique_ptr<ComputeBackend>> b =
        MakeCudaBackend(*host_, {.weights = WeightType::kFp16,
                                 .kv_pool_bytes = uint64_t{64} << 20,
                                 .max_sequences = max_sequences});
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }
  const ModelConfig& config() const { return host_->config(); }
  // `steps` greedy steps (the GPU's choices fed to both), from `next`: each step's logits on the
  // GPU within `tolerance` of the CPU's.
  void ExpectStepsFollowTheCpu(ComputeBackend& gpu, KvCache* want_cache, KvCache* got_cache,
                               uint32_t next, int steps, double tolerance) {
    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE(step);
      const absl::Span<const uint32_t> one[] = {{&next, 1}};
      KvCache* const cpu_caches[] = {want_cache};
      KvCache* const gpu_caches[] = {got_cache};
      absl::StatusOr<std::vector<std::vector<float>>> w = cpu_->StepBatch(one, cpu_caches);
      absl::StatusOr<std::vector<std::vector<float>>> g = gpu.StepBatch(one, gpu_caches);
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_LT(RelErr((*g)[0], (*w)[0]), tolerance);
      next = Argmax((*g)[0]);
    }
  }

  std::unique_ptr<LlamaModel> host_;
  std::unique_ptr<CpuBackend> cpu_;
};

// fp16 blocks: the GPU's K and V differ from the CPU's by the fp16 weights' rounding; KIVI's
// 4-bit codes can flip where a value sits on a step's edge, so its bound is wider.
double Tolerance(const std::string& codec) { return codec == "fp16" ? 5e-3 : 3e-2; }

// fp16 and KIVI pages take the fast kernels; the others (GEAR with sinks, int8, TaDA, ZipCache)
// the general kernel (kernels/cuda/paged_decode.h, PageFormat::kGeneral).
TEST_F(CudaBackendTest, PrefillAndDecodeAcrossAChunkBoundaryFollowTheCpu) {
  for (const std::string codec : {"fp16", "kivi:k4v4:g16", "gear:k4v4:g16:r2:s2:sink4", "int8",
                                  "tada:k4v4:g16", "zipcache:k4v4:h8:s10"}) {
    SCOPED_TRACE(codec);
    std::unique_ptr<ComputeBackend> gpu = Gpu();
    ASSERT_NE(gpu, nullptr);
    EXPECT_EQ(gpu->device().ToString(), "cuda:0");
    EXPECT_EQ(gpu->fingerprint(), host_->fingerprint());
    const KvCacheOptions o{.codec = codec, .chunk_tokens = 16};
    std::unique_ptr<KvCache> want_cache = *cpu_->NewCache(o);
    absl::StatusOr<std::unique_ptr<KvCache>> got_cache = gpu->NewCache(o);
    ASSERT_TRUE(got_cache.ok()) << got_cache.status();
    EXPECT_EQ((*got_cache)->device().ToString(), "cuda:0");
    const std::vector<uint32_t> prompt = Prompt(config(), 53, 7);
    absl::StatusOr<std::vector<float>> want = cpu_->Prefill(prompt, want_cache.get());
    absl::StatusOr<std::vector<float>> got = gpu->Prefill(prompt, got_cache->get());
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(RelErr(*got, *want), Tolerance(codec));
    EXPECT_EQ((*got_cache)->tokens(), 53u);
    EXPECT_EQ((*got_cache)->blocks_per_layer(), 3u);
    EXPECT_EQ((*got_cache)->window_tokens(), 5u);
    for (uint32_t l = 0; l < config().num_layers; ++l) {
      ASSERT_EQ((*got_cache)->layer_blocks(l).size(), want_cache->layer_blocks(l).size());
      for (size_t i = 0; i < want_cache->layer_blocks(l).size(); ++i) {
        EXPECT_EQ((*got_cache)->layer_blocks(l)[i].size(), want_cache->layer_blocks(l)[i].size());
      }
    }
    // 14 greedy steps (the GPU's choices fed to both): tokens 53..66 cross the boundary at 64,
    // where the window's chunk becomes a block on the host and the device's window is sent again.
    ExpectStepsFollowTheCpu(*gpu, want_cache.get(), got_cache->get(), Argmax(*got), 14,
                            Tolerance(codec));
    EXPECT_EQ((*got_cache)->tokens(), 67u);
    EXPECT_EQ((*got_cache)->blocks_per_layer(), 4u);
    EXPECT_EQ((*got_cache)->window_tokens(), 3u);
  }
}

// The Strata mix with CQ (and fp16 sinks) on some layers: the pool is general, its CQ layers
// codebook pools of their own (the codebook kernel's; kernels/cuda/block_pages.h), its KIVI layers
// the general kernel's; prefill and greedy steps across a chunk boundary follow the CPU (each
// side encodes its own K and V, as in the test above: what is compared is the GPU against the CPU,
// not the codec's quality). Its CQ layers are of two sizes, c4:b8 and c4:b6: one kernel whose
// shared memory differs by layer, in steps replayed from CUDA graphs.
TEST_F(CudaBackendTest, AStrataMixWithCqLayersFollowsTheCpu) {
  // CQ codebooks learned on the model's own KV (a short calibration), so that a code the GPU's
  // fp16 K picks differently from the CPU's fp32 K is a near centroid, as a KIVI step is.
  CalibrationSearchOptions so;
  so.chunk_tokens = 16;
  so.context = 128;
  so.windows = 1;
  so.codebook_windows = 2;
  const std::vector<uint32_t> text = Prompt(config(), 300, 4);
  absl::StatusOr<kernels::Calibration> b8 = SearchCalibration(*host_, text, "cq:c4:b8", so);
  ASSERT_TRUE(b8.ok()) << b8.status();
  absl::StatusOr<kernels::Calibration> b6 = SearchCalibration(*host_, text, "cq:c4:b6", so);
  ASSERT_TRUE(b6.ok()) << b6.status();
  auto mix = std::make_shared<kernels::Calibration>(*b8);
  mix->codec = "strata:b3";
  const uint32_t L = config().num_layers;
  ASSERT_GE(L, 3u);
  for (uint32_t l = 0; l < L; ++l) {
    kernels::LayerCalibration& lc = mix->layers[l];
    if (l % 2 == 1) {
      lc = kernels::LayerCalibration{};
      lc.spec = "kivi:k4v4:g16";
    } else if (l % 4 == 2) {
      lc = b6->layers[l];
      lc.spec = "cq:c4:b6:sink4";
    } else {
      lc.spec = "cq:c4:b8:sink4";  // as the mix's menu has it: fp16 sinks in chunk 0
    }
  }
  // The layouts the backend's pool gets: each CQ layer a codebook pool of its own size, read by
  // the codebook kernel where the device's shared memory holds its table.
  std::vector<kernels::cuda::PagedKvLayout> layers;
  absl::StatusOr<kernels::cuda::PagedKvLayout> pool = kernels::cuda::PageLayoutForCodec(
      "strata:b3", 16, config().num_kv_heads, config().head_dim, mix, L, &layers);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ(layers.size(), L);
  EXPECT_EQ(pool->codebook_group, 0);
  kernels::cuda::PagedDecodeArgs args;
  args.q_heads = static_cast<int>(config().num_heads);
  for (uint32_t l = 0; l < L; ++l) {
    const int bits = l % 2 == 1 ? 0 : l % 4 == 2 ? 6 : 8;
    EXPECT_EQ(layers[l].codebook_group, bits == 0 ? 0 : 4) << "layer " << l;
    EXPECT_EQ(layers[l].codebook_bits, bits) << "layer " << l;
    EXPECT_EQ(kernels::cuda::RunsCodebookKernel(layers[l], args), bits != 0) << "layer " << l;
  }
  std::unique_ptr<ComputeBackend> gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const KvCacheOptions o{.codec = "strata:b3", .chunk_tokens = 16, .calibration = mix};
  std::unique_ptr<KvCache> want_cache = *cpu_->NewCache(o);
  absl::StatusOr<std::unique_ptr<KvCache>> got_cache = gpu->NewCache(o);
  ASSERT_TRUE(got_cache.ok()) << got_cache.status();
  const std::vector<uint32_t> prompt = Prompt(config(), 53, 9);
  absl::StatusOr<std::vector<float>> want = cpu_->Prefill(prompt, want_cache.get());
  absl::StatusOr<std::vector<float>> got = gpu->Prefill(prompt, got_cache->get());
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LT(RelErr(*got, *want), 5e-2);
  ExpectStepsFollowTheCpu(*gpu, want_cache.get(), got_cache->get(), Argmax(*got), 14, 5e-2);
  EXPECT_EQ((*got_cache)->blocks_per_layer(), 4u);
}

// The plugin the node binaries open (libstrata_cuda.so, model/cuda_plugin.h: lib/ beside this
// binary's folder, or beside it in the GPU bundle) makes the same backend as the one linked here:
// the same logits (bf16 weights, both) and blocks of the same sizes, through objects made on the
// plugin's side of the boundary.
TEST_F(CudaBackendTest, ThePluginMakesTheBackendLinkedHere) {
  const std::string path = DefaultCudaPluginPath();
  absl::StatusOr<BackendLoader> loader =
      OpenCudaPlugin(path, {.kv_pool_bytes = uint64_t{64} << 20, .max_sequences = 8});
  ASSERT_TRUE(loader.ok()) << loader.status();
  absl::StatusOr<std::unique_ptr<ComputeBackend>> plugged =
      (*loader)(Dir("models/strata-tiny"), *ParseDevice("cuda:0"));
  ASSERT_TRUE(plugged.ok()) << plugged.status();
  absl::StatusOr<std::unique_ptr<ComputeBackend>> linked = MakeCudaBackend(
      *host_,
      {.weights = WeightType::kBf16, .kv_pool_bytes = uint64_t{64} << 20, .max_sequences = 8});
  ASSERT_TRUE(linked.ok()) << linked.status();
  EXPECT_EQ((*plugged)->device().ToString(), "cuda:0");
  EXPECT_EQ((*plugged)->fingerprint(), (*linked)->fingerprint());
  const KvCacheOptions o{.codec = "kivi:k4v4:g16", .chunk_tokens = 16};
  absl::StatusOr<std::unique_ptr<KvCache>> a = (*plugged)->NewCache(o);
  absl::StatusOr<std::unique_ptr<KvCache>> b = (*linked)->NewCache(o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const std::vector<uint32_t> prompt = Prompt(config(), 41, 3);
  absl::StatusOr<std::vector<float>> got = (*plugged)->Prefill(prompt, a->get());
  absl::StatusOr<std::vector<float>> want = (*linked)->Prefill(prompt, b->get());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_LT(RelErr(*got, *want), 1e-4);
  EXPECT_EQ((*a)->tokens(), 41u);
  ASSERT_EQ((*a)->blocks_per_layer(), (*b)->blocks_per_layer());
  EXPECT_EQ((*a)->block_bytes(), (*b)->block_bytes());
  const uint32_t next = Argmax(*got);
  const absl::Span<const uint32_t> one[] = {{&next, 1}};
  KvCache* const ca[] = {a->get()};
  KvCache* const cb[] = {b->get()};
  absl::StatusOr<std::vector<std::vector<float>>> g = (*plugged)->StepBatch(one, ca);
  absl::StatusOr<std::vector<std::vector<float>>> w = (*linked)->StepBatch(one, cb);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_LT(RelErr((*g)[0], (*w)[0]), 1e-4);
}

// strata ppl --device cuda: perplexity over the GPU backend (windows chunk by chunk, KIVI pages and
// a full-precision window) follows the CPU's within the fp16 weights' rounding.
TEST_F(CudaBackendTest, PerplexityOnTheGpuFollowsTheCpu) {
  const std::vector<uint32_t> ids = Prompt(config(), 300, 11);
  for (const std::string codec : {"fp16", "kivi:k4v4:g16"}) {
    SCOPED_TRACE(codec);
    // Steps of a chunk (32 tokens) on top of a window of up to 8 + 31: spare rows for a chunk.
    absl::StatusOr<std::unique_ptr<ComputeBackend>> made =
        MakeCudaBackend(*host_, {.weights = WeightType::kFp16,
                                 .kv_pool_bytes = uint64_t{64} << 20,
                                 .max_sequences = 1,
                                 .max_step_tokens = 32});
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<ComputeBackend> gpu = *std::move(made);
    const KvCacheOptions o{.codec = codec, .chunk_tokens = 32, .window_tokens = 8};
    absl::StatusOr<PerplexityResult> want = Perplexity(*cpu_, ids, o, 128, 0);
    absl::StatusOr<PerplexityResult> got = Perplexity(*gpu, ids, o, 128, 0);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->scored, want->scored);
    EXPECT_EQ(got->block_bytes, want->block_bytes);
    EXPECT_NEAR(got->ppl, want->ppl, 0.01 * want->ppl);
  }
}

TEST_F(CudaBackendTest, APrefillNodesLayerHookShipsEachLayersBlocksAsTheyAreMade) {
  std::unique_ptr<ComputeBackend> gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  std::unique_ptr<KvCache> cache = *gpu->NewCache({.codec = "kivi:k4v4:g16", .chunk_tokens = 16});
  std::vector<std::vector<SharedBytes>> shipped(config().num_layers);
  const LayerHook hook = [&](uint32_t layer) -> absl::Status {
    absl::StatusOr<std::vector<SharedBytes>> blocks = cache->CompressLayer(layer);
    if (!blocks.ok()) return blocks.status();
    for (SharedBytes& b : *blocks) shipped[layer].push_back(std::move(b));
    return absl::OkStatus();
  };
  ASSERT_TRUE(gpu->Prefill(Prompt(config(), 40, 3), cache.get(), hook).ok());
  for (uint32_t l = 0; l < config().num_layers; ++l) {
    ASSERT_EQ(shipped[l].size(), 2u) << "layer " << l;
    ASSERT_EQ(cache->layer_blocks(l).size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      // The cache keeps the shipped blocks themselves (no second encoding).
      EXPECT_EQ(cache->layer_blocks(l)[i].data(), shipped[l][i].data()) << "layer " << l;
    }
  }
  // A hook's error ends the step and the cache is as before it.
  const LayerHook failing = [](uint32_t) { return absl::DataLossError("the wire broke"); };
  const absl::StatusOr<std::vector<float>> r =
      gpu->Prefill(Prompt(config(), 5, 4), cache.get(), failing);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(cache->tokens(), 40u);
}

TEST_F(CudaBackendTest, APrefixAdoptedFromTheCpuEnginesBlocksThenASuffixFollowsTheCpu) {
  std::unique_ptr<ComputeBackend> gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const KvCacheOptions o{.codec = "kivi:k4v4:g16", .chunk_tokens = 16};
  std::unique_ptr<KvCache> source = *cpu_->NewCache(o);
  const std::vector<uint32_t> prompt = Prompt(config(), 43, 9);
  ASSERT_TRUE(cpu_->Prefill(absl::MakeConstSpan(prompt).first(32), source.get()).ok());
  std::unique_ptr<KvCache> want_cache = *cpu_->NewCache(o);
  std::unique_ptr<KvCache> got_cache = *gpu->NewCache(o);
  for (KvCache* c : {want_cache.get(), got_cache.get()}) {
    for (size_t i = 0; i < 2; ++i) {
      for (uint32_t l = 0; l < config().num_layers; ++l) {
        ASSERT_TRUE(c->AdoptBlock(l, source->layer_blocks(l)[i]).ok());
      }
      ASSERT_TRUE(c->CommitAdopted().ok());
    }
  }
  EXPECT_EQ(got_cache->tokens(), 32u);
  const absl::Span<const uint32_t> suffix = absl::MakeConstSpan(prompt).subspan(32);
  absl::StatusOr<std::vector<float>> want = cpu_->Prefill(suffix, want_cache.get());
  absl::StatusOr<std::vector<float>> got = gpu->Prefill(suffix, got_cache.get());
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  // The prefix's blocks are the same bytes on both: only the suffix's arithmetic differs.
  EXPECT_LT(RelErr(*got, *want), 5e-3);
  EXPECT_EQ(got_cache->tokens(), 43u);
}

TEST_F(CudaBackendTest, AWindowMovedFromACpuCacheContinuesOnTheGpu) {
  std::unique_ptr<ComputeBackend> gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const KvCacheOptions o{.codec = "fp16", .chunk_tokens = 16};
  std::unique_ptr<KvCache> want_cache = *cpu_->NewCache(o);
  ASSERT_TRUE(cpu_->Prefill(Prompt(config(), 37, 5), want_cache.get()).ok());
  std::unique_ptr<KvCache> got_cache = *gpu->NewCache(o);
  for (size_t i = 0; i < want_cache->blocks_per_layer(); ++i) {
    for (uint32_t l = 0; l < config().num_layers; ++l) {
      ASSERT_TRUE(got_cache->AdoptBlock(l, want_cache->layer_blocks(l)[i]).ok());
    }
    ASSERT_TRUE(got_cache->CommitAdopted().ok());
  }
  for (uint32_t l = 0; l < config().num_layers; ++l) {
    const std::string w = want_cache->ExportWindow(l);
    ASSERT_TRUE(got_cache
                    ->ImportWindow(l, absl::MakeConstSpan(
                                          reinterpret_cast<const uint8_t*>(w.data()), w.size()))
                    .ok());
  }
  ASSERT_TRUE(got_cache->CommitWindow().ok());
  EXPECT_EQ(got_cache->tokens(), 37u);
  const uint32_t token = 11;
  const absl::Span<const uint32_t> one[] = {{&token, 1}};
  KvCache* const cpu_caches[] = {want_cache.get()};
  KvCache* const gpu_caches[] = {got_cache.get()};
  absl::StatusOr<std::vector<std::vector<float>>> w = cpu_->StepBatch(one, cpu_caches);
  absl::StatusOr<std::vector<std::vector<float>>> g = gpu->StepBatch(one, gpu_caches);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_LT(RelErr((*g)[0], (*w)[0]), 5e-3);
}

// Two sequences stepping together against each alone: the same up to the products' row blocking
// and the attention's splits, which the batch size chooses (not yet fixed per sequence).
TEST_F(CudaBackendTest, ABatchedStepMatchesEachSequenceAlone) {
  std::unique_ptr<ComputeBackend> gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const KvCacheOptions o{.codec = "kivi:k4v4:g16", .chunk_tokens = 16};
  std::vector<std::unique_ptr<KvCache>> together, alone;
  for (int i = 0; i < 2; ++i) {
    for (auto* set : {&together, &alone}) {
      set->push_back(*gpu->NewCache(o));
      ASSERT_TRUE(gpu->Prefill(Prompt(config(), 30 + 11 * i, 20 + i), set->back().get()).ok());
    }
  }
  const uint32_t tokens[] = {5, 9};
  const absl::Span<const uint32_t> both[] = {{&tokens[0], 1}, {&tokens[1], 1}};
  KvCache* const pair[] = {together[0].get(), together[1].get()};
  absl::StatusOr<std::vector<std::vector<float>>> batched = gpu->StepBatch(both, pair);
  ASSERT_TRUE(batched.ok()) << batched.status();
  for (int i = 0; i < 2; ++i) {
    const absl::Span<const uint32_t> one[] = {{&tokens[i], 1}};
    KvCache* const single[] = {alone[i].get()};
    absl::StatusOr<std::vector<std::vector<float>>> solo = gpu->StepBatch(one, single);
    ASSERT_TRUE(solo.ok()) << solo.status();
    // cuBLAS may pick other kernels for one row than for two (fp16 activations: an ulp).
    EXPECT_LT(RelErr((*batched)[i], (*solo)[0]), 1e-3) << "sequence " << i;
  }
}

TEST_F(CudaBackendTest, WhatTheGpuCannotServeIsRefusedNamingIt) {
  std::unique_ptr<ComputeBackend> gpu = Gpu(/*max_sequences=*/2);
  ASSERT_NE(gpu, nullptr);
  absl::StatusOr<std::unique_ptr<KvCache>> rot =
      gpu->NewCache({.codec = "kivi:k4v4:g16:rot", .chunk_tokens = 16});
  EXPECT_EQ(rot.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(rot.status().message().find("rotat"), std::string::npos) << rot.status();
  const KvCacheOptions o{.codec = "fp16", .chunk_tokens = 16};
  std::unique_ptr<KvCache> a = *gpu->NewCache(o);
  std::unique_ptr<KvCache> b = *gpu->NewCache(o);
  absl::StatusOr<std::unique_ptr<KvCache>> c = gpu->NewCache(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("slots"), std::string::npos) << c.status();
  b.reset();
  EXPECT_TRUE(gpu->NewCache(o).ok());  // its slot is free again
  // Another format than the pools hold, and a CPU cache.
  absl::StatusOr<std::unique_ptr<KvCache>> other =
      gpu->NewCache({.codec = "kivi:k4v4:g16", .chunk_tokens = 16});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  std::unique_ptr<KvCache> on_cpu = *cpu_->NewCache(o);
  const uint32_t token = 1;
  const absl::Span<const uint32_t> one[] = {{&token, 1}};
  KvCache* const caches[] = {on_cpu.get()};
  EXPECT_EQ(gpu->StepBatch(one, caches).status().code(), absl::StatusCode::kInvalidArgument);
  // More tokens in one step than the device's window has rows for.
  const std::vector<uint32_t> many(40, 3);
  const absl::Span<const uint32_t> big[] = {many};
  KvCache* const mine[] = {a.get()};
  absl::StatusOr<std::vector<std::vector<float>>> r = gpu->StepBatch(big, mine);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("max_step_tokens"), std::string::npos) << r.status();
  EXPECT_EQ(a->tokens(), 0u);
}

}  // namespace
}  // namespace strata::model::cuda
