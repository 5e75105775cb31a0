#include "kernels/codebook.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_operands.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels {
namespace {

using testing::HasSubstr;

// Points drawn tightly around 4 centers in 4 dimensions: a 2-bit codebook finds every center.
TEST(CodebookTest, KMeansFindsSeparatedClusters) {
  const float centers[4][4] = {{1, 0, 0, 0}, {0, -2, 0, 0}, {0, 0, 3, 1}, {-1, -1, -1, 4}};
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0, 0.01f);
  const uint32_t tokens = 400;
  std::vector<float> x(size_t{tokens} * 4);  // one head of 4 channels, one run
  for (uint32_t t = 0; t < tokens; ++t) {
    for (int d = 0; d < 4; ++d) x[t * 4 + d] = centers[t % 4][d] + noise(rng);
  }
  const std::vector<uint16_t> book = TrainCodebooks(x.data(), tokens, 1, 4, 4, 2);
  ASSERT_EQ(book.size(), 4u * 4);
  for (const auto& c : centers) {
    float best = INFINITY;
    for (int e = 0; e < 4; ++e) {
      float d2 = 0;
      for (int d = 0; d < 4; ++d) {
        const float diff = HalfBitsToFloat(book[e * 4 + d]) - c[d];
        d2 += diff * diff;
      }
      best = std::min(best, d2);
    }
    EXPECT_LT(std::sqrt(best), 0.02f);
  }
}

// Fewer distinct points than centroids: the spare centroids repeat points, nothing is NaN.
TEST(CodebookTest, FewPointsGiveFiniteCodebooks) {
  const std::vector<float> x = {1, 2, 3, 4, 1, 2, 3, 4};  // two identical tokens, 4 channels
  const std::vector<uint16_t> book = TrainCodebooks(x.data(), 2, 1, 4, 2, 4);
  ASSERT_EQ(book.size(), 2u * 16 * 2);
  for (uint16_t h : book) EXPECT_TRUE(std::isfinite(HalfBitsToFloat(h)));
}

// Weighted k-means spends its centroids where the weight is: points spread evenly along a line,
// the first tenth weighing 100 times the rest, get several times the centroids there that
// unweighted k-means gives them.
TEST(CodebookTest, WeightsDrawTheCentroidsToWhereErrorsCostMore) {
  const uint32_t T = 2000, c = 2, bits = 4;
  std::vector<float> x(size_t{T} * c), w(T);
  for (uint32_t t = 0; t < T; ++t) {
    x[size_t{t} * c] = static_cast<float>(t) / T;
    x[size_t{t} * c + 1] = 0.0f;
    w[t] = t < T / 10 ? 100.0f : 1.0f;
  }
  auto in_heavy_part = [&](const std::vector<uint16_t>& book) {
    int n = 0;
    for (uint32_t j = 0; j < (1u << bits); ++j) n += HalfBitsToFloat(book[size_t{j} * c]) < 0.1f;
    return n;
  };
  const int uniform = in_heavy_part(TrainCodebooks(x.data(), T, 1, c, c, bits, 1));
  const int weighted = in_heavy_part(TrainCodebooks(x.data(), T, 1, c, c, bits, 1, 30, w.data()));
  EXPECT_LE(uniform, 3);  // a tenth of 16 centroids, about
  EXPECT_GE(weighted, 3 * std::max(uniform, 1));
  // Weights of 1 are no weights.
  const std::vector<float> ones(T, 1.0f);
  EXPECT_EQ(TrainCodebooks(x.data(), T, 1, c, c, bits, 1, 30, ones.data()),
            TrainCodebooks(x.data(), T, 1, c, c, bits, 1));
}

// `kv` through `codec` into one block, decoded by the reference decoder with `cal` into k and v.
void EncodeDecode(const Codec& codec, const SyntheticKv& kv, const Calibration& cal,
                  std::vector<float>* k, std::vector<float>* v) {
  absl::StatusOr<AlignedBuffer> block = codec.Encode(
      {kv.k.data(), kv.v.data(), SourceDType::kFloat32, kv.tokens, kv.kv_heads, kv.head_dim}, {});
  ASSERT_TRUE(block.ok()) << block.status();
  k->assign(kv.k.size(), 0.0f);
  v->assign(kv.v.size(), 0.0f);
  ASSERT_TRUE(DecodeBlockRef(*BlockView::Parse(block->span()), k->data(), v->data(), &cal).ok());
}

// Every run of a token's channels decodes to the centroid nearest to it, and the bits per
// element are b / c plus the block's header.
TEST(CodebookTest, EachRunDecodesToItsNearestCentroid) {
  for (const char* text : {"cq:c4:b6", "cq:c8:b8", "cq:c2:b4", "cq:c4:b6:norm"}) {
    const CodecSpec spec = *CodecSpec::Parse(text);
    const uint32_t T = 64, H = 2, D = 64;
    std::shared_ptr<Calibration> cal = MakeSyntheticCalibration(spec, H, D, 3);
    auto codec = *Codec::Create(text, cal);
    const SyntheticKv kv = MakeSyntheticKv(T, H, D, 11);
    std::vector<float> k, v;
    ASSERT_NO_FATAL_FAILURE(EncodeDecode(*codec, kv, *cal, &k, &v));
    const uint32_t c = spec.group, E = 1u << spec.k_bits, runs = D / c;
    for (const auto& [src, got, book] : {std::tuple{&kv.k, &k, &cal->layers[0].k_codebook},
                                         std::tuple{&kv.v, &v, &cal->layers[0].v_codebook}}) {
      std::vector<float> cent(size_t{E} * c);
      for (uint32_t h = 0; h < H; ++h) {
        for (uint32_t g = 0; g < runs; ++g) {
          for (size_t e = 0; e < cent.size(); ++e) {
            cent[e] = HalfBitsToFloat((*book)[(size_t{h} * runs + g) * E * c + e]);
          }
          for (uint32_t t = 0; t < T; ++t) {
            const size_t at = (size_t{t} * H + h) * D + g * c;
            // With norm, the row divided by its RMS (as fp16) picks the centroid, then the RMS
            // scales it back.
            std::vector<float> row(&(*src)[(size_t{t} * H + h) * D],
                                   &(*src)[(size_t{t} * H + h) * D] + D);
            uint16_t rms = 0;
            if (spec.token_norm) NormalizeRows(row.data(), 1, 1, D, &rms);
            const float scale = spec.token_norm ? HalfBitsToFloat(rms) : 1.0f;
            const uint32_t want = CentroidSearch(cent.data(), E, c).Nearest(&row[g * c]);
            for (uint32_t i = 0; i < c; ++i) {
              ASSERT_FLOAT_EQ((*got)[at + i], cent[size_t{want} * c + i] * scale)
                  << text << " t=" << t;
            }
            // The search's choice is the nearest, up to fp32 rounding of |c|^2 - 2 p.c.
            const uint32_t nearest = NearestCentroid(&row[g * c], cent.data(), E, c);
            float p2 = 0, d_want = 0, d_nearest = 0;
            for (uint32_t i = 0; i < c; ++i) {
              const float x = row[g * c + i];
              p2 += x * x;
              d_want += (x - cent[want * c + i]) * (x - cent[want * c + i]);
              d_nearest += (x - cent[nearest * c + i]) * (x - cent[nearest * c + i]);
            }
            ASSERT_LE(d_want, d_nearest + 1e-5f * (1 + p2)) << text << " t=" << t;
          }
        }
      }
    }
    const double bits = *codec->BitsPerElement(256, 8, 128);
    EXPECT_GT(bits, spec.nominal_bits());
    // norm's fp16 RMS per token and head: 16 / head_dim bits more.
    EXPECT_LT(bits, spec.nominal_bits() + (spec.token_norm ? 16.0 / 128 : 0) + 0.05) << text;
  }
}

// Under the calibration's metrics (LayerCalibration::k_metric, v_metric) each run takes the
// centroid nearest by the weighted distance sum_d (w_d (x_d - c_d))^2, which is not the plain
// nearest for many runs; a tensor without one keeps the plain distance.
TEST(CodebookTest, RunsUnderAMetricTakeTheWeightedNearestCentroid) {
  for (const char* text : {"cq:c4:b6", "cq:c2:b5:norm"}) {
    for (const bool on_k : {true, false}) {
      SCOPED_TRACE(absl::StrCat(text, on_k ? ", metric on K" : ", metric on V"));
      const CodecSpec spec = *CodecSpec::Parse(text);
      const uint32_t T = 64, H = 2, D = 64;
      auto cal = std::make_shared<Calibration>(*MakeSyntheticCalibration(spec, H, D, 3));
      std::mt19937 rng(5);
      std::uniform_real_distribution<float> log_w(-2.5f, 2.5f);
      std::vector<float>& metric = on_k ? cal->layers[0].k_metric : cal->layers[0].v_metric;
      metric.resize(size_t{H} * D);
      for (float& w : metric) w = std::exp(log_w(rng));
      auto codec = *Codec::Create(text, cal);
      const SyntheticKv kv = MakeSyntheticKv(T, H, D, 11);
      std::vector<float> k, v;
      ASSERT_NO_FATAL_FAILURE(EncodeDecode(*codec, kv, *cal, &k, &v));
      const uint32_t c = spec.group, E = 1u << spec.k_bits, runs = D / c;
      for (const bool weighted_tensor : {true, false}) {  // the one with the metric, the other
        const bool is_k = weighted_tensor == on_k;
        const std::vector<float>& src = is_k ? kv.k : kv.v;
        const std::vector<float>& decoded = is_k ? k : v;
        const std::vector<uint16_t>& book =
            is_k ? cal->layers[0].k_codebook : cal->layers[0].v_codebook;
        int differs = 0;
        for (uint32_t h = 0; h < H; ++h) {
          const float* w = weighted_tensor ? &metric[size_t{h} * D] : nullptr;
          for (uint32_t t = 0; t < T; ++t) {
            std::vector<float> row(&src[(size_t{t} * H + h) * D],
                                   &src[(size_t{t} * H + h) * D] + D);
            uint16_t rms = 0;
            if (spec.token_norm) NormalizeRows(row.data(), 1, 1, D, &rms);
            const float scale = spec.token_norm ? HalfBitsToFloat(rms) : 1.0f;
            for (uint32_t g = 0; g < runs; ++g) {
              auto dist = [&](const float* cent, bool use_w) {
                float d2 = 0;
                for (uint32_t i = 0; i < c; ++i) {
                  const float e =
                      (row[g * c + i] - cent[i]) * (use_w && w != nullptr ? w[g * c + i] : 1.0f);
                  d2 += e * e;
                }
                return d2;
              };
              std::vector<float> cent(size_t{E} * c);
              for (size_t e = 0; e < cent.size(); ++e) {
                cent[e] = HalfBitsToFloat(book[(size_t{h} * runs + g) * E * c + e]);
              }
              float best = INFINITY, best_plain = INFINITY;
              uint32_t plain = 0;
              for (uint32_t e = 0; e < E; ++e) {
                best = std::min(best, dist(&cent[e * c], true));
                if (const float d = dist(&cent[e * c], false); d < best_plain) {
                  best_plain = d;
                  plain = e;
                }
              }
              // The decoded run is a centroid (times the row's RMS), the nearest by the tensor's
              // distance, up to fp32 rounding.
              std::vector<float> got(c);
              for (uint32_t i = 0; i < c; ++i) {
                got[i] = decoded[(size_t{t} * H + h) * D + g * c + i] / scale;
              }
              ASSERT_LE(dist(got.data(), true), best * (1 + 1e-4f) + 1e-6f)
                  << "t=" << t << " g=" << g;
              differs += got[0] != cent[plain * c] || got[c - 1] != cent[plain * c + c - 1];
            }
          }
        }
        if (weighted_tensor) {
          EXPECT_GT(differs, static_cast<int>(T * H * runs / 10));  // the metric matters
        }
      }
    }
  }
}

// Learned under a metric, a key codebook spends its centroids on the channels the metric weighs:
// points spread evenly over a square, channel 0 weighed 16 times channel 1, end with a far
// smaller error on channel 0 than plain k-means leaves (and a larger one on channel 1).
TEST(CodebookTest, AMetricSpendsTheCodebookOnTheChannelsItWeighs) {
  const uint32_t T = 4000;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(size_t{T} * 2);
  for (float& e : x) e = u(rng);
  const float metric[2] = {4.0f, 0.25f};
  auto errors = [&](const float* m) {
    const std::vector<uint16_t> book = TrainCodebooks(x.data(), T, 1, 2, 2, 4, 1, 30, nullptr, m);
    double e0 = 0, e1 = 0;
    for (uint32_t t = 0; t < T; ++t) {
      float best = INFINITY;
      float d0 = 0, d1 = 0;
      for (int e = 0; e < 16; ++e) {
        const float a = x[t * 2] - HalfBitsToFloat(book[e * 2]);
        const float b = x[t * 2 + 1] - HalfBitsToFloat(book[e * 2 + 1]);
        const float w0 = m != nullptr ? m[0] : 1, w1 = m != nullptr ? m[1] : 1;
        if (const float d = w0 * w0 * a * a + w1 * w1 * b * b; d < best) {
          best = d;
          d0 = a * a;
          d1 = b * b;
        }
      }
      e0 += d0;
      e1 += d1;
    }
    return std::pair{e0 / T, e1 / T};
  };
  const auto [plain0, plain1] = errors(nullptr);
  const auto [weighed0, weighed1] = errors(metric);
  EXPECT_LT(weighed0, plain0 / 4);
  EXPECT_GT(weighed1, plain1);
}

// Coupling pays: at the same 2 bits per element, 4 channels on 8 bits (256 centroids) err less on
// keys than 2 channels on 4 bits (16 centroids).
TEST(CodebookTest, CouplingMoreChannelsErrsLessAtTheSameBits) {
  const uint32_t T = 256, H = 2, D = 64;
  const SyntheticKv kv = MakeSyntheticKv(T, H, D, 21);
  auto error = [&](const char* text) {
    const CodecSpec spec = *CodecSpec::Parse(text);
    auto cal = std::make_shared<Calibration>(*MakeSyntheticCalibration(spec, H, D, 5));
    cal->layers[0].k_codebook = TrainCodebooks(kv.k.data(), T, H, D, spec.group, spec.k_bits);
    auto codec = *Codec::Create(text, cal);
    const AlignedBuffer block =
        *codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, T, H, D}, {});
    std::vector<float> k(kv.k.size()), v(kv.v.size());
    EXPECT_TRUE(
        DecodeBlockRef(*BlockView::Parse(block.span()), k.data(), v.data(), cal.get()).ok());
    double err = 0, norm = 0;
    for (size_t i = 0; i < k.size(); ++i) {
      err += (k[i] - kv.k[i]) * (k[i] - kv.k[i]);
      norm += kv.k[i] * kv.k[i];
    }
    return std::sqrt(err / norm);
  };
  const double c4 = error("cq:c4:b8"), c2 = error("cq:c2:b4");
  EXPECT_LT(c4, c2);
  EXPECT_LT(c4, 0.5);
}

// The codebooks travel in the calibration file and count in its fingerprint; a codebook of the
// wrong size, or not base64, is refused naming the layer and the field.
TEST(CodebookTest, CalibrationFilesCarryTheCodebooks) {
  const CodecSpec spec = *CodecSpec::Parse("cq:c4:b6");
  const Calibration cal = *MakeSyntheticCalibration(spec, 2, 64, 9);
  const std::string text = cal.Serialize();
  absl::StatusOr<Calibration> back = Calibration::Parse(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, cal);
  EXPECT_EQ(back->fingerprint(), cal.fingerprint());
  Calibration other = cal;
  other.layers[0].v_codebook[5] ^= 1;
  EXPECT_NE(other.fingerprint(), cal.fingerprint());
  Calibration short_book = cal;
  short_book.layers[0].k_codebook.pop_back();
  absl::StatusOr<Calibration> bad = Calibration::Parse(short_book.Serialize());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("layer 0 k_codebook has"));
  std::string garbled = text;
  garbled.replace(garbled.find("\"v_codebook\": \"") + 15, 4, "!!!!");
  bad = Calibration::Parse(garbled);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("v_codebook is not base64"));
}

// The metrics travel in the calibration file and count in its fingerprint; one of the wrong size,
// or with a weight that is not finite and positive, is refused naming the layer and the field.
TEST(CodebookTest, CalibrationFilesCarryTheMetrics) {
  Calibration cal = *MakeSyntheticCalibration(*CodecSpec::Parse("cq:c4:b6"), 2, 64, 9);
  cal.layers[0].k_metric.assign(128, 1.0f);
  cal.layers[0].k_metric[7] = 0.3f;
  cal.layers[0].k_metric[100] = 17.25f;
  cal.layers[0].v_metric.assign(128, 2.0f);
  cal.layers[0].v_metric[3] = 0.125f;
  absl::StatusOr<Calibration> back = Calibration::Parse(cal.Serialize());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, cal);
  EXPECT_EQ(back->fingerprint(), cal.fingerprint());
  Calibration plain = cal;
  plain.layers[0].k_metric.clear();
  EXPECT_NE(plain.fingerprint(), cal.fingerprint());
  Calibration other = cal;
  other.layers[0].k_metric[7] = 0.31f;
  EXPECT_NE(other.fingerprint(), cal.fingerprint());
  other = cal;
  other.layers[0].v_metric[9] = 2.5f;
  EXPECT_NE(other.fingerprint(), cal.fingerprint());
  Calibration short_v = cal;
  short_v.layers[0].v_metric.pop_back();
  absl::StatusOr<Calibration> refused_v = Calibration::Parse(short_v.Serialize());
  ASSERT_FALSE(refused_v.ok());
  EXPECT_THAT(refused_v.status().message(), HasSubstr("layer 0 v_metric has 127 entries"));
  for (const auto& [change, want] :
       {std::pair<std::function<void(std::vector<float>&)>, const char*>{
            [](std::vector<float>& m) { m.pop_back(); }, "layer 0 k_metric has 127 entries"},
        {[](std::vector<float>& m) { m[3] = 0; }, "layer 0 k_metric holds 0"},
        {[](std::vector<float>& m) { m[3] = -2; }, "layer 0 k_metric holds -2"}}) {
    Calibration bad = cal;
    change(bad.layers[0].k_metric);
    absl::StatusOr<Calibration> refused = Calibration::Parse(bad.Serialize());
    ASSERT_FALSE(refused.ok()) << want;
    EXPECT_THAT(refused.status().message(), HasSubstr(want));
  }
}

// A CQ block read with a calibration that has no codebooks (or none at all) is refused.
TEST(CodebookTest, BlocksNeedTheirCodebooks) {
  const CodecSpec spec = *CodecSpec::Parse("cq:c4:b6");
  std::shared_ptr<Calibration> cal = MakeSyntheticCalibration(spec, 2, 64, 4);
  EXPECT_EQ(Codec::Create("cq:c4:b6").status().code(), absl::StatusCode::kFailedPrecondition);
  auto codec = *Codec::Create("cq:c4:b6", cal);
  const SyntheticKv kv = MakeSyntheticKv(32, 2, 64, 1);
  const AlignedBuffer block =
      *codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, 32, 2, 64}, {});
  const BlockView view = *BlockView::Parse(block.span());
  EXPECT_EQ(PrepareBlock(view, nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(PrepareBlock(view, cal.get()).ok());
  // A calibration without codebooks cannot encode either.
  auto empty = std::make_shared<Calibration>(*cal);
  empty->layers[0].k_codebook.clear();
  absl::StatusOr<AlignedBuffer> refused =
      (*Codec::Create("cq:c4:b6", empty))
          ->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, 32, 2, 64}, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("no K codebooks"));
  // Rows of codes must fill whole bytes: 9 runs of 5 bits do not.
  std::shared_ptr<Calibration> odd =
      MakeSyntheticCalibration(*CodecSpec::Parse("cq:c8:b5"), 1, 72, 4);
  const SyntheticKv kv72 = MakeSyntheticKv(8, 1, 72, 1);
  absl::StatusOr<AlignedBuffer> unaligned =
      (*Codec::Create("cq:c8:b5", odd))
          ->Encode({kv72.k.data(), kv72.v.data(), SourceDType::kFloat32, 8, 1, 72}, {});
  ASSERT_FALSE(unaligned.ok());
  EXPECT_THAT(unaligned.status().message(), HasSubstr("whole bytes"));
}

}  // namespace
}  // namespace strata::kernels
