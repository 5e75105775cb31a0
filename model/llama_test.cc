#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "common/block_reader.h"
#include "kernels/block_operands.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

// Holds the engine to the logits PyTorch computed for the same (fp16-rounded) weights.
void CheckAgainstFixture(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> fx =
      SafetensorsFile::Open(dir + "/fixture.safetensors");
  ASSERT_TRUE(fx.ok()) << fx.status();
  const uint32_t vocab = (*model)->config().vocab_size;
  ASSERT_NE((*fx)->Find("ids.0"), nullptr);
  for (int s = 0; (*fx)->Find(absl::StrCat("ids.", s)) != nullptr; ++s) {
    const TensorInfo* ids_t = (*fx)->Find(absl::StrCat("ids.", s));
    const TensorInfo* logits_t = (*fx)->Find(absl::StrCat("logits.", s));
    ASSERT_NE(logits_t, nullptr);
    std::vector<int32_t> ids32(ids_t->numel());
    std::memcpy(ids32.data(), (*fx)->Data(*ids_t).data(), ids32.size() * 4);
    const std::vector<uint32_t> ids(ids32.begin(), ids32.end());
    std::vector<float> want(logits_t->numel());
    std::memcpy(want.data(), (*fx)->Data(*logits_t).data(), want.size() * 4);
    ASSERT_EQ(want.size(), ids.size() * vocab);
    std::vector<LayerKv> kv;
    absl::StatusOr<std::vector<float>> got = (*model)->Forward(ids, &kv);
    ASSERT_TRUE(got.ok()) << got.status();
    double max_err = 0, max_abs = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_err = std::max(max_err, std::fabs(double{(*got)[i]} - want[i]));
      max_abs = std::max(max_abs, std::fabs(double{want[i]}));
    }
    EXPECT_LT(max_err, 2e-3 * std::max(1.0, max_abs)) << dir << " sequence " << s;
    for (size_t t = 0; t < ids.size(); ++t) {  // greedy argmax agrees at every position
      const float* g = &(*got)[t * vocab];
      const float* w = &want[t * vocab];
      EXPECT_EQ(std::max_element(g, g + vocab) - g, std::max_element(w, w + vocab) - w)
          << dir << " sequence " << s << " position " << t;
    }
    ASSERT_EQ(kv.size(), (*model)->config().num_layers);
    EXPECT_EQ(kv[0].k.size(),
              ids.size() * (*model)->config().num_kv_heads * (*model)->config().head_dim);
  }
}

TEST(LlamaModelTest, MatchesPyTorchLogitsOnTheLlamaShapedTestModel) {
  CheckAgainstFixture(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
}

TEST(LlamaModelTest, MatchesPyTorchLogitsOnTheQwen2ShapedTestModel) {
  CheckAgainstFixture(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-qwen2"));
}

TEST(LlamaModelTest, MatchesPyTorchLogitsOnTheBundledModel) {
  const std::string dir = absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny");
  if (!std::ifstream(dir + "/fixture.safetensors")) {
    GTEST_SKIP() << "skipped: no bundled model in " << dir;
  }
  CheckAgainstFixture(dir);
}

TEST(LlamaModelTest, BadInputsAreRejected) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  ASSERT_TRUE(model.ok());
  const std::vector<uint32_t> bad = {1, 99999};
  EXPECT_EQ((*model)->Forward(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->Forward({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LlamaModel::Load("/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::model

namespace strata::model {
namespace {

double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::fabs(double{a[i]} - b[i]));
    scale = std::max(scale, std::fabs(double{b[i]}));
  }
  return err / std::max(1.0, scale);
}

TEST(LlamaModelTest, StepwiseDecodeWithAnFp16CacheMatchesTheFullForward) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 70; ++i) ids.push_back((i * 37 + 11) % model->config().vocab_size);
  const std::vector<float> full = *model->Forward(ids);
  // Prefill 20 tokens, then decode one token at a time; 16-token chunks get compressed to fp16
  // blocks on the way.
  auto cache = *model->NewCache({.codec = "fp16", .chunk_tokens = 16});
  const uint32_t vocab = model->config().vocab_size;
  std::vector<float> stepped = *model->Step(absl::MakeSpan(ids).first(20), cache.get());
  for (size_t t = 20; t < ids.size(); ++t) {
    std::vector<float> l = *model->Step(absl::MakeSpan(ids).subspan(t, 1), cache.get());
    stepped.insert(stepped.end(), l.begin(), l.end());
  }
  EXPECT_EQ(cache->tokens(), 70u);
  EXPECT_EQ(cache->blocks_per_layer(), 4u);  // 64 tokens in blocks, 6 in the window
  EXPECT_EQ(cache->window_tokens(), 6u);
  ASSERT_EQ(stepped.size(), full.size());
  EXPECT_LT(MaxRelDiff(stepped, full), 5e-3);  // fp16 KV rounding only
  for (size_t t = 0; t < ids.size(); ++t) {
    const float* a = &stepped[t * vocab];
    const float* b = &full[t * vocab];
    EXPECT_EQ(std::max_element(a, a + vocab) - a, std::max_element(b, b + vocab) - b) << t;
  }
}

TEST(LlamaModelTest, BatchedDecodeMatchesEachSequenceAlone) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-qwen2"));
  const uint32_t vocab = model->config().vocab_size;
  const KvCacheOptions opts{.codec = "kivi:k4v4:g8", .chunk_tokens = 8};
  // Three sequences of different lengths, prefilled and then decoded together for 12 steps.
  std::vector<std::vector<uint32_t>> prompts = {
      {1, 2, 3}, {7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, {42}};
  std::vector<std::unique_ptr<SequenceKvCache>> batched, alone;
  for (size_t i = 0; i < prompts.size(); ++i) {
    batched.push_back(*model->NewCache(opts));
    alone.push_back(*model->NewCache(opts));
  }
  std::vector<absl::Span<const uint32_t>> spans(prompts.begin(), prompts.end());
  std::vector<SequenceKvCache*> ptrs = {batched[0].get(), batched[1].get(), batched[2].get()};
  auto first = model->StepBatch(spans, ptrs);
  ASSERT_TRUE(first.ok()) << first.status();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<float> solo = *model->Step(prompts[i], alone[i].get());
    EXPECT_LT(MaxRelDiff((*first)[i], solo), 1e-5) << i;
  }
  for (uint32_t step = 0; step < 12; ++step) {
    std::vector<uint32_t> next = {step % vocab, (step * 3 + 1) % vocab, (step * 7 + 2) % vocab};
    std::vector<absl::Span<const uint32_t>> one = {{&next[0], 1}, {&next[1], 1}, {&next[2], 1}};
    auto out = model->StepBatch(one, ptrs);
    ASSERT_TRUE(out.ok());
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<float> solo = *model->Step(one[i], alone[i].get());
      EXPECT_LT(MaxRelDiff((*out)[i], solo), 1e-5) << "step " << step << " seq " << i;
    }
  }
  EXPECT_EQ(batched[1]->blocks_per_layer(), alone[1]->blocks_per_layer());
  EXPECT_EQ(batched[1]->tokens(), 22u);
  SequenceKvCache* twice[] = {batched[0].get(), batched[0].get()};
  std::vector<absl::Span<const uint32_t>> two = {spans[0], spans[0]};
  EXPECT_EQ(model->StepBatch(two, twice).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LlamaModelTest, SuffixPrefillOverAnAdoptedCompressedPrefixMatchesRecomputing) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-qwen2"));
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 48; ++i) ids.push_back((i * 91 + 5) % model->config().vocab_size);
  const KvCacheOptions opts{.codec = "kivi:k8v8:g16", .chunk_tokens = 16};
  // Request A computes the 32-token prefix; its blocks are what a store would keep.
  auto a = *model->NewCache(opts);
  ASSERT_TRUE(model->Step(absl::MakeSpan(ids).first(32), a.get()).ok());
  ASSERT_EQ(a->blocks_per_layer(), 2u);
  // Request B adopts copies of those blocks and prefills only the suffix.
  auto b = *model->NewCache(opts);
  for (uint32_t l = 0; l < model->config().num_layers; ++l) {
    for (const AlignedBuffer& blk : a->layer_blocks(l)) {
      AlignedBuffer copy(blk.size());
      std::memcpy(copy.data(), blk.data(), blk.size());
      ASSERT_TRUE(b->AdoptBlock(l, std::move(copy)).ok());
    }
  }
  ASSERT_TRUE(b->CommitAdopted().ok());
  EXPECT_EQ(b->tokens(), 32u);
  const std::vector<float> reused = *model->Step(absl::MakeSpan(ids).subspan(32), b.get());
  // The same suffix on top of request A's own cache gives identical logits.
  const std::vector<float> direct = *model->Step(absl::MakeSpan(ids).subspan(32), a.get());
  EXPECT_EQ(reused, direct);
  // And close to the uncompressed model (8-bit KIVI).
  const std::vector<float> full = *model->Forward(ids);
  const std::vector<float> tail(full.end() - reused.size(), full.end());
  EXPECT_LT(MaxRelDiff(reused, tail), 5e-2);
  // Blocks that are not this cache's next chunk, or of another codec, are refused.
  auto c = *model->NewCache(opts);
  AlignedBuffer second(a->layer_blocks(0)[1].size());
  std::memcpy(second.data(), a->layer_blocks(0)[1].data(), second.size());
  EXPECT_EQ(c->AdoptBlock(0, std::move(second)).code(), absl::StatusCode::kInvalidArgument);
  auto d = *model->NewCache({.codec = "kivi:k4v4:g16", .chunk_tokens = 16});
  AlignedBuffer first(a->layer_blocks(0)[0].size());
  std::memcpy(first.data(), a->layer_blocks(0)[0].data(), first.size());
  EXPECT_EQ(d->AdoptBlock(0, std::move(first)).code(), absl::StatusCode::kInvalidArgument);
}

// Sinks ride in chunk 0's block at fp16, the window keeps at least window_tokens at full
// precision, and ZipCache gets the chunk's queries for its probes: the cached model stays close
// to the uncompressed one.
TEST(LlamaModelTest, SinksWindowAndZipCacheInTheCache) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 100; ++i) ids.push_back((i * 53 + 7) % model->config().vocab_size);
  const std::vector<float> full = *model->Forward(ids);
  for (const char* codec : {"kivi:k4v4:g16:sink4", "zipcache:k4v4:h8:s20:sink4"}) {
    auto cache = *model->NewCache({.codec = codec, .chunk_tokens = 16, .window_tokens = 24});
    std::vector<float> got = *model->Step(absl::MakeSpan(ids).first(60), cache.get());
    for (size_t t = 60; t < ids.size(); ++t) {
      std::vector<float> l = *model->Step(absl::MakeSpan(ids).subspan(t, 1), cache.get());
      got.insert(got.end(), l.begin(), l.end());
    }
    // 100 tokens, at least 24 in the window: 4 chunks of 16 compressed, 36 in the window.
    EXPECT_EQ(cache->blocks_per_layer(), 4u) << codec;
    EXPECT_EQ(cache->window_tokens(), 36u) << codec;
    const BlockView first = *BlockView::Parse(cache->layer_blocks(0)[0].span());
    const kernels::PreparedBlock ops = *kernels::PrepareBlock(first);
    EXPECT_EQ(ops.parts.front().spec.id, CodecId::kFp16) << codec;
    EXPECT_EQ(ops.part_tokens.front(), (std::vector<uint32_t>{0, 1, 2, 3})) << codec;
    EXPECT_LT(MaxRelDiff(got, full), 0.1) << codec;
  }
}

}  // namespace
}  // namespace strata::model
