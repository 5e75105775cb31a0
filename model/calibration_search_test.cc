#include "model/calibration_search.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "gtest/gtest.h"
#include "kernels/block_operands.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "kernels/synthetic_kv.h"
#include "model/cpu_backend.h"
#include "model/kv_cache.h"
#include "model/kv_evaluation.h"
#include "model/llama.h"

namespace strata::model {
namespace {

std::unique_ptr<LlamaModel> TinyModel() {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(absl::StrCat(STRATA_SOURCE_DIR, "/tests/data/tiny-llama"));
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// BOS, then `n` fixed pseudo-random ordinary tokens.
std::vector<uint32_t> Tokens(const LlamaModel& model, size_t n) {
  std::mt19937 rng(7);
  std::vector<uint32_t> ids = {static_cast<uint32_t>(model.config().bos_token_id)};
  for (size_t i = 0; i < n; ++i) ids.push_back(rng() % 500);
  return ids;
}

CalibrationSearchOptions SmallOptions() {
  return {.chunk_tokens = 32, .window_tokens = 0, .context = 128, .windows = 1,
          .error_queries = 16, .source = "random"};
}

TEST(CalibrationSearchTest, CodecThatNeedsNothingGetsAnEmptyCalibration) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  absl::StatusOr<kernels::Calibration> cal =
      SearchCalibration(*model, Tokens(*model, 10), "kivi:k2v2:g32:sink4", SmallOptions());
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->codec, "kivi:k2v2:g32");  // the sinks are not part of the calibrated codec
  EXPECT_EQ(cal->model_fingerprint, model->fingerprint());
  EXPECT_EQ(cal->kv_heads, model->config().num_kv_heads);
  EXPECT_EQ(cal->head_dim, model->config().head_dim);
  EXPECT_TRUE(cal->layers.empty());
  EXPECT_TRUE(cal->source.empty());
}

TEST(CalibrationSearchTest, SkvqLearnsChannelOrdersAndClipRatios) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  absl::StatusOr<kernels::Calibration> cal =
      SearchCalibration(*model, Tokens(*model, 200), "skvq:k2v2:g32", SmallOptions());
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->source, "random, 128 tokens");
  ASSERT_EQ(cal->layers.size(), c.num_layers);
  for (const kernels::LayerCalibration& layer : cal->layers) {
    for (const std::vector<uint16_t>* perm : {&layer.k_perm, &layer.v_perm}) {
      ASSERT_EQ(perm->size(), size_t{c.num_kv_heads} * c.head_dim);
      for (uint32_t h = 0; h < c.num_kv_heads; ++h) {  // each head's a permutation of its own
        std::vector<uint16_t> head(perm->begin() + h * c.head_dim,
                                   perm->begin() + (h + 1) * c.head_dim);
        std::sort(head.begin(), head.end());
        for (uint32_t i = 0; i < c.head_dim; ++i) EXPECT_EQ(head[i], i);
      }
    }
    EXPECT_GE(layer.k_clip, 0.5f);
    EXPECT_LE(layer.k_clip, 1.0f);
    EXPECT_GE(layer.v_clip, 0.5f);
    EXPECT_LE(layer.v_clip, 1.0f);
  }
  // What it made is a calibration the codec accepts.
  EXPECT_TRUE(
      kernels::Codec::Create("skvq:k2v2:g32", std::make_shared<kernels::Calibration>(*cal)).ok());
}

// CQ's codebooks come from the model's own KV: every layer gets K and V codebooks of the right
// size, and on the model's KV they err less than codebooks learned on synthetic KV.
TEST(CalibrationSearchTest, CqLearnsCodebooksFromTheModelsKv) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  const std::vector<uint32_t> ids = Tokens(*model, 200);
  absl::StatusOr<kernels::Calibration> cal =
      SearchCalibration(*model, ids, "cq:c4:b6:sink2", SmallOptions());
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->codec, "cq:c4:b6");
  ASSERT_EQ(cal->layers.size(), c.num_layers);
  for (const kernels::LayerCalibration& layer : cal->layers) {
    EXPECT_EQ(layer.k_codebook.size(), size_t{c.num_kv_heads} * c.head_dim * 64);
    EXPECT_EQ(layer.v_codebook.size(), size_t{c.num_kv_heads} * c.head_dim * 64);
  }
  auto learned = std::make_shared<kernels::Calibration>(*cal);
  auto synthetic = std::make_shared<kernels::Calibration>(*cal);
  for (kernels::LayerCalibration& layer : synthetic->layers) {
    const auto s = kernels::MakeSyntheticCalibration(*kernels::CodecSpec::Parse("cq:c4:b6"),
                                                     c.num_kv_heads, c.head_dim, 3);
    layer.k_codebook = s->layers[0].k_codebook;
    layer.v_codebook = s->layers[0].v_codebook;
  }
  std::vector<LayerKv> kv;
  ASSERT_TRUE(model->Forward(std::vector<uint32_t>(ids.begin(), ids.begin() + 128), &kv).ok());
  auto errors = [&](std::shared_ptr<kernels::Calibration> calibration) {
    auto codec = *kernels::Codec::Create("cq:c4:b6", calibration);
    return *MeasureLayerErrors(c, kv, 128, *codec, 32, 16);
  };
  const LayerErrors own = errors(learned), other = errors(synthetic);
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    EXPECT_LT(own.k[l], other.k[l]) << "layer " << l;
    EXPECT_LT(own.v[l], other.v[l]) << "layer " << l;
  }
}

// With the metrics, CQ's calibration records each layer's key metric (the queries' RMS per
// channel) and value metric (the output projection's column norms) and learns codebooks under
// them: on the calibration's own KV their errors weighed by those metrics are lower than plain
// codebooks', layer by layer.
TEST(CalibrationSearchTest, CqCodebooksLearnedUnderMetricsErrLessWhereTheModelLooks) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  const std::vector<uint32_t> ids = Tokens(*model, 200);
  CalibrationSearchOptions o = SmallOptions();
  o.cq_query_metric = true;
  o.cq_output_metric = true;
  absl::StatusOr<kernels::Calibration> metric = SearchCalibration(*model, ids, "cq:c4:b6", o);
  ASSERT_TRUE(metric.ok()) << metric.status();
  o.cq_query_metric = false;
  o.cq_output_metric = false;
  absl::StatusOr<kernels::Calibration> plain = SearchCalibration(*model, ids, "cq:c4:b6", o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_EQ(metric->layers.size(), c.num_layers);
  std::vector<LayerKv> kv;
  ASSERT_TRUE(model->Forward(std::vector<uint32_t>(ids.begin(), ids.begin() + 128), &kv).ok());
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    SCOPED_TRACE(l);
    const std::vector<float>& w = metric->layers[l].k_metric;
    const std::vector<float>& wv = metric->layers[l].v_metric;
    for (const std::vector<float>* m : {&w, &wv}) {
      ASSERT_EQ(m->size(), size_t{c.num_kv_heads} * c.head_dim);
      for (float x : *m) ASSERT_TRUE(x > 0 && std::isfinite(x));
    }
    EXPECT_TRUE(plain->layers[l].k_metric.empty());
    EXPECT_TRUE(plain->layers[l].v_metric.empty());
    // This layer's K and V through each calibration's codec, their errors weighed by w and wv.
    auto weighed_error = [&](const kernels::Calibration& cal) {
      auto one = std::make_shared<kernels::Calibration>(cal);
      auto codec = *kernels::Codec::Create("cq:c4:b6", one);
      const uint32_t T = 128, KH = c.num_kv_heads, D = c.head_dim;
      const AlignedBuffer block = *codec->Encode(
          {kv[l].k.data(), kv[l].v.data(), SourceDType::kFloat32, T, KH, D}, {.layer = l});
      std::vector<float> k(kv[l].k.size()), v(kv[l].v.size());
      EXPECT_TRUE(
          kernels::DecodeBlockRef(*BlockView::Parse(block.span()), k.data(), v.data(), one.get())
              .ok());
      double err_k = 0, err_v = 0;
      for (size_t i = 0; i < k.size(); ++i) {
        const double e = (k[i] - kv[l].k[i]) * w[i % (size_t{KH} * D)];
        const double f = (v[i] - kv[l].v[i]) * wv[i % (size_t{KH} * D)];
        err_k += e * e;
        err_v += f * f;
      }
      return std::pair{err_k, err_v};
    };
    const auto [metric_k, metric_v] = weighed_error(*metric);
    const auto [plain_k, plain_v] = weighed_error(*plain);
    EXPECT_LT(metric_k, plain_k);
    EXPECT_LT(metric_v, plain_v);
  }
}

TEST(CalibrationSearchTest, StrataMixChoosesMenuCodecsWithinTheBudget) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const std::vector<uint32_t> ids = Tokens(*model, 200);
  absl::StatusOr<kernels::Calibration> cal =
      SearchCalibration(*model, ids, "strata:b4", SmallOptions());
  ASSERT_TRUE(cal.ok()) << cal.status();
  const ModelConfig& c = model->config();
  ASSERT_EQ(cal->layers.size(), c.num_layers);
  // The average size over layers, each as a full window of 4 chunks (chunk 0 with its sinks).
  double bits = 0;
  for (const kernels::LayerCalibration& layer : cal->layers) {
    absl::StatusOr<kernels::CodecSpec> spec = kernels::CodecSpec::Parse(layer.spec);
    ASSERT_TRUE(spec.ok()) << layer.spec;
    const kernels::Codec codec(*spec);
    bits += (*codec.BitsPerElement(32, c.num_kv_heads, c.head_dim, 0) +
             3 * *codec.BitsPerElement(32, c.num_kv_heads, c.head_dim, 1)) /
            4;
  }
  EXPECT_LE(bits / c.num_layers, 4.0);
  // A budget below every menu entry: said so, not a choice over budget.
  EXPECT_EQ(SearchCalibration(*model, ids, "strata:b0.5", SmallOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The joint step measures the sum's best choices whole, over joint_windows windows (more than the
// per-layer search's one), and keeps one whose whole KL there is within the slack of the least it
// saw: never worse than that slack over the sum's own best, measured whole on the same text.
TEST(CalibrationSearchTest, StrataMixJointStepKeepsAChoiceNoWorseWhole) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const std::vector<uint32_t> ids = Tokens(*model, 520);  // 4 windows of 128 tokens
  CalibrationSearchOptions sum_only = SmallOptions();
  sum_only.joint_choices = 1;
  CalibrationSearchOptions joint = SmallOptions();
  joint.joint_choices = 6;
  joint.joint_windows = 4;
  uint32_t measured = 0;
  joint.progress = [&](absl::string_view stage, uint32_t done, uint32_t total) {
    if (stage == "joint choices") {
      measured = done;
      EXPECT_LE(total, 6u);
    }
  };
  absl::StatusOr<kernels::Calibration> a = SearchCalibration(*model, ids, "strata:b3", sum_only);
  absl::StatusOr<kernels::Calibration> b = SearchCalibration(*model, ids, "strata:b3", joint);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GT(measured, 1u);
  // Both measured whole, as the joint step does: 4 windows of 128 tokens, 32-token chunks.
  KvCacheOptions o{.codec = "fp16", .chunk_tokens = 32};
  std::vector<float> reference;
  ASSERT_TRUE(Perplexity(*model, ids, o, 128, 4, 4 * 128, &reference).ok());
  auto kl = [&](const kernels::Calibration& cal) {
    KvCacheOptions m = o;
    m.codec = cal.codec;
    m.calibration = std::make_shared<kernels::Calibration>(cal);
    absl::StatusOr<PerplexityResult> r =
        Perplexity(*model, ids, m, 128, 4, 4 * 128, nullptr, &reference);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r.ok() ? r->windows : 0u, 4u);
    return r.ok() ? r->kl : 1e9;
  };
  EXPECT_LE(kl(*b), kl(*a) * (1 + joint.joint_kl_slack) + 1e-9);
}

// The k best per-layer choices within a cost cap are the k best of every choice there is
// (enumerated), in order, on random instances of 3 layers and 5 candidates.
TEST(CalibrationSearchTest, BestLayerChoicesAreTheBestOfEveryChoiceInOrder) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> loss(0, 1);
  std::uniform_int_distribution<int> size(1, 6);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::vector<double>> delta(3, std::vector<double>(5));
    for (auto& layer : delta) {
      for (double& d : layer) d = loss(rng);
    }
    std::vector<int> cost(5);
    for (int& c : cost) c = size(rng);
    const int cap = 4 + round % 10;
    std::vector<std::pair<double, std::vector<int>>> all;  // every choice within the cap
    for (int a = 0; a < 5; ++a) {
      for (int b = 0; b < 5; ++b) {
        for (int c = 0; c < 5; ++c) {
          if (cost[a] + cost[b] + cost[c] > cap) continue;
          all.push_back({delta[0][a] + delta[1][b] + delta[2][c], {a, b, c}});
        }
      }
    }
    std::sort(all.begin(), all.end());
    const std::vector<std::vector<int>> got = BestLayerChoices(delta, cost, cap, 6);
    ASSERT_EQ(got.size(), std::min<size_t>(6, all.size())) << "round " << round;
    for (size_t n = 0; n < got.size(); ++n) {
      ASSERT_EQ(got[n].size(), 3u);
      double sum = 0;
      int spent = 0;
      for (size_t l = 0; l < 3; ++l) {
        sum += delta[l][got[n][l]];
        spent += cost[got[n][l]];
      }
      EXPECT_LE(spent, cap);
      EXPECT_NEAR(sum, all[n].first, 1e-12) << "round " << round << ", choice " << n;
    }
  }
  // Nothing fits: no choice.
  EXPECT_TRUE(BestLayerChoices({{0.1, 0.2}}, {5, 6}, 4, 3).empty());
}

// Below 2 bits only CQ is on the menu: the mix takes it, each such layer with its own shape's
// codebooks (learned on the model's KV) and the others with none; the file round-trips, and the
// mix encodes every layer's chunk with it.
TEST(CalibrationSearchTest, StrataMixTakesCqBelowTwoBitsWithEachShapesCodebooks) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  const std::vector<uint32_t> ids = Tokens(*model, 200);
  absl::StatusOr<kernels::Calibration> cal =
      SearchCalibration(*model, ids, "strata:b1.75", SmallOptions());
  ASSERT_TRUE(cal.ok()) << cal.status();
  ASSERT_EQ(cal->layers.size(), c.num_layers);
  int cq_layers = 0;
  for (const kernels::LayerCalibration& layer : cal->layers) {
    const kernels::CodecSpec spec = *kernels::CodecSpec::Parse(layer.spec);
    if (spec.is_codebook()) {
      ++cq_layers;
      const size_t want = size_t{c.num_kv_heads} * c.head_dim << spec.k_bits;
      EXPECT_EQ(layer.k_codebook.size(), want) << layer.spec;
      EXPECT_EQ(layer.v_codebook.size(), want) << layer.spec;
    } else {
      EXPECT_TRUE(layer.k_codebook.empty() && layer.v_codebook.empty()) << layer.spec;
    }
  }
  EXPECT_GT(cq_layers, 0);
  absl::StatusOr<kernels::Calibration> parsed = kernels::Calibration::Parse(cal->Serialize());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, *cal);
  // A layer's codebooks of the wrong shape are refused, naming the layer's codec.
  kernels::Calibration wrong = *cal;
  for (kernels::LayerCalibration& layer : wrong.layers) {
    if (kernels::CodecSpec::Parse(layer.spec)->is_codebook()) {
      layer.k_codebook.resize(layer.k_codebook.size() / 2);
      break;
    }
  }
  absl::StatusOr<kernels::Calibration> refused = kernels::Calibration::Parse(wrong.Serialize());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("cq:"), std::string::npos) << refused.status();
  // The mix compresses a window with the chosen codecs, every layer through its own.
  const auto shared = std::make_shared<kernels::Calibration>(*cal);
  absl::StatusOr<PerplexityResult> r =
      Perplexity(*model, ids,
                 {.codec = "strata:b1.75", .chunk_tokens = 32, .window_tokens = 0,
                  .calibration = shared},
                 128, 1, 0, nullptr, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(std::isfinite(r->ppl));
  EXPECT_GT(r->block_bytes, 0u);
}

TEST(CalibrationSearchTest, ShortTextOrBadSpecIsInvalidArgument) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const CalibrationSearchOptions o = SmallOptions();
  EXPECT_EQ(SearchCalibration(*model, Tokens(*model, 50), "skvq:k2v2:g32", o).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SearchCalibration(*model, Tokens(*model, 200), "skvq:k9", o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvEvaluationTest, KlToItsOwnReferenceIsZeroAndGrowsWithCompression) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const std::vector<uint32_t> ids = Tokens(*model, 256);
  const KvCacheOptions fp16{.codec = "fp16", .chunk_tokens = 32};
  std::vector<float> reference;
  absl::StatusOr<PerplexityResult> base = Perplexity(*model, ids, fp16, 128, 0, 256, &reference);
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_EQ(base->windows, 2u);  // the 257th token starts no window: nothing after it to score
  EXPECT_EQ(base->scored, 254u);  // each window predicts its own tokens after the first
  EXPECT_EQ(reference.size(), 254u * model->config().vocab_size);
  absl::StatusOr<PerplexityResult> same =
      Perplexity(*model, ids, fp16, 128, 0, 256, nullptr, &reference);
  ASSERT_TRUE(same.ok()) << same.status();
  // The reference is recorded in float: its rounding leaves KL within ~1e-9 of 0, either side.
  EXPECT_NEAR(same->kl, 0, 1e-6);
  EXPECT_DOUBLE_EQ(same->top1, 1.0);  // every position's most likely token is the reference's
  EXPECT_DOUBLE_EQ(same->ppl, base->ppl);
  KvCacheOptions kivi = fp16;
  kivi.codec = "kivi:k2v2:g32";
  absl::StatusOr<PerplexityResult> coarse =
      Perplexity(*model, ids, kivi, 128, 0, 256, nullptr, &reference);
  ASSERT_TRUE(coarse.ok()) << coarse.status();
  EXPECT_GT(coarse->kl, 1e-5);
  EXPECT_LT(coarse->top1, 1.0);
  EXPECT_GT(coarse->top1, 0.5);
  EXPECT_LT(coarse->bits(), base->bits());
}

// Perplexity is the mean negative log-likelihood of each window run chunk by chunk with
// LlamaModel::Step, whatever backend computes it (here the CPU's, as ppl and eval call it).
TEST(KvEvaluationTest, PerplexityIsTheStepByStepNllOnTheBackend) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const std::vector<uint32_t> ids = Tokens(*model, 150);
  const KvCacheOptions kivi{.codec = "kivi:k4v4:g16", .chunk_tokens = 32, .window_tokens = 8};
  const uint32_t context = 100, V = model->config().vocab_size;
  double nll = 0;
  size_t scored = 0;
  for (size_t start = 0; start + 1 < ids.size(); start += context) {
    const size_t end = std::min(ids.size(), start + context);
    std::unique_ptr<SequenceKvCache> cache = *model->NewCache(kivi);
    for (size_t s = start; s < end; s += 32) {
      const size_t e = std::min(end, s + 32);
      const std::vector<float> logits =
          *model->Step(absl::MakeConstSpan(ids).subspan(s, e - s), cache.get());
      for (size_t t = s; t < e && t + 1 < end; ++t) {
        const float* row = &logits[(t - s) * V];
        const float mx = *std::max_element(row, row + V);
        double sum = 0;
        for (uint32_t v = 0; v < V; ++v) sum += std::exp(double{row[v]} - mx);
        nll += -(row[ids[t + 1]] - (mx + std::log(sum)));
        ++scored;
      }
    }
  }
  const CpuBackend backend(model.get());
  absl::StatusOr<PerplexityResult> r = Perplexity(backend, ids, kivi, context, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->scored, scored);
  EXPECT_EQ(r->windows, 2u);
  EXPECT_DOUBLE_EQ(r->ppl, std::exp(nll / scored));
  absl::StatusOr<PerplexityResult> same = Perplexity(*model, ids, kivi, context, 0);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->ppl, r->ppl);
}

// The rotation stage measured where the cache applies it: on the model's own K with one channel
// made an outlier (as real LLMs' keys have, strata-tiny's do not), rotating before per-token int8
// cuts K's error by more than half, and attention stays close.
TEST(KvEvaluationTest, RotationCutsTheErrorOfAnOutlierChannel) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  std::vector<LayerKv> kv;
  ASSERT_TRUE(model->Forward(Tokens(*model, 127), &kv).ok());
  for (LayerKv& l : kv) {
    for (size_t i = 5; i < l.k.size(); i += c.head_dim) l.k[i] = 40.0f;  // channel 5 of each head
  }
  auto errors = [&](const char* spec) {
    std::unique_ptr<kernels::Codec> codec = *kernels::Codec::Create(spec);
    absl::StatusOr<LayerErrors> e = MeasureLayerErrors(c, kv, 128, *codec, 32, 16);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *e : LayerErrors{};
  };
  const LayerErrors plain = errors("int8"), rotated = errors("int8:rot");
  ASSERT_EQ(rotated.k.size(), c.num_layers);
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    EXPECT_LT(rotated.k[li], plain.k[li] / 2) << "layer " << li;
    EXPECT_LT(rotated.attn[li], 0.05) << "layer " << li;
  }
}

// The KV structure probe on a synthetic layer whose answers are known: K with one channel 30x the
// rest (a spread near 30, flattened by the rotation), V without (a spread near 1), and queries
// that all point along the first token's key (nearly all their attention on it); then a second
// layer with none of that.
TEST(KvEvaluationTest, TheKvStructureProbeFindsOutlierChannelsAndSinks) {
  ModelConfig c;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  const uint32_t T = 64, row = 2 * 64, qrow = 4 * 64;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.5f, 1.0f);
  std::vector<LayerKv> kv(2);
  for (LayerKv& l : kv) {
    l.k.resize(T * row);
    l.v.resize(T * row);
    l.q.resize(T * qrow);
    for (float& x : l.k) x = u(rng) * (rng() % 2 ? 1 : -1);
    for (float& x : l.v) x = u(rng) * (rng() % 2 ? 1 : -1);
    for (float& x : l.q) x = 0.01f * u(rng);
  }
  for (uint32_t t = 0; t < T; ++t) kv[0].k[t * row + 64 + 9] = 30.0f;  // head 1, channel 9
  for (uint32_t t = 0; t < T; ++t) {  // every query along its KV head's key of token 0
    for (uint32_t qh = 0; qh < 4; ++qh) {
      for (uint32_t i = 0; i < 64; ++i) {
        kv[0].q[t * qrow + qh * 64 + i] = 4.0f * kv[0].k[(qh / 2) * 64 + i];
      }
    }
  }
  absl::StatusOr<KvStructure> s = MeasureKvStructure(c, kv, T, 16);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->layers.size(), 2u);
  const KvStructure::Layer& a = s->layers[0];
  const KvStructure::Layer& b = s->layers[1];
  EXPECT_GT(a.k_spread, 20.0);
  EXPECT_EQ(a.k_top_channel, 64u + 9u);
  EXPECT_LT(a.k_spread_rotated, a.k_spread / 3);
  EXPECT_LT(a.v_spread, 3.0);
  EXPECT_GT(a.first_token_mass, 0.9);
  EXPECT_LT(b.k_spread, 3.0);
  EXPECT_LT(b.first_token_mass, 0.2);  // about uniform over 17..64 keys
  EXPECT_EQ(MeasureKvStructure(c, kv, T, T).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvEvaluationTest, LayerErrorsAreSmallForFp16AndLargerFor2Bits) {
  std::unique_ptr<LlamaModel> model = TinyModel();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  const std::vector<uint32_t> ids = Tokens(*model, 127);
  std::vector<LayerKv> kv;
  ASSERT_TRUE(model->Forward(ids, &kv).ok());
  absl::StatusOr<std::unique_ptr<kernels::Codec>> fp16 = kernels::Codec::Create("fp16");
  absl::StatusOr<std::unique_ptr<kernels::Codec>> kivi = kernels::Codec::Create("kivi:k2v2:g32");
  ASSERT_TRUE(fp16.ok() && kivi.ok());
  absl::StatusOr<LayerErrors> exact = MeasureLayerErrors(c, kv, 128, **fp16, 32, 16);
  absl::StatusOr<LayerErrors> coarse = MeasureLayerErrors(c, kv, 128, **kivi, 32, 16);
  ASSERT_TRUE(exact.ok()) << exact.status();
  ASSERT_TRUE(coarse.ok()) << coarse.status();
  ASSERT_EQ(exact->k.size(), c.num_layers);
  ASSERT_EQ(coarse->attn.size(), c.num_layers);
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    EXPECT_LT(exact->k[li], 1e-3);
    EXPECT_LT(exact->attn[li], 1e-3);
    EXPECT_GT(coarse->k[li], exact->k[li]);
    EXPECT_GT(coarse->v[li], exact->v[li]);
  }
  absl::StatusOr<LayerErrors> one = MeasureLayerErrors(c, kv, 128, **kivi, 32, 16, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->attn.size(), 1u);
  EXPECT_DOUBLE_EQ(one->attn[0], coarse->attn[1]);
  // No full chunk before the queries.
  EXPECT_EQ(MeasureLayerErrors(c, kv, 128, **kivi, 128, 16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::model
