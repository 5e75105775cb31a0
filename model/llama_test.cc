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
#include "common/status_macros.h"
#include "kernels/block_operands.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

// A block's bytes in a buffer of their own, as a store or a peer would hand them over.
AlignedBuffer Copy(const SharedBytes& b) {
  AlignedBuffer copy(b.size());
  std::memcpy(copy.data(), b.data(), b.size());
  return copy;
}

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

// The second bundled model (head dim 128, GQA 4, RoPE theta 500000: the attention of a modern
// LLM), against the logits PyTorch computed from its exported bf16 weights.
TEST(LlamaModelTest, MatchesPyTorchLogitsOnTheSecondBundledModel) {
  const std::string dir = absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-small");
  if (!std::ifstream(dir + "/fixture.safetensors")) {
    GTEST_SKIP() << "skipped: no " << dir << " (scripts/lean_tree.sh hides it)";
  }
  CheckAgainstFixture(dir);
}

// The fingerprint read from the headers alone is the loaded model's, and it tells checkpoints
// apart; a folder that is no checkpoint is an error naming it.
TEST(LlamaModelTest, TheFingerprintNeedsNoWeights) {
  std::vector<uint64_t> seen;
  for (const char* rel :
       {"/models/strata-tiny", "/tests/data/tiny-llama", "/tests/data/tiny-qwen2"}) {
    const std::string dir = absl::StrCat(STRATA_SOURCE_DIR, rel);
    absl::StatusOr<uint64_t> fp = ModelFingerprint(dir);
    ASSERT_TRUE(fp.ok()) << fp.status();
    EXPECT_EQ(*fp, (*LlamaModel::Load(dir))->fingerprint()) << rel;
    EXPECT_EQ(std::count(seen.begin(), seen.end(), *fp), 0) << rel;
    seen.push_back(*fp);
  }
  absl::StatusOr<uint64_t> none = ModelFingerprint(absl::StrCat(STRATA_SOURCE_DIR, "/docs"));
  EXPECT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("docs"), std::string::npos) << none.status();
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
    for (const SharedBytes& blk : a->layer_blocks(l)) {
      ASSERT_TRUE(b->AdoptBlock(l, Copy(blk)).ok());
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
  EXPECT_EQ(c->AdoptBlock(0, Copy(a->layer_blocks(0)[1])).code(),
            absl::StatusCode::kInvalidArgument);
  auto d = *model->NewCache({.codec = "kivi:k4v4:g16", .chunk_tokens = 16});
  EXPECT_EQ(d->AdoptBlock(0, Copy(a->layer_blocks(0)[0])).code(),
            absl::StatusCode::kInvalidArgument);
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

std::vector<uint32_t> TestIds(const LlamaModel& model, uint32_t n, uint32_t mul, uint32_t add) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < n; ++i) ids.push_back((i * mul + add) % model.config().vocab_size);
  return ids;
}

// Serving's prefill: each chunk is compressed before later tokens attend to it, so a prefix
// adopted from elsewhere gives exactly what computing it gives — blocks and logits alike.
TEST(LlamaModelTest, ChunkAlignedPrefillIsTheSameWhetherThePrefixIsAdoptedOrComputed) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  const std::vector<uint32_t> ids = TestIds(*model, 70, 37, 11);
  for (const char* codec : {"kivi:k2v2:g16", "gear:k2v2:kcvt:r2:s2", "fp16", "kivi:k2v2:g16:rot"}) {
    const KvCacheOptions opts{.codec = codec, .chunk_tokens = 16};
    auto a = *model->NewCache(opts);
    // Computed whole: 4 full chunks and a 6-token tail.
    const std::vector<float> whole = *model->Prefill(ids, a.get());
    ASSERT_EQ(whole.size(), model->config().vocab_size);
    ASSERT_EQ(a->blocks_per_layer(), 4u);
    EXPECT_EQ(a->window_tokens(), 6u);
    // A second request computes only a 2-chunk prefix, a third adopts that prefix's blocks and
    // computes the rest: same blocks for the chunks after it, same logits.
    auto b = *model->NewCache(opts);
    ASSERT_TRUE(model->Prefill(absl::MakeSpan(ids).first(40), b.get()).ok());
    auto c = *model->NewCache(opts);
    for (uint32_t l = 0; l < model->config().num_layers; ++l) {
      for (uint32_t k = 0; k < 2; ++k) ASSERT_TRUE(c->AdoptBlock(l, Copy(b->layer_blocks(l)[k])).ok());
    }
    ASSERT_TRUE(c->CommitAdopted().ok());
    const std::vector<float> reused = *model->Prefill(absl::MakeSpan(ids).subspan(32), c.get());
    EXPECT_EQ(reused, whole) << codec;
    for (uint32_t l = 0; l < model->config().num_layers; ++l) {
      for (uint32_t k = 0; k < 4; ++k) {
        const auto x = a->layer_blocks(l)[k].span(), y = c->layer_blocks(l)[k].span();
        EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end()))
            << codec << " layer " << l << " chunk " << k;
      }
    }
  }
}

// The rotation stage (`rot`, kernels/rotation.h): the cache holds K and V rotated and the model
// rotates queries and un-rotates outputs, so decoding over rotated 8-bit blocks follows the full
// forward as closely as over unrotated ones; the blocks themselves hold other codes.
TEST(LlamaModelTest, DecodingOverRotatedBlocksFollowsTheFullForward) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  const std::vector<uint32_t> ids = TestIds(*model, 70, 37, 11);
  const std::vector<float> full = *model->Forward(ids);
  auto decode = [&](const char* codec, std::unique_ptr<SequenceKvCache>* out) {
    auto cache = *model->NewCache({.codec = codec, .chunk_tokens = 16});
    std::vector<float> stepped = *model->Step(absl::MakeSpan(ids).first(20), cache.get());
    for (size_t t = 20; t < ids.size(); ++t) {
      std::vector<float> l = *model->Step(absl::MakeSpan(ids).subspan(t, 1), cache.get());
      stepped.insert(stepped.end(), l.begin(), l.end());
    }
    EXPECT_EQ(cache->blocks_per_layer(), 4u);
    *out = std::move(cache);
    return MaxRelDiff(stepped, full);
  };
  std::unique_ptr<SequenceKvCache> plain, rotated;
  const double plain_err = decode("kivi:k8v8:g16", &plain);
  const double rotated_err = decode("kivi:k8v8:g16:rot", &rotated);
  EXPECT_LT(rotated_err, 0.05);
  EXPECT_LT(rotated_err, 3 * plain_err + 1e-3) << plain_err;
  ASSERT_NE(rotated->rotation(0), nullptr);
  EXPECT_EQ(plain->rotation(0), nullptr);
  const auto x = plain->layer_blocks(0)[0].span(), y = rotated->layer_blocks(0)[0].span();
  EXPECT_FALSE(std::equal(x.begin(), x.end(), y.begin(), y.end()));
  // A head dim the transform does not take is refused when the cache is made.
  EXPECT_EQ(
      SequenceKvCache::Create({.codec = "int8:rot", .chunk_tokens = 16}, 2, 2, 48).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// The per-layer hook sees each layer done, and the blocks CompressLayer makes there are the ones
// the cache keeps (no second encode, the same bytes).
TEST(LlamaModelTest, LayerHookCompressesEachLayerAsItCompletes) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  const std::vector<uint32_t> ids = TestIds(*model, 40, 29, 3);
  auto cache = *model->NewCache({.codec = "kivi:k4v4:g16", .chunk_tokens = 16});
  std::vector<std::vector<SharedBytes>> shipped(model->config().num_layers);
  std::vector<uint32_t> order;
  const LayerHook hook = [&](uint32_t layer) -> absl::Status {
    order.push_back(layer);
    STRATA_ASSIGN_OR_RETURN(std::vector<SharedBytes> blocks, cache->CompressLayer(layer));
    for (SharedBytes& b : blocks) shipped[layer].push_back(std::move(b));
    return absl::OkStatus();
  };
  ASSERT_TRUE(model->Prefill(ids, cache.get(), hook).ok());
  // Three pieces (16, 16, 8 tokens) of every layer, in layer order each time.
  const uint32_t L = model->config().num_layers;
  ASSERT_EQ(order.size(), 3u * L);
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], i % L);
  for (uint32_t l = 0; l < L; ++l) {
    ASSERT_EQ(shipped[l].size(), 2u);
    for (uint32_t k = 0; k < 2; ++k) {
      EXPECT_EQ(shipped[l][k].data(), cache->layer_blocks(l)[k].data()) << "a copy, not the block";
    }
  }
  // A failing hook ends the step and leaves the cache as before it.
  auto other = *model->NewCache({.codec = "kivi:k4v4:g16", .chunk_tokens = 16});
  const LayerHook fail = [](uint32_t layer) {
    return layer == 1 ? absl::CancelledError("stop") : absl::OkStatus();
  };
  EXPECT_EQ(model->Prefill(ids, other.get(), fail).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(other->tokens(), 0u);
  EXPECT_EQ(other->blocks_per_layer(), 0u);
}

// A sequence moves to another node as its blocks plus its window, and continues there exactly.
TEST(LlamaModelTest, ExportedWindowContinuesTheSequenceExactlyElsewhere) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  const std::vector<uint32_t> ids = TestIds(*model, 45, 17, 5);
  for (const char* codec : {"kivi:k2v2:g16", "zipcache:k4v4:h8:s20"}) {
    const KvCacheOptions opts{.codec = codec, .chunk_tokens = 16};
    auto a = *model->NewCache(opts);
    ASSERT_TRUE(model->Prefill(ids, a.get()).ok());
    auto b = *model->NewCache(opts);
    const uint32_t L = model->config().num_layers;
    for (uint32_t l = 0; l < L; ++l) {
      for (const SharedBytes& blk : a->layer_blocks(l)) ASSERT_TRUE(b->AdoptBlock(l, blk, true).ok());
    }
    ASSERT_TRUE(b->CommitAdopted().ok());
    for (uint32_t l = 0; l < L; ++l) {
      const std::string w = a->ExportWindow(l);
      ASSERT_TRUE(b->ImportWindow(l, {reinterpret_cast<const uint8_t*>(w.data()), w.size()}).ok());
    }
    ASSERT_TRUE(b->CommitWindow().ok());
    EXPECT_EQ(b->tokens(), a->tokens());
    EXPECT_EQ(b->window_tokens(), 13u);
    for (uint32_t step = 0; step < 20; ++step) {
      const uint32_t t = (step * 7 + 1) % model->config().vocab_size;
      const std::vector<float> x = *model->Step({&t, 1}, a.get());
      const std::vector<float> y = *model->Step({&t, 1}, b.get());
      ASSERT_EQ(x, y) << codec << " step " << step;
    }
  }
}

TEST(LlamaModelTest, ImportWindowRefusesBytesThatAreNotAWindowOfThisCache) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  const std::vector<uint32_t> ids = TestIds(*model, 20, 13, 2);
  auto a = *model->NewCache({.codec = "fp16", .chunk_tokens = 16});
  ASSERT_TRUE(model->Prefill(ids, a.get()).ok());
  const std::string w = a->ExportWindow(1);
  auto bytes = [](const std::string& s) {
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  auto fresh = [&] { return *model->NewCache({.codec = "fp16", .chunk_tokens = 16}); };
  EXPECT_EQ(fresh()->ImportWindow(0, bytes(w)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fresh()->ImportWindow(1, bytes(w.substr(0, 20))).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fresh()->ImportWindow(1, bytes(w.substr(0, w.size() - 4))).code(),
            absl::StatusCode::kInvalidArgument);
  std::string bad_tokens = w;
  bad_tokens[13] = 0x7f;  // a token count beyond any window
  EXPECT_EQ(fresh()->ImportWindow(1, bytes(bad_tokens)).code(), absl::StatusCode::kInvalidArgument);
  std::string bad_magic = w;
  bad_magic[0] = 'X';
  EXPECT_EQ(fresh()->ImportWindow(1, bytes(bad_magic)).code(), absl::StatusCode::kInvalidArgument);
  auto other_shape = *model->NewCache({.codec = "fp16", .chunk_tokens = 16});
  EXPECT_TRUE(other_shape->ImportWindow(1, bytes(w)).ok());
  EXPECT_EQ(other_shape->ImportWindow(1, bytes(w)).code(), absl::StatusCode::kFailedPrecondition);
}

// Continuous batching relies on this: a sequence's logits in a batch are bit for bit its logits
// alone, so its output does not depend on who else is in the batch.
TEST(LlamaModelTest, BatchedDecodeStepsEqualSoloSteps) {
  auto model = *LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny"));
  const KvCacheOptions opts{.codec = "kivi:k2v2:g32", .chunk_tokens = 32};
  constexpr int kSeqs = 18;  // more than 16: OpenBLAS, padded to 16 rows, was invariant up to 16
  std::vector<std::unique_ptr<SequenceKvCache>> solo, batched;
  std::vector<uint32_t> next(kSeqs);
  for (int s = 0; s < kSeqs; ++s) {
    const std::vector<uint32_t> ids = TestIds(*model, 20 + 7 * s, 31 + s, s);
    solo.push_back(*model->NewCache(opts));
    batched.push_back(*model->NewCache(opts));
    const std::vector<float> x = *model->Prefill(ids, solo.back().get());
    const std::vector<float> y = *model->Prefill(ids, batched.back().get());
    ASSERT_EQ(x, y);
    next[s] = static_cast<uint32_t>(std::max_element(x.begin(), x.end()) - x.begin());
  }
  for (int step = 0; step < 40; ++step) {
    std::vector<absl::Span<const uint32_t>> toks;
    std::vector<SequenceKvCache*> caches;
    for (int s = 0; s < kSeqs; ++s) {
      toks.push_back({&next[s], 1});
      caches.push_back(batched[s].get());
    }
    const std::vector<std::vector<float>> got = *model->StepBatch(toks, caches);
    for (int s = 0; s < kSeqs; ++s) {
      const std::vector<float> want = *model->Step({&next[s], 1}, solo[s].get());
      ASSERT_EQ(got[s], want) << "sequence " << s << " step " << step;
      next[s] = static_cast<uint32_t>(std::max_element(want.begin(), want.end()) - want.begin());
    }
  }
}

}  // namespace
}  // namespace strata::model
