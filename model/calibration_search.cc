#include "model/calibration_search.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/block_format.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "kernels/codebook.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/kv_evaluation.h"

namespace strata::model {
namespace {

// Forward passes over the calibration windows, K/V/q of each layer concatenated.
absl::StatusOr<std::vector<LayerKv>> RunWindows(const LlamaModel& model,
                                                const std::vector<uint32_t>& ids,
                                                uint32_t context, uint32_t windows) {
  std::vector<LayerKv> all;
  for (uint32_t w = 0; w < windows && size_t{w + 1} * context <= ids.size(); ++w) {
    std::vector<LayerKv> kv;
    const std::vector<uint32_t> window(ids.begin() + size_t{w} * context,
                                       ids.begin() + size_t{w + 1} * context);
    STRATA_RETURN_IF_ERROR(model.Forward(window, &kv).status());
    if (all.empty()) {
      all = std::move(kv);
      continue;
    }
    for (size_t i = 0; i < kv.size(); ++i) {
      all[i].k.insert(all[i].k.end(), kv[i].k.begin(), kv[i].k.end());
      all[i].v.insert(all[i].v.end(), kv[i].v.begin(), kv[i].v.end());
      all[i].q.insert(all[i].q.end(), kv[i].q.begin(), kv[i].q.end());
    }
  }
  if (all.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("calibrate: the text has ", ids.size(),
                                                   " tokens, less than one window of ", context));
  }
  return all;
}

// SKVQ's part of a calibration: channel orders and clip ratios, for `skvq_spec`.
absl::Status CalibrateSkvq(const LlamaModel& model, const std::string& skvq_spec,
                           const std::vector<LayerKv>& kv, uint32_t tokens,
                           const CalibrationSearchOptions& o, kernels::Calibration& cal) {
  const ModelConfig& c = model.config();
  const std::string codec = cal.codec;
  cal.codec = skvq_spec;
  // Channel order: by range over every calibration token.
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    for (uint32_t h = 0; h < c.num_kv_heads; ++h) {
      for (const auto& [x, perm] : {std::pair{&kv[li].k, &cal.layers[li].k_perm},
                                    std::pair{&kv[li].v, &cal.layers[li].v_perm}}) {
        const std::vector<uint16_t> p =
            kernels::ChannelOrderByRange(x->data(), tokens, c.num_kv_heads, c.head_dim, h);
        perm->insert(perm->end(), p.begin(), p.end());
      }
    }
  }
  // Clip ratios: per layer, K's then V's, each the grid value with the least attention-output
  // error on the first calibration window (the other tensor's ratio held at its current value).
  std::vector<LayerKv> first(kv.size());
  const size_t row = size_t{c.num_kv_heads} * c.head_dim, qrow = size_t{c.num_heads} * c.head_dim;
  for (size_t i = 0; i < kv.size(); ++i) {
    first[i].k.assign(kv[i].k.begin(), kv[i].k.begin() + o.context * row);
    first[i].v.assign(kv[i].v.begin(), kv[i].v.begin() + o.context * row);
    first[i].q.assign(kv[i].q.begin(), kv[i].q.begin() + o.context * qrow);
  }
  const float grid[] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f, 0.7f, 0.65f, 0.6f, 0.55f, 0.5f};
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    for (float kernels::LayerCalibration::*field :
         {&kernels::LayerCalibration::k_clip, &kernels::LayerCalibration::v_clip}) {
      double best = INFINITY;
      float best_clip = 1.0f;
      for (float clip : grid) {
        auto trial = std::make_shared<kernels::Calibration>(cal);
        trial->layers[li].*field = clip;
        STRATA_ASSIGN_OR_RETURN(auto codec, kernels::Codec::Create(skvq_spec, trial));
        STRATA_ASSIGN_OR_RETURN(LayerErrors e,
                                MeasureLayerErrors(c, first, o.context, *codec, o.chunk_tokens,
                                                   o.error_queries, static_cast<int>(li)));
        if (e.attn[0] < best) {
          best = e.attn[0];
          best_clip = clip;
        }
      }
      cal.layers[li].*field = best_clip;
    }
    if (o.progress) o.progress("SKVQ clip ratios", li + 1, c.num_layers);
  }
  cal.codec = codec;
  return absl::OkStatus();
}

// The attention each calibration token receives in one layer, per KV head [kv_heads][tokens]:
// the probabilities its group's query heads give it, summed over every `query_stride`-th query
// after it in its window of `context` tokens (causal, as the model attends), scaled to mean 1
// per head. An error in a token's K or V moves the attention output in proportion to it.
std::vector<float> AttentionMass(const ModelConfig& c, const LayerKv& kv, uint32_t tokens,
                                 uint32_t context, uint32_t query_stride) {
  const uint32_t H = c.num_heads, KH = c.num_kv_heads, D = c.head_dim, group = H / KH;
  std::vector<double> mass(size_t{KH} * tokens, 0.0);
  std::vector<float> p(context);
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  for (uint32_t w0 = 0; w0 < tokens; w0 += context) {
    const uint32_t n = std::min(context, tokens - w0);
    for (uint32_t i = query_stride - 1; i < n; i += query_stride) {
      for (uint32_t h = 0; h < H; ++h) {
        const uint32_t kh = h / group;
        const float* q = &kv.q[(size_t{w0 + i} * H + h) * D];
        float mx = -std::numeric_limits<float>::infinity();
        for (uint32_t j = 0; j <= i; ++j) {
          const float* k = &kv.k[(size_t{w0 + j} * KH + kh) * D];
          float dot = 0;
          for (uint32_t d = 0; d < D; ++d) dot += q[d] * k[d];
          p[j] = dot * inv_sqrt_d;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (uint32_t j = 0; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
        for (uint32_t j = 0; j <= i; ++j) mass[size_t{kh} * tokens + w0 + j] += p[j] / sum;
      }
    }
  }
  std::vector<float> out(mass.size());
  for (uint32_t kh = 0; kh < KH; ++kh) {
    double total = 0;
    for (uint32_t t = 0; t < tokens; ++t) total += mass[size_t{kh} * tokens + t];
    const double scale = total > 0 ? tokens / total : 0;
    for (uint32_t t = 0; t < tokens; ++t) {
      out[size_t{kh} * tokens + t] =
          total > 0 ? static_cast<float>(mass[size_t{kh} * tokens + t] * scale) : 1.0f;
    }
  }
  return out;
}

// CQ's k-means weights per layer (AttentionMass, every 8th query), or none (1 each) when
// o.cq_attention_weights is off.
std::vector<std::vector<float>> CqWeights(const ModelConfig& c, const std::vector<LayerKv>& kv,
                                          uint32_t tokens, const CalibrationSearchOptions& o) {
  std::vector<std::vector<float>> w(c.num_layers);
  if (!o.cq_attention_weights) return w;
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    w[li] = AttentionMass(c, kv[li], tokens, o.context, /*query_stride=*/8);
    if (o.progress) o.progress("CQ token weights", li + 1, c.num_layers);
  }
  return w;
}

// A per-channel metric from each KV head's channel energies ([kv_heads][head_dim] sums of
// squares): the square root of each over the head's mean, so that the head's weights have RMS 1,
// floored at 1/64 (a channel nothing reads still counts a little); a head of no energy at all
// keeps 1 everywhere (the plain distance).
std::vector<float> ChannelMetric(const std::vector<double>& sum, uint32_t KH, uint32_t D) {
  std::vector<float> w(sum.size(), 1.0f);
  for (uint32_t kh = 0; kh < KH; ++kh) {
    double mean = 0;
    for (uint32_t d = 0; d < D; ++d) mean += sum[size_t{kh} * D + d];
    mean /= D;
    if (!(mean > 0)) continue;
    for (uint32_t d = 0; d < D; ++d) {
      w[size_t{kh} * D + d] =
          static_cast<float>(std::sqrt(std::max(sum[size_t{kh} * D + d] / mean, 1.0 / 4096)));
    }
  }
  return w;
}

// CQ's key metric of one layer (LayerCalibration::k_metric): per KV head and channel, the RMS of
// the channel over the head's query heads and the calibration tokens, scaled to RMS 1 over the
// head's channels and floored at 1/64 of that (a channel no query reads still counts a little).
std::vector<float> QueryMetric(const ModelConfig& c, const LayerKv& kv, uint32_t tokens) {
  const uint32_t H = c.num_heads, KH = c.num_kv_heads, D = c.head_dim, group = H / KH;
  std::vector<double> sum(size_t{KH} * D, 0.0);
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      const float* q = &kv.q[(size_t{t} * H + h) * D];
      double* s = &sum[size_t{h / group} * D];
      for (uint32_t d = 0; d < D; ++d) s[d] += double{q[d]} * q[d];
    }
  }
  return ChannelMetric(sum, KH, D);
}

// CQ's value metric of one layer (LayerCalibration::v_metric): per KV head and channel, the norm
// of the output projection's columns that read the channel from the head's query heads, scaled
// to RMS 1 over the head's channels and floored at 1/64 of that.
std::vector<float> OutputMetric(const ModelConfig& c, const LlamaModel::Layer& layer) {
  const uint32_t H = c.num_heads, KH = c.num_kv_heads, D = c.head_dim, group = H / KH;
  const size_t in = size_t{H} * D, out = layer.wo.size() / in;
  std::vector<double> sum(size_t{KH} * D, 0.0);
  for (size_t o = 0; o < out; ++o) {
    const float* row = &layer.wo[o * in];
    for (uint32_t h = 0; h < H; ++h) {
      double* s = &sum[size_t{h / group} * D];
      for (uint32_t d = 0; d < D; ++d) s[d] += double{row[h * D + d]} * row[h * D + d];
    }
  }
  return ChannelMetric(sum, KH, D);
}

// CQ's codebooks: per layer, head and run of coupled channels, k-means over every calibration
// token's K and V (kernels/codebook.h), each token weighted by `weights` (CqWeights); the keys'
// distance weighted per channel by the queries (QueryMetric) where o.cq_query_metric, the values'
// by the output projection (OutputMetric, of `model`) where o.cq_output_metric.
void CalibrateCq(const LlamaModel& model, const kernels::CodecSpec& spec,
                 const std::vector<LayerKv>& kv, uint32_t tokens, const CalibrationSearchOptions& o,
                 const std::vector<std::vector<float>>& weights, kernels::Calibration& cal) {
  const ModelConfig& c = model.config();
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    const float* w = weights[li].empty() ? nullptr : weights[li].data();
    std::vector<float> k = kv[li].k, v = kv[li].v;
    if (spec.token_norm) {  // the codebooks learn the rows the encoder will quantize
      kernels::NormalizeRows(k.data(), tokens, c.num_kv_heads, c.head_dim, nullptr);
      kernels::NormalizeRows(v.data(), tokens, c.num_kv_heads, c.head_dim, nullptr);
    }
    cal.layers[li].k_metric.clear();
    if (o.cq_query_metric) cal.layers[li].k_metric = QueryMetric(c, kv[li], tokens);
    cal.layers[li].k_codebook = kernels::TrainCodebooks(
        k.data(), tokens, c.num_kv_heads, c.head_dim, spec.group, spec.k_bits,
        /*seed=*/2 * li + 1, /*iterations=*/30, w,
        cal.layers[li].k_metric.empty() ? nullptr : cal.layers[li].k_metric.data());
    cal.layers[li].v_metric.clear();
    if (o.cq_output_metric) cal.layers[li].v_metric = OutputMetric(c, model.layers()[li]);
    cal.layers[li].v_codebook = kernels::TrainCodebooks(
        v.data(), tokens, c.num_kv_heads, c.head_dim, spec.group, spec.v_bits,
        /*seed=*/2 * li + 2, /*iterations=*/30, w,
        cal.layers[li].v_metric.empty() ? nullptr : cal.layers[li].v_metric.data());
    if (o.progress) o.progress("CQ codebooks", li + 1, c.num_layers);
  }
}

// The Strata mix's menu: every method, at several sizes, each with fp16 sinks, and the rotation
// stage.
constexpr char kStrataSkvq[] = "skvq:k2v2:g32";
const char* const kStrataMenu[] = {
    "kivi:k2v2:g64:sink4", "kivi:k2v2:g32:sink4", "kivi:k3v3:g32:sink4", "kivi:k4v4:g32:sink4",
    "kivi:k4v2:g32:sink4", "kivi:k2v4:g32:sink4", "kivi:k8v8:g32:sink4", "kcvt:k2v2:sink4",
    "kcvt:k4v4:sink4", "gear:k2v2:kcvt:r2:s1:sink4", "gear:k2v2:g64:r2:s1:sink4",
    "gear:k3v3:kcvt:r2:s1:sink4", "gear:k4v4:kcvt:r2:s1:sink4", "zipcache:k2v2:h4:s10:sink4",
    "zipcache:k2v2:h8:s10:sink4", "zipcache:k3v3:h8:s10:sink4", "skvq:k2v2:g32:sink4",
    "skvq:k3v3:g32:sink4", "skvq:k4v4:g32:sink4", "tada:k2v2:g32:sink4", "tada:k4v4:g32:sink4",
    "kcvt:k2v2:m8:sink4", "kivi:k2v2:g64:m8:sink4", "kivi:k2v2:g32:m8:sink4",
    "kivi:k3v3:g64:m8:sink4", "skvq:k2v2:g32:m8:sink4", "skvq:k3v3:g32:m8:sink4",
    "gear:k2v2:kcvt:r2:s1:m8:sink4", "zipcache:k2v2:h4:s10:m8:sink4", "skvq:k2v2:g64:sink4",
    "skvq:k2v2:g64:m8:sink4", "kcvt:k2v2:m8", "kcvt:k2v2", "skvq:k2v2:g64:m8", "skvq:k2v2:g64",
    "kivi:k2v2:g64:m8", "zipcache:k2v2:h4:s10:m8", "fp16",
    // The rotation stage (kernels/rotation.h) on the backbones it helps most.
    "kivi:k2v2:g64:rot:sink4", "kivi:k2v2:g32:rot:sink4", "kivi:k4v4:g32:rot:sink4",
    "kcvt:k2v2:rot:sink4", "kcvt:k2v2:m8:rot",
    // Coupled quantization (CQ): 4, 3.5, 3, 2.5, 2, 1.5 and 1 bits per element, codebooks
    // learned per shape.
    "cq:c2:b8:sink4", "cq:c2:b7:sink4", "cq:c2:b6:sink4", "cq:c2:b5:sink4", "cq:c4:b8:sink4",
    "cq:c4:b6:sink4", "cq:c8:b8:sink4", "cq:c4:b6", "cq:c8:b8"};

// The menu's CQ shapes' codebooks, per shape (its spec without sinks) and layer.
using CqBooks = std::map<std::string, std::vector<kernels::LayerCalibration>>;

// Sets a layer's codec to `candidate`, with the codebooks of its shape where it is CQ (and none
// where it is not, so that a saved calibration carries only what its layers use).
void AssignLayer(kernels::LayerCalibration& layer, const std::string& candidate, uint32_t li,
                 const CqBooks& books) {
  layer.spec = candidate;
  layer.k_codebook.clear();
  layer.v_codebook.clear();
  layer.k_metric.clear();
  layer.v_metric.clear();
  kernels::CodecSpec s = *kernels::CodecSpec::Parse(candidate);
  if (!s.is_codebook()) return;
  s.sink_tokens = 0;
  const auto it = books.find(s.ToString());
  if (it == books.end()) return;  // the codec refuses the layer, naming the missing codebooks
  layer.k_codebook = it->second[li].k_codebook;
  layer.v_codebook = it->second[li].v_codebook;
  layer.k_metric = it->second[li].k_metric;
  layer.v_metric = it->second[li].v_metric;
}

// Per-layer codecs for a budget (TaDA's precision search; the Strata mix): the loss increase of
// each candidate with only that layer compressed (log perplexity on the calibration text, the
// other layers at fp16), then the choice per layer that minimizes the summed increase with the
// average bits per element within the budget (a multiple-choice knapsack, exact by dynamic
// programming over 1/64-bit steps).
absl::Status SearchLayers(const LlamaModel& model, const std::vector<uint32_t>& ids,
                          const kernels::CodecSpec& spec, const CalibrationSearchOptions& o,
                          const CqBooks& books, kernels::Calibration& cal) {
  const ModelConfig& c = model.config();
  const uint32_t L = c.num_layers;
  std::vector<std::string> candidates;
  double budget = spec.budget_bits;
  if (spec.id == CodecId::kTada) {
    for (int bits : {2, 4, 8}) {
      kernels::CodecSpec t = spec;
      t.k_bits = t.v_bits = bits;
      candidates.push_back(t.ToString());
    }
    budget =
        kernels::Codec(spec).BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim).value();
  } else {
    candidates.assign(std::begin(kStrataMenu), std::end(kStrataMenu));
  }
  // Each candidate's size as eval measures it: the blocks of one full window, chunk 0's sinks
  // included.
  const uint32_t chunks = std::max<uint32_t>(1, o.context / o.chunk_tokens);
  std::vector<double> bits;
  for (const std::string& cs : candidates) {
    const kernels::Codec codec(*kernels::CodecSpec::Parse(cs));
    const double first =
        codec.BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim, 0).value();
    const double rest =
        codec.BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim, 1).value();
    bits.push_back((first + (chunks - 1) * rest) / chunks);
  }
  KvCacheOptions mo{.codec = cal.codec,
                    .chunk_tokens = o.chunk_tokens,
                    .window_tokens = o.window_tokens};
  // The loss is the mean KL divergence of the next-token distribution from the fp16 model's on
  // the calibration text: fidelity, which (unlike perplexity) no codec can improve by accident.
  const size_t kl_tokens = size_t{o.context} * o.windows;
  std::vector<float> reference;  // the first measurement's (all layers at fp16)
  auto measure = [&](const kernels::Calibration& trial) -> absl::StatusOr<PerplexityResult> {
    mo.calibration = std::make_shared<kernels::Calibration>(trial);
    return Perplexity(model, ids, mo, o.context, o.windows, kl_tokens,
                      reference.empty() ? &reference : nullptr,
                      reference.empty() ? nullptr : &reference);
  };
  auto loss = [&](const kernels::Calibration& trial) -> absl::StatusOr<double> {
    STRATA_ASSIGN_OR_RETURN(PerplexityResult r, measure(trial));
    return r.kl;
  };
  // delta[l][i]: loss increase with layer l alone at candidate i. It does not depend on the
  // budget, so one process searching several budgets (strata eval) measures it once: the key
  // holds the calibration without its codec string, which names the budget.
  static std::mutex cache_mu;
  static std::map<std::string, std::vector<std::vector<double>>> cache;
  kernels::Calibration unnamed = cal;
  unnamed.codec.clear();
  const std::string cache_key = absl::StrCat(
      model.fingerprint(), "/",
      Fingerprint64(absl::string_view(reinterpret_cast<const char*>(ids.data()), ids.size() * 4)),
      "/", o.context, "/", o.windows, "/", o.chunk_tokens, "/", o.window_tokens, "/",
      unnamed.fingerprint(), "/", absl::StrJoin(candidates, ","));
  std::vector<std::vector<double>> delta;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (auto it = cache.find(cache_key); it != cache.end()) delta = it->second;
  }
  auto all_fp16 = [&] {
    kernels::Calibration trial = cal;
    for (uint32_t li = 0; li < L; ++li) AssignLayer(trial.layers[li], "fp16", li, books);
    return trial;
  };
  if (delta.empty()) {
    kernels::Calibration trial = all_fp16();
    STRATA_ASSIGN_OR_RETURN(const double base, loss(trial));  // records the reference; 0
    delta.assign(L, std::vector<double>(candidates.size()));
    for (uint32_t li = 0; li < L; ++li) {
      for (size_t i = 0; i < candidates.size(); ++i) {
        AssignLayer(trial.layers[li], candidates[i], li, books);
        STRATA_ASSIGN_OR_RETURN(const double x, loss(trial));
        delta[li][i] = x - base;
      }
      AssignLayer(trial.layers[li], "fp16", li, books);
      if (o.progress) o.progress("layer choices", li + 1, L);
    }
    std::lock_guard<std::mutex> lock(cache_mu);
    cache[cache_key] = delta;
  }
  constexpr int kSteps = 64;  // cost units per bit
  std::vector<int> cost(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    cost[i] = static_cast<int>(std::ceil(bits[i] * kSteps - 1e-9));
  }
  const int cap = static_cast<int>(std::floor(budget * L * kSteps + 1e-9));
  // The joint step is the Strata mix's; TaDA's precision search stays as its paper has it.
  const size_t k = spec.id == CodecId::kStrata ? std::max<uint32_t>(1, o.joint_choices) : 1;
  const std::vector<std::vector<int>> choices = BestLayerChoices(delta, cost, cap, k);
  if (choices.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("calibrate: no per-layer choice of ",
                                                   spec.ToString(), " fits ", budget,
                                                   " bits per element"));
  }
  auto assign = [&](kernels::Calibration& to, const std::vector<int>& choice) {
    for (uint32_t li = 0; li < L; ++li)
      AssignLayer(to.layers[li], candidates[choice[li]], li, books);
  };
  if (choices.size() == 1) {
    assign(cal, choices[0]);
    return absl::OkStatus();
  }
  // The joint step: each choice measured whole over joint_windows windows, against the fp16
  // model's distribution on the same text (recorded first).
  // Its reference, [tokens][vocab] floats, kept within 1 GiB (a 128k vocabulary at 1,024-token
  // windows: 2 windows), never below the per-layer search's windows.
  constexpr size_t kMaxReferenceFloats = size_t{1} << 28;
  const size_t per_window = size_t{o.context} * std::max<uint32_t>(1, c.vocab_size);
  const uint32_t joint_windows = std::max<uint32_t>(
      o.windows, std::min<size_t>(o.joint_windows, kMaxReferenceFloats / per_window));
  const size_t joint_kl_tokens = size_t{o.context} * joint_windows;
  std::vector<float> joint_reference;
  auto measure_whole = [&](const kernels::Calibration& trial, std::vector<float>* record,
                           const std::vector<float>* ref) {
    mo.calibration = std::make_shared<kernels::Calibration>(trial);
    return Perplexity(model, ids, mo, o.context, joint_windows, joint_kl_tokens, record, ref);
  };
  STRATA_RETURN_IF_ERROR(measure_whole(all_fp16(), &joint_reference, nullptr).status());
  std::vector<PerplexityResult> whole;
  for (size_t n = 0; n < choices.size(); ++n) {
    kernels::Calibration trial = cal;
    assign(trial, choices[n]);
    STRATA_ASSIGN_OR_RETURN(PerplexityResult r, measure_whole(trial, nullptr, &joint_reference));
    whole.push_back(r);
    if (o.progress)
      o.progress("joint choices", static_cast<uint32_t>(n + 1),
                 static_cast<uint32_t>(choices.size()));
  }
  // Starting from the least KL (within the slack by definition): the most top-1-agreeing within
  // the slack, the lower KL between equals.
  size_t kept = 0;
  for (size_t n = 1; n < whole.size(); ++n) {
    if (whole[n].kl < whole[kept].kl) kept = n;
  }
  const double least = whole[kept].kl;
  for (size_t n = 0; n < whole.size(); ++n) {
    if (whole[n].kl > least + o.joint_kl_slack * std::abs(least) + 1e-12) continue;
    if (whole[n].top1 > whole[kept].top1 ||
        (whole[n].top1 == whole[kept].top1 && whole[n].kl < whole[kept].kl)) {
      kept = n;
    }
  }
  assign(cal, choices[kept]);
  return absl::OkStatus();
}

}  // namespace

std::vector<std::vector<int>> BestLayerChoices(const std::vector<std::vector<double>>& delta,
                                               const std::vector<int>& cost, int cap, size_t k) {
  const size_t L = delta.size();
  if (k == 0 || cap < 0) return {};
  // at[li][w]: the k best sums of layers 0..li-1 at total cost exactly w, each with its last
  // layer's candidate and the entry it extends (cost, rank) one layer up.
  struct Entry {
    double sum;
    int candidate, prev_w, prev_rank;
  };
  std::vector<std::vector<std::vector<Entry>>> at(
      L + 1, std::vector<std::vector<Entry>>(static_cast<size_t>(cap) + 1));
  at[0][0].push_back({0, -1, -1, -1});
  auto better = [](const Entry& a, const Entry& b) { return a.sum < b.sum; };
  for (size_t li = 0; li < L; ++li) {
    for (int w = 0; w <= cap; ++w) {
      const std::vector<Entry>& from = at[li][w];
      for (size_t r = 0; r < from.size(); ++r) {
        for (size_t i = 0; i < cost.size() && i < delta[li].size(); ++i) {
          const int nw = w + cost[i];
          if (nw > cap) continue;
          std::vector<Entry>& to = at[li + 1][nw];
          const Entry e{from[r].sum + delta[li][i], static_cast<int>(i), w, static_cast<int>(r)};
          if (to.size() == k && !better(e, to.back())) continue;
          to.insert(std::upper_bound(to.begin(), to.end(), e, better), e);
          if (to.size() > k) to.pop_back();
        }
      }
    }
  }
  std::vector<std::pair<double, std::pair<int, int>>> ends;  // sum, (cost, rank)
  for (int w = 0; w <= cap; ++w) {
    for (size_t r = 0; r < at[L][w].size(); ++r) {
      ends.push_back({at[L][w][r].sum, {w, static_cast<int>(r)}});
    }
  }
  std::sort(ends.begin(), ends.end());
  if (ends.size() > k) ends.resize(k);
  std::vector<std::vector<int>> out;
  for (const auto& [sum, where] : ends) {
    std::vector<int> choice(L);
    int w = where.first, r = where.second;
    for (size_t li = L; li > 0; --li) {
      const Entry& e = at[li][w][r];
      choice[li - 1] = e.candidate;
      w = e.prev_w;
      r = e.prev_rank;
    }
    out.push_back(std::move(choice));
  }
  return out;
}

absl::StatusOr<kernels::Calibration> SearchCalibration(const LlamaModel& model,
                                                       const std::vector<uint32_t>& ids,
                                                       const std::string& spec_text,
                                                       const CalibrationSearchOptions& o) {
  STRATA_ASSIGN_OR_RETURN(kernels::CodecSpec spec, kernels::CodecSpec::Parse(spec_text));
  const ModelConfig& c = model.config();
  kernels::Calibration cal;
  kernels::CodecSpec main = spec;
  main.sink_tokens = 0;
  cal.codec = main.ToString();
  cal.model_fingerprint = model.fingerprint();
  cal.kv_heads = c.num_kv_heads;
  cal.head_dim = c.head_dim;
  if (!spec.needs_calibration() && !spec.searches_layers()) return cal;
  // CQ's codebooks learn from codebook_windows windows (the mix's menu has CQ too); SKVQ's orders
  // and clips from the first `windows` of them.
  const bool cq = spec.id == CodecId::kCq || spec.id == CodecId::kStrata;
  const uint32_t windows = cq ? std::max(o.windows, o.codebook_windows) : o.windows;
  STRATA_ASSIGN_OR_RETURN(std::vector<LayerKv> kv, RunWindows(model, ids, o.context, windows));
  const uint32_t tokens =
      static_cast<uint32_t>(kv[0].k.size() / (size_t{c.num_kv_heads} * c.head_dim));
  cal.source = absl::StrCat(o.source, ", ", tokens, " tokens");
  cal.layers.resize(c.num_layers);
  CqBooks books;
  const std::vector<std::vector<float>> cq_weights =
      cq ? CqWeights(c, kv, tokens, o) : std::vector<std::vector<float>>(c.num_layers);
  if (spec.id == CodecId::kCq) {
    CalibrateCq(model, main, kv, tokens, o, cq_weights, cal);
  } else if (spec.id == CodecId::kSkvq) {
    STRATA_RETURN_IF_ERROR(CalibrateSkvq(model, cal.codec, kv, tokens, o, cal));
  } else if (spec.id == CodecId::kStrata) {  // SKVQ and CQ are on the menu
    const uint32_t skvq_tokens = std::min(tokens, o.context * o.windows);
    std::vector<LayerKv> first(kv.size());
    for (size_t li = 0; li < kv.size(); ++li) {
      auto prefix = [&](const std::vector<float>& x) {
        const size_t per_token = x.size() / tokens;
        return std::vector<float>(x.begin(), x.begin() + per_token * skvq_tokens);
      };
      first[li] = {prefix(kv[li].k), prefix(kv[li].v), prefix(kv[li].q)};
    }
    STRATA_RETURN_IF_ERROR(CalibrateSkvq(model, kStrataSkvq, first, skvq_tokens, o, cal));
    for (const char* candidate : kStrataMenu) {
      kernels::CodecSpec shape = *kernels::CodecSpec::Parse(candidate);
      if (!shape.is_codebook()) continue;
      shape.sink_tokens = 0;
      if (books.contains(shape.ToString())) continue;  // the same shape with sinks: learned once
      kernels::Calibration learned;
      learned.layers.resize(c.num_layers);
      CalibrateCq(model, shape, kv, tokens, o, cq_weights, learned);
      books[shape.ToString()] = std::move(learned.layers);
    }
  }
  if (spec.searches_layers()) {
    STRATA_RETURN_IF_ERROR(SearchLayers(model, ids, spec, o, books, cal));
  }
  return cal;
}

}  // namespace strata::model
