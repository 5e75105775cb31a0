// The CUDA model against the CPU engine (its reference) on the bundled model and the tests/data
// fixtures: logits within the weight type's rounding, and greedy tokens equal wherever the CPU's
// choice is clear of that rounding; a decode step equal to the same token in one prefill;
// clear errors. GPU cases skip, saying why, without a device; the refusal without one runs
// everywhere.
#include "model/cuda/cuda_llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shared_bytes.h"
#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/cuda/block_pages.h"
#include "model/cuda/test_helpers.h"
#include "model/kv_cache.h"
#include "model/llama.h"

namespace strata::model::cuda {
namespace {

using testing_helpers::Dir;
using testing_helpers::Prompt;

TEST(CudaLlamaTest, WithoutAGpuUploadSaysWhy) {
  std::string why;
  if (HaveCudaDevice(&why)) GTEST_SKIP() << "a GPU is here: the refusal is not reachable";
  absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(Dir("models/strata-tiny"));
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<CudaLlamaModel>> m = CudaLlamaModel::Upload(**host, {});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find("no usable GPU"), std::string::npos) << m.status();
}

class CudaLlamaGpuTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  }
};

// Logits of a prompt on the GPU against the CPU's Forward, and greedy agreement where the CPU's
// top two are further apart than the largest difference seen.
void CheckAgainstCpu(const std::string& dir, WeightType type, bool exact_attention,
                     double rel_tolerance) {
  SCOPED_TRACE(absl::StrCat(dir, type == WeightType::kBf16 ? " bf16" : " fp16",
                            exact_attention ? ", exact attention" : ", tensor-core attention"));
  absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(dir);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<CudaLlamaModel>> gpu =
      CudaLlamaModel::Upload(**host, {.weights = type, .exact_attention = exact_attention});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const ModelConfig& c = (*host)->config();
  const std::vector<uint32_t> ids = Prompt(c, 45, 3);
  const std::vector<float> want = *(*host)->Forward(ids);
  auto kv = *(*gpu)->NewKv(64);
  std::vector<float> got;
  absl::StatusOr<uint32_t> next = (*gpu)->Step(ids, kv.get(), &got);
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_EQ(got.size(), want.size());
  double max_err = 0, max_abs = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    max_err = std::max(max_err, std::fabs(double{got[i]} - want[i]));
    max_abs = std::max(max_abs, std::fabs(double{want[i]}));
  }
  EXPECT_LT(max_err, rel_tolerance * std::max(1.0, max_abs)) << "max |error| " << max_err;
  std::printf("%s %s, %s attention: logits max |error| %.3g (largest |logit| %.3g)\n", dir.c_str(),
              type == WeightType::kBf16 ? "bf16" : "fp16",
              exact_attention ? "exact" : "tensor-core", max_err, max_abs);
  const uint32_t V = c.vocab_size;
  int clear = 0;
  for (size_t t = 0; t < ids.size(); ++t) {
    const float* w = &want[t * V];
    const float* g = &got[t * V];
    std::vector<float> sorted(w, w + V);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    if (sorted[0] - sorted[1] <= 2 * max_err) continue;  // a near tie: either choice is right
    ++clear;
    EXPECT_EQ(std::max_element(g, g + V) - g, std::max_element(w, w + V) - w) << "position " << t;
  }
  EXPECT_GT(clear, 0);
  // The returned token is the argmax of the last row of the same logits.
  const float* last = &got[(ids.size() - 1) * V];
  EXPECT_EQ(*next, static_cast<uint32_t>(std::max_element(last, last + V) - last));
}

TEST_F(CudaLlamaGpuTest, LogitsTrackTheCpuEngineOnEveryBundledCheckpoint) {
  for (const char* rel : {"models/strata-tiny", "models/strata-small", "tests/data/tiny-llama",
                          "tests/data/tiny-qwen2"}) {
    if (!std::ifstream(Dir(rel) + "/config.json")) {  // scripts/lean_tree.sh hides strata-small
      std::cout << "skipped " << rel << ": not in this working tree\n";
      continue;
    }
    CheckAgainstCpu(Dir(rel), WeightType::kFp16, /*exact_attention=*/true, 5e-3);
    CheckAgainstCpu(Dir(rel), WeightType::kBf16, /*exact_attention=*/true, 4e-2);
    // The tensor cores' attention rounds Q, K, V and P to fp16 besides.
    CheckAgainstCpu(Dir(rel), WeightType::kFp16, /*exact_attention=*/false, 1e-2);
    CheckAgainstCpu(Dir(rel), WeightType::kBf16, /*exact_attention=*/false, 4e-2);
  }
}

// A prompt then one decode step gives the logits of the same tokens run as one prompt.
TEST_F(CudaLlamaGpuTest, ADecodeStepEqualsTheSameTokenInAPrefill) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(Dir("models/strata-tiny"));
  ASSERT_TRUE(host.ok()) << host.status();
  auto gpu = *CudaLlamaModel::Upload(**host, {.weights = WeightType::kFp16});
  const std::vector<uint32_t> ids = Prompt(gpu->config(), 30, 11);
  auto whole = *gpu->NewKv(32);
  std::vector<float> all;
  ASSERT_TRUE(gpu->Step(ids, whole.get(), &all).ok());
  auto split = *gpu->NewKv(32);
  ASSERT_TRUE(gpu->Step(absl::MakeConstSpan(ids).first(29), split.get()).ok());
  EXPECT_EQ(split->tokens(), 29u);
  std::vector<float> one;
  ASSERT_TRUE(gpu->Step(absl::MakeConstSpan(ids).last(1), split.get(), &one).ok());
  EXPECT_EQ(split->tokens(), 30u);
  const uint32_t V = gpu->config().vocab_size;
  double max_err = 0, max_abs = 0;
  for (uint32_t i = 0; i < V; ++i) {
    max_err = std::max(max_err, std::fabs(double{one[i]} - all[29 * V + i]));
    max_abs = std::max(max_abs, std::fabs(double{all[29 * V + i]}));
  }
  EXPECT_LT(max_err, 1e-3 * std::max(1.0, max_abs));  // GEMM row blocking only
}

// Greedy generation on the GPU equals the CPU's greedy generation (both at full precision) where
// the CPU's choices are clear.
TEST_F(CudaLlamaGpuTest, GreedyGenerationFollowsTheCpu) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(Dir("tests/data/tiny-llama"));
  ASSERT_TRUE(host.ok()) << host.status();
  auto gpu = *CudaLlamaModel::Upload(**host, {.weights = WeightType::kFp16});
  std::vector<uint32_t> ids = Prompt(gpu->config(), 12, 5);
  auto kv = *gpu->NewKv(64);
  absl::StatusOr<uint32_t> next = gpu->Step(ids, kv.get());
  ASSERT_TRUE(next.ok()) << next.status();
  const uint32_t V = gpu->config().vocab_size;
  for (int i = 0; i < 16; ++i) {
    const std::vector<float> cpu = *(*host)->Forward(ids);
    const float* last = &cpu[(ids.size() - 1) * V];
    std::vector<float> sorted(last, last + V);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    const uint32_t want = static_cast<uint32_t>(std::max_element(last, last + V) - last);
    if (sorted[0] - sorted[1] > 1e-2 * std::max(1.0f, std::fabs(sorted[0]))) {
      EXPECT_EQ(*next, want) << "token " << i;
    }
    ids.push_back(*next);  // both continue from the GPU's choice
    next = gpu->Step({&ids.back(), 1}, kv.get());
    ASSERT_TRUE(next.ok()) << next.status();
  }
}

// The serving path's decode: sequences whose prefixes the CPU engine prefilled (its cache's
// blocks copied to the device as they are: the pages) and whose partial chunks are the windows
// (fp16 on the device), one token each through DecodePaged, against the CPU engine's Step over
// the same caches. fp16 and KIVI blocks, two sequences of different lengths, windows in
// reversed slots.
TEST_F(CudaLlamaGpuTest, APagedDecodeStepOverTheCpuEnginesBlocksFollowsTheCpu) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(Dir("models/strata-tiny"));
  ASSERT_TRUE(host.ok()) << host.status();
  auto gpu = *CudaLlamaModel::Upload(**host, {.weights = WeightType::kFp16});
  const ModelConfig& c = gpu->config();
  constexpr uint32_t kChunk = 16;
  const std::vector<uint32_t> lengths = {53, 37};  // 3 and 2 blocks, windows of 5 and 5 tokens
  for (const char* codec : {"fp16", "kivi:k4v4:g16"}) {
    SCOPED_TRACE(codec);
    absl::StatusOr<kernels::cuda::PagedKvLayout> layout =
        kernels::cuda::PageLayoutForCodec(codec, kChunk, c.num_kv_heads, c.head_dim);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const int batch = static_cast<int>(lengths.size());
    std::vector<std::unique_ptr<SequenceKvCache>> caches;
    std::vector<uint32_t> next_tokens;
    for (int b = 0; b < batch; ++b) {
      caches.push_back(*(*host)->NewCache({.codec = codec, .chunk_tokens = kChunk}));
      const std::vector<uint32_t> ids = Prompt(c, lengths[b], 17 + b);
      ASSERT_TRUE((*host)->Prefill(ids, caches.back().get()).ok());
      next_tokens.push_back(3 + b);
    }
    const int max_pages = 4, max_window = kChunk;
    const size_t page = layout->PageBytes();
    const uint32_t L = c.num_layers, KH = c.num_kv_heads, D = c.head_dim;
    // The pool: every block of every layer; per layer a block table [batch][max_pages].
    std::vector<uint8_t> pool;
    std::vector<std::vector<int32_t>> tables(L, std::vector<int32_t>(batch * max_pages, 0));
    std::vector<int32_t> counts(batch);
    // Windows [layers][slots][kv_heads][max_window][D] fp16, sequence b in slot batch - 1 - b.
    std::vector<__half> wk(size_t(L) * batch * KH * max_window * D), wv(wk.size());
    std::vector<int32_t> slots(batch), lens(batch), positions(batch);
    for (int b = 0; b < batch; ++b) {
      const SequenceKvCache& cache = *caches[b];
      counts[b] = static_cast<int32_t>(cache.blocks_per_layer());
      slots[b] = batch - 1 - b;
      lens[b] = static_cast<int32_t>(cache.window_tokens());
      positions[b] = static_cast<int32_t>(cache.tokens());
      for (uint32_t l = 0; l < L; ++l) {
        for (size_t i = 0; i < cache.layer_blocks(l).size(); ++i) {
          const SharedBytes& blk = cache.layer_blocks(l)[i];
          ASSERT_LE(blk.size(), page);
          tables[l][b * max_pages + i] = static_cast<int32_t>(pool.size() / page);
          pool.resize(pool.size() + page, 0);
          std::memcpy(pool.data() + pool.size() - page, blk.data(), blk.size());
        }
        const std::string w = cache.ExportWindow(l);
        const float* wf = reinterpret_cast<const float*>(w.data() + 32);
        const size_t kv_floats = size_t(lens[b]) * KH * D;
        for (int t = 0; t < lens[b]; ++t) {
          for (uint32_t h = 0; h < KH; ++h) {
            for (uint32_t d = 0; d < D; ++d) {
              const size_t src = (size_t(t) * KH + h) * D + d;
              const size_t dst =
                  (((size_t(l) * batch + slots[b]) * KH + h) * max_window + t) * D + d;
              wk[dst] = __float2half_rn(wf[src]);
              wv[dst] = __float2half_rn(wf[kv_floats + src]);
            }
          }
        }
      }
    }
    void *d_pool, *d_wk, *d_wv, *d_counts, *d_tables;
    ASSERT_EQ(cudaMalloc(&d_pool, pool.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_wk, wk.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_wv, wv.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_counts, batch * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_tables, size_t(L) * batch * max_pages * 4), cudaSuccess);
    cudaMemcpy(d_pool, pool.data(), pool.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_wk, wk.data(), wk.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(d_wv, wv.data(), wv.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(d_counts, counts.data(), batch * 4, cudaMemcpyHostToDevice);
    std::vector<const int32_t*> table_ptrs;
    for (uint32_t l = 0; l < L; ++l) {
      int32_t* t = static_cast<int32_t*>(d_tables) + size_t(l) * batch * max_pages;
      cudaMemcpy(t, tables[l].data(), tables[l].size() * 4, cudaMemcpyHostToDevice);
      table_ptrs.push_back(t);
    }
    CudaLlamaModel::PagedStep step;
    step.tokens = next_tokens;
    step.positions = positions;
    step.window_slots = slots;
    step.window_lens = lens;
    step.layout = *layout;
    step.pages = static_cast<const uint8_t*>(d_pool);
    step.block_tables = table_ptrs;
    step.max_pages = max_pages;
    step.page_counts = static_cast<const int32_t*>(d_counts);
    step.max_pages_in_batch = *std::max_element(counts.begin(), counts.end());
    step.window_k = static_cast<__half*>(d_wk);
    step.window_v = static_cast<__half*>(d_wv);
    step.slots = batch;
    step.max_window = max_window;
    std::vector<float> got;
    const uint64_t captures = gpu->graph_captures(), replays = gpu->graph_replays();
    absl::StatusOr<std::vector<uint32_t>> next = gpu->DecodePaged(step, &got);
    // The same step again replays the captured graph (the window's append rewrites the same
    // row), and a model that launches each kernel itself gives the same bits.
    std::vector<float> replayed, eager;
    absl::StatusOr<std::vector<uint32_t>> again = gpu->DecodePaged(step, &replayed);
    auto plain =
        *CudaLlamaModel::Upload(**host, {.weights = WeightType::kFp16, .cuda_graphs = false});
    absl::StatusOr<std::vector<uint32_t>> eager_next = plain->DecodePaged(step, &eager);
    for (void* p : {d_pool, d_wk, d_wv, d_counts, d_tables}) cudaFree(p);
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(eager_next.ok()) << eager_next.status();
    EXPECT_EQ(gpu->graph_captures(), captures + 1);
    EXPECT_EQ(gpu->graph_replays(), replays + 1);
    EXPECT_EQ(plain->graph_captures() + plain->graph_replays(), 0u);
    EXPECT_TRUE(replayed == got) << "the replayed graph's logits differ";
    EXPECT_TRUE(eager == got) << "the graph's logits differ from the kernels launched one by one";
    EXPECT_EQ(*again, *next);
    EXPECT_EQ(*eager_next, *next);
    const uint32_t V = c.vocab_size;
    ASSERT_EQ(got.size(), size_t(batch) * V);
    for (int b = 0; b < batch; ++b) {
      const std::vector<float> want = *(*host)->Step({&next_tokens[b], 1}, caches[b].get());
      double max_err = 0, max_abs = 0;
      for (uint32_t i = 0; i < V; ++i) {
        max_err = std::max(max_err, std::fabs(double{got[b * V + i]} - want[i]));
        max_abs = std::max(max_abs, std::fabs(double{want[i]}));
      }
      // fp16 weights and activations, the fp16 window: the same bound as the prefill's.
      EXPECT_LT(max_err, 5e-3 * std::max(1.0, max_abs)) << "sequence " << b;
      std::vector<float> sorted(want);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      if (sorted[0] - sorted[1] > 2 * max_err) {
        EXPECT_EQ((*next)[b],
                  static_cast<uint32_t>(std::max_element(want.begin(), want.end()) - want.begin()))
            << "sequence " << b;
      }
    }
  }
}

TEST_F(CudaLlamaGpuTest, BadInputIsRefusedNamingIt) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> host = LlamaModel::Load(Dir("models/strata-tiny"));
  ASSERT_TRUE(host.ok()) << host.status();
  auto gpu = *CudaLlamaModel::Upload(**host, {});
  auto kv = *gpu->NewKv(4);
  const uint32_t beyond = gpu->config().vocab_size;
  absl::StatusOr<uint32_t> r = gpu->Step({&beyond, 1}, kv.get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("vocabulary"), std::string::npos) << r.status();
  const std::vector<uint32_t> five(5, 1);
  r = gpu->Step(five, kv.get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("capacity"), std::string::npos) << r.status();
  EXPECT_EQ(kv->tokens(), 0u);
  EXPECT_EQ(gpu->NewKv(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu->NewKv(1u << 31).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaLlamaModel::Upload(**host, {.device = 1 << 20}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace strata::model::cuda
