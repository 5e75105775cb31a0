#include "tools/model_commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "common/block_reader.h"
#include "kernels/block_operands.h"
#include "kernels/codec.h"
#include "kernels/decode_attention.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "nlohmann/json.hpp"
#include "model/safetensors.h"
#include "model/text_stream.h"
#include "model/tokenizer.h"

namespace strata::tools {
namespace {

struct Loaded {
  std::unique_ptr<model::LlamaModel> model;
  std::unique_ptr<model::Tokenizer> tokenizer;
};

absl::StatusOr<Loaded> Load(const ModelCommandOptions& o) {
  Loaded l;
  STRATA_ASSIGN_OR_RETURN(l.model, model::LlamaModel::Load(o.model_dir));
  STRATA_ASSIGN_OR_RETURN(l.tokenizer, model::Tokenizer::Load(o.model_dir));
  return l;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<uint32_t> WithBos(const model::ModelConfig& c, std::vector<uint32_t> ids) {
  if (c.bos_token_id >= 0 && (ids.empty() || ids[0] != c.bos_token_id)) {
    ids.insert(ids.begin(), static_cast<uint32_t>(c.bos_token_id));
  }
  return ids;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

struct PplResult {
  double ppl = 0;
  size_t scored = 0, windows = 0;
  size_t block_bytes = 0, block_elements = 0;  // every block made, and the K+V elements in them
  double seconds = 0;
  double kl = 0;  // mean KL(reference || this) over the tokens the reference covers, nats
  double bits() const { return block_elements > 0 ? 8.0 * block_bytes / block_elements : 0; }
};

// Perplexity with the KV cache compressed as in serving: each window prefilled chunk by chunk,
// each chunk attending over the compressed earlier chunks (+ the full-precision window).
// Optional: `record` gets the log-probabilities of the first `kl_tokens` scored positions
// ([kl_tokens, vocab]); with `reference` (as recorded by another run on the same text) the mean
// KL divergence from it is computed over those positions: fidelity to the reference, which
// unlike perplexity cannot improve by accident.
absl::StatusOr<PplResult> Perplexity(const Loaded& l, const std::vector<uint32_t>& ids,
                                     const ModelCommandOptions& o, uint32_t context,
                                     uint32_t max_windows, size_t kl_tokens = 0,
                                     std::vector<float>* record = nullptr,
                                     const std::vector<float>* reference = nullptr) {
  const model::ModelConfig& c = l.model->config();
  if (ids.size() < 2) return absl::InvalidArgumentError("ppl: the text has fewer than 2 tokens");
  if (context < 2) return absl::InvalidArgumentError("ppl: --context must be >= 2");
  PplResult r;
  double nll = 0, kl = 0;
  size_t kl_n = 0;
  std::vector<double> logp(c.vocab_size);
  if (record != nullptr) record->clear();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t start = 0; start + 1 < ids.size(); start += context) {
    if (max_windows != 0 && r.windows == max_windows) break;
    const size_t end = std::min(ids.size(), start + context);
    STRATA_ASSIGN_OR_RETURN(auto cache, l.model->NewCache({.codec = o.codec,
                                                           .chunk_tokens = o.chunk_tokens,
                                                           .window_tokens = o.window_tokens,
                                                           .calibration = o.calibration}));
    for (size_t s = start; s < end; s += o.chunk_tokens) {
      const size_t e = std::min(end, s + o.chunk_tokens);
      STRATA_ASSIGN_OR_RETURN(
          std::vector<float> logits,
          l.model->Step(absl::MakeConstSpan(ids).subspan(s, e - s), cache.get()));
      for (size_t t = s; t < e && t + 1 < end; ++t) {
        const float* row = &logits[(t - s) * c.vocab_size];
        const float mx = *std::max_element(row, row + c.vocab_size);
        double sum = 0;
        for (uint32_t v = 0; v < c.vocab_size; ++v) sum += std::exp(double{row[v]} - mx);
        const double lse = mx + std::log(sum);
        nll += -(row[ids[t + 1]] - lse);
        if (r.scored < kl_tokens) {
          for (uint32_t v = 0; v < c.vocab_size; ++v) logp[v] = row[v] - lse;
          if (record != nullptr) record->insert(record->end(), logp.begin(), logp.end());
          if (reference != nullptr && (r.scored + 1) * c.vocab_size <= reference->size()) {
            const float* ref = &(*reference)[r.scored * c.vocab_size];
            double d = 0;
            for (uint32_t v = 0; v < c.vocab_size; ++v) d += std::exp(double{ref[v]}) * (ref[v] - logp[v]);
            kl += d;
            ++kl_n;
          }
        }
        ++r.scored;
      }
    }
    r.block_bytes += cache->block_bytes();
    r.block_elements += cache->blocks_per_layer() * size_t{o.chunk_tokens} * c.num_layers *
                        c.num_kv_heads * c.head_dim * 2;
    ++r.windows;
  }
  r.ppl = std::exp(nll / r.scored);
  r.kl = kl_n > 0 ? kl / kl_n : 0;
  r.seconds = Seconds(t0);
  return r;
}

}  // namespace

absl::Status RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& info) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  const std::vector<uint32_t> prompt = WithBos(c, l.tokenizer->Encode(o.prompt));
  STRATA_ASSIGN_OR_RETURN(auto cache,
                          l.model->NewCache({.codec = o.codec,
                                             .chunk_tokens = o.chunk_tokens,
                                             .window_tokens = o.window_tokens,
                                             .calibration = o.calibration}));
  const auto t0 = std::chrono::steady_clock::now();
  // Serving's chunk-aligned prefill (LlamaModel::Prefill), so that the output is the cluster's
  // for the same codec; a cache with a full-precision window (--kv_window) prefills in one step.
  STRATA_ASSIGN_OR_RETURN(std::vector<float> logits,
                          o.window_tokens == 0 ? l.model->Prefill(prompt, cache.get())
                                               : l.model->Step(prompt, cache.get()));
  const double prefill_s = Seconds(t0);
  const model::Sampler sampler({.temperature = o.temperature, .top_k = o.top_k, .top_p = o.top_p,
                                .seed = o.seed});
  STRATA_RETURN_IF_ERROR(sampler.options().Validate());
  std::vector<uint32_t> generated;
  // What a client of the HTTP API sees: well-formed UTF-8, a character split across tokens
  // printed once whole, bytes that form none shown as U+FFFD.
  model::TextStream text(l.tokenizer.get(), {});
  out << o.prompt;
  const auto t1 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < o.max_tokens; ++i) {
    const uint32_t next = sampler.Sample(
        absl::MakeConstSpan(logits).subspan(logits.size() - c.vocab_size), i);
    if (c.eos_token_id >= 0 && next == c.eos_token_id) break;
    generated.push_back(next);
    STRATA_ASSIGN_OR_RETURN(model::TextStream::Piece piece, text.Add(next));
    out << piece.text << std::flush;
    if (i + 1 == o.max_tokens) break;  // the last token's logits are never used
    STRATA_ASSIGN_OR_RETURN(logits, l.model->Step({&next, 1}, cache.get()));
  }
  out << text.Finish() << "\n";
  const double decode_s = Seconds(t1);
  info << absl::StrFormat(
      "[%d prompt tokens in %.3f s (%.1f tok/s), %d generated in %.3f s (%.1f tok/s); KV cache %s: "
      "%d blocks of %d tokens per layer (%d bytes) + %d-token window]\n",
      prompt.size(), prefill_s, prompt.size() / prefill_s, generated.size(), decode_s,
      generated.size() / std::max(decode_s, 1e-9), o.codec, cache->blocks_per_layer(),
      o.chunk_tokens, cache->block_bytes(), cache->window_tokens());
  return absl::OkStatus();
}

absl::Status RunPpl(const PplOptions& o, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  STRATA_ASSIGN_OR_RETURN(PplResult r, Perplexity(l, ids, o, o.context, o.max_windows));
  out << absl::StrFormat(
      "perplexity %.4f over %d tokens (%d windows of up to %d) with KV codec %s at %.3f bits "
      "per element (%d-token chunks, all metadata counted); %.1f s\n",
      r.ppl, r.scored, r.windows, o.context, o.codec, r.bits(), o.chunk_tokens, r.seconds);
  return absl::OkStatus();
}

namespace {

double RelError(absl::Span<const float> want, absl::Span<const float> got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double{want[i]} - got[i];
    num += d * d;
    den += double{want[i]} * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct LayerErrors {
  std::vector<double> k, v, attn;
  double encode_seconds = 0;
  size_t encoded_bytes_in = 0;  // fp16 bytes of the K and V encoded
};

// Encodes the window's K/V chunk by chunk with the codec, as a prefill node would (with each
// chunk's queries), and compares per layer: K and V decoded against the originals, and the
// attention output of the window's last queries over blocks + full-precision rest against
// attention over the original K/V.
absl::StatusOr<LayerErrors> MeasureErrors(const Loaded& l, const std::vector<model::LayerKv>& kv,
                                          uint32_t tokens, const kernels::Codec& codec,
                                          uint32_t chunk, uint32_t queries, int only_layer = -1) {
  const model::ModelConfig& c = l.model->config();
  const uint32_t H = c.num_kv_heads, D = c.head_dim, QH = c.num_heads;
  const size_t row = size_t{H} * D, qrow = size_t{QH} * D;
  const uint32_t blocks = (tokens - queries) / chunk;
  if (blocks == 0) {
    return absl::InvalidArgumentError(absl::StrCat("eval: ", tokens, " tokens leave no ", chunk,
                                                   "-token chunk before the ", queries,
                                                   " error queries; use more text or a larger "
                                                   "--context"));
  }
  LayerErrors e;
  const size_t n = size_t{blocks} * chunk * row;
  std::vector<float> k_dec(n), v_dec(n), out(queries * qrow), ref(out.size());
  for (uint32_t li = 0; li < kv.size(); ++li) {
    if (only_layer >= 0 && li != static_cast<uint32_t>(only_layer)) continue;
    const model::LayerKv& lk = kv[li];
    std::vector<AlignedBuffer> buffers;
    std::vector<kernels::PreparedBlock> prepared;
    for (uint32_t b = 0; b < blocks; ++b) {
      kernels::KvChunkView view{lk.k.data() + b * chunk * row, lk.v.data() + b * chunk * row,
                                SourceDType::kFloat32, chunk, H, D};
      view.q = lk.q.data() + b * chunk * qrow;
      view.q_heads = QH;
      const auto t0 = std::chrono::steady_clock::now();
      STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf,
                              codec.Encode(view, {.layer = li, .chunk_index = b}));
      e.encode_seconds += Seconds(t0);
      e.encoded_bytes_in += size_t{chunk} * row * 2 * 2;
      buffers.push_back(std::move(buf));
    }
    for (uint32_t b = 0; b < blocks; ++b) {
      STRATA_ASSIGN_OR_RETURN(BlockView view, BlockView::Parse(buffers[b].span()));
      STRATA_ASSIGN_OR_RETURN(kernels::PreparedBlock p,
                              kernels::PrepareBlock(view, codec.calibration()));
      STRATA_RETURN_IF_ERROR(kernels::DecodePreparedRef(p, &k_dec[b * chunk * row],
                                                        &v_dec[b * chunk * row]));
      prepared.push_back(std::move(p));
    }
    e.k.push_back(RelError(absl::MakeConstSpan(lk.k).first(n), k_dec));
    e.v.push_back(RelError(absl::MakeConstSpan(lk.v).first(n), v_dec));
    std::vector<const kernels::BlockOperands*> parts;
    for (const kernels::PreparedBlock& p : prepared) {
      for (const kernels::BlockOperands& part : p.parts) parts.push_back(&part);
    }
    const kernels::DecodeAttentionParams params{QH, H, D};
    const size_t done = size_t{blocks} * chunk;
    kernels::DecodeSequence seq;
    seq.q = lk.q.data() + (tokens - queries) * qrow;
    seq.query_tokens = queries;
    seq.blocks = parts;
    seq.window = {lk.k.data() + done * row, lk.v.data() + done * row,
                  static_cast<uint32_t>(tokens - done)};
    seq.out = out.data();
    STRATA_RETURN_IF_ERROR(kernels::DecodeAttention(params, {&seq, 1}));
    kernels::DecodeSequence full = seq;
    full.blocks = {};
    full.window = {lk.k.data(), lk.v.data(), tokens};
    full.out = ref.data();
    STRATA_RETURN_IF_ERROR(kernels::DecodeAttention(params, {&full, 1}));
    e.attn.push_back(RelError(ref, out));
  }
  return e;
}

// Forward passes over the calibration windows, K/V/q of each layer concatenated.
absl::StatusOr<std::vector<model::LayerKv>> RunWindows(const Loaded& l,
                                                       const std::vector<uint32_t>& ids,
                                                       uint32_t context, uint32_t windows) {
  std::vector<model::LayerKv> all;
  for (uint32_t w = 0; w < windows && size_t{w + 1} * context <= ids.size(); ++w) {
    std::vector<model::LayerKv> kv;
    const std::vector<uint32_t> window(ids.begin() + size_t{w} * context,
                                       ids.begin() + size_t{w + 1} * context);
    STRATA_RETURN_IF_ERROR(l.model->Forward(window, &kv).status());
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

}  // namespace

// SKVQ's part of a calibration: channel orders and clip ratios, for `skvq_spec`.
static absl::Status CalibrateSkvq(const Loaded& l, const std::string& skvq_spec,
                                  const std::vector<model::LayerKv>& kv, uint32_t tokens,
                                  const CalibrateOptions& o, kernels::Calibration& cal) {
  const model::ModelConfig& c = l.model->config();
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
  std::vector<model::LayerKv> first(kv.size());
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
                                MeasureErrors(l, first, o.context, *codec, o.chunk_tokens,
                                              o.error_queries, static_cast<int>(li)));
        if (e.attn[0] < best) {
          best = e.attn[0];
          best_clip = clip;
        }
      }
      cal.layers[li].*field = best_clip;
    }
  }
  cal.codec = codec;
  return absl::OkStatus();
}


// The Strata mix's menu: every method, at several sizes, each with fp16 sinks.
constexpr char kStrataSkvq[] = "skvq:k2v2:g32";
const char* const kStrataMenu[] = {
    "kivi:k2v2:g64:sink4",     "kivi:k2v2:g32:sink4",        "kivi:k3v3:g32:sink4",
    "kivi:k4v4:g32:sink4",     "kivi:k4v2:g32:sink4",        "kivi:k2v4:g32:sink4",
    "kivi:k8v8:g32:sink4",     "kcvt:k2v2:sink4",            "kcvt:k4v4:sink4",
    "gear:k2v2:kcvt:r2:s1:sink4", "gear:k2v2:g64:r2:s1:sink4", "gear:k3v3:kcvt:r2:s1:sink4",
    "gear:k4v4:kcvt:r2:s1:sink4", "zipcache:k2v2:h4:s10:sink4", "zipcache:k2v2:h8:s10:sink4",
    "zipcache:k3v3:h8:s10:sink4", "skvq:k2v2:g32:sink4",     "skvq:k3v3:g32:sink4",
    "skvq:k4v4:g32:sink4",     "tada:k2v2:g32:sink4",        "tada:k4v4:g32:sink4",
    "kcvt:k2v2:m8:sink4",      "kivi:k2v2:g64:m8:sink4",     "kivi:k2v2:g32:m8:sink4",
    "kivi:k3v3:g64:m8:sink4",  "skvq:k2v2:g32:m8:sink4",     "skvq:k3v3:g32:m8:sink4",
    "gear:k2v2:kcvt:r2:s1:m8:sink4", "zipcache:k2v2:h4:s10:m8:sink4", "skvq:k2v2:g64:sink4",
    "skvq:k2v2:g64:m8:sink4",  "kcvt:k2v2:m8",               "kcvt:k2v2",
    "skvq:k2v2:g64:m8",        "skvq:k2v2:g64",              "kivi:k2v2:g64:m8",
    "zipcache:k2v2:h4:s10:m8", "fp16"};

// Per-layer codecs for a budget (TaDA's precision search; the Strata mix): the loss increase of
// each candidate with only that layer compressed (log perplexity on the calibration text, the
// other layers at fp16), then the choice per layer that minimizes the summed increase with the
// average bits per element within the budget (a multiple-choice knapsack, exact by dynamic
// programming over 1/64-bit steps).
static absl::Status SearchLayers(const Loaded& l, const std::vector<uint32_t>& ids,
                                 const kernels::CodecSpec& spec,
                                 const std::vector<model::LayerKv>& kv, uint32_t tokens,
                                 const CalibrateOptions& o, kernels::Calibration& cal) {
  (void)kv;
  (void)tokens;
  const model::ModelConfig& c = l.model->config();
  const uint32_t L = c.num_layers;
  std::vector<std::string> candidates;
  double budget = spec.budget_bits;
  if (spec.id == CodecId::kTada) {
    for (int bits : {2, 4, 8}) {
      kernels::CodecSpec t = spec;
      t.k_bits = t.v_bits = bits;
      candidates.push_back(t.ToString());
    }
    budget = kernels::Codec(spec).BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim).value();
  } else {
    candidates.assign(std::begin(kStrataMenu), std::end(kStrataMenu));
  }
  // Each candidate's size as eval measures it: the blocks of one full window, chunk 0's sinks
  // included.
  const uint32_t chunks = std::max<uint32_t>(1, o.context / o.chunk_tokens);
  std::vector<double> bits;
  for (const std::string& cs : candidates) {
    const kernels::Codec codec(*kernels::CodecSpec::Parse(cs));
    const double first = codec.BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim, 0).value();
    const double rest = codec.BitsPerElement(o.chunk_tokens, c.num_kv_heads, c.head_dim, 1).value();
    bits.push_back((first + (chunks - 1) * rest) / chunks);
  }
  ModelCommandOptions mo = o;
  mo.codec = cal.codec;
  // The loss is the mean KL divergence of the next-token distribution from the fp16 model's on
  // the calibration text: fidelity, which (unlike perplexity) no codec can improve by accident.
  const size_t kl_tokens = size_t{o.context} * o.windows;
  std::vector<float> reference;
  auto loss = [&](const kernels::Calibration& trial) -> absl::StatusOr<double> {
    mo.calibration = std::make_shared<kernels::Calibration>(trial);
    STRATA_ASSIGN_OR_RETURN(PplResult r, Perplexity(l, ids, mo, o.context, o.windows, kl_tokens,
                                                    reference.empty() ? &reference : nullptr,
                                                    reference.empty() ? nullptr : &reference));
    return r.kl;
  };
  // delta[l][i]: loss increase with layer l alone at candidate i. It does not depend on the
  // budget, so one process searching several budgets (strata eval) measures it once.
  static std::mutex cache_mu;
  static std::map<std::string, std::vector<std::vector<double>>> cache;
  const std::string cache_key = absl::StrCat(
      l.model->fingerprint(), "/", Fingerprint64(absl::string_view(
                                        reinterpret_cast<const char*>(ids.data()), ids.size() * 4)),
      "/", o.context, "/", o.windows, "/", o.chunk_tokens, "/", o.window_tokens, "/",
      cal.fingerprint(), "/", absl::StrJoin(candidates, ","));
  std::vector<std::vector<double>> delta;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (auto it = cache.find(cache_key); it != cache.end()) delta = it->second;
  }
  if (delta.empty()) {
    kernels::Calibration trial = cal;
    for (auto& layer : trial.layers) layer.spec = "fp16";
    STRATA_ASSIGN_OR_RETURN(const double base, loss(trial));  // records the reference; 0
    delta.assign(L, std::vector<double>(candidates.size()));
    for (uint32_t li = 0; li < L; ++li) {
      for (size_t i = 0; i < candidates.size(); ++i) {
        trial.layers[li].spec = candidates[i];
        STRATA_ASSIGN_OR_RETURN(const double x, loss(trial));
        delta[li][i] = x - base;
      }
      trial.layers[li].spec = "fp16";
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
  const double inf = std::numeric_limits<double>::infinity();
  // best[li + 1][w]: least summed increase of layers 0..li at total cost exactly w.
  std::vector<std::vector<double>> best(L + 1, std::vector<double>(cap + 1, inf));
  std::vector<std::vector<int>> pick(L + 1, std::vector<int>(cap + 1, -1));
  best[0][0] = 0;
  for (uint32_t li = 0; li < L; ++li) {
    for (int w = 0; w <= cap; ++w) {
      if (best[li][w] == inf) continue;
      for (size_t i = 0; i < candidates.size(); ++i) {
        const int nw = w + cost[i];
        if (nw > cap) continue;
        const double v = best[li][w] + delta[li][i];
        if (v < best[li + 1][nw]) {
          best[li + 1][nw] = v;
          pick[li + 1][nw] = static_cast<int>(i);
        }
      }
    }
  }
  int w_best = -1;
  for (int w = 0; w <= cap; ++w) {
    if (best[L][w] < inf && (w_best < 0 || best[L][w] < best[L][w_best])) w_best = w;
  }
  if (w_best < 0) {
    return absl::InvalidArgumentError(absl::StrCat("calibrate: no per-layer choice of ",
                                                   spec.ToString(), " fits ", budget,
                                                   " bits per element"));
  }
  for (int li = static_cast<int>(L); li > 0; --li) {
    const int i = pick[li][w_best];
    cal.layers[li - 1].spec = candidates[i];
    w_best -= cost[i];
  }
  return absl::OkStatus();
}

static absl::StatusOr<kernels::Calibration> Calibrate(const Loaded& l, const std::vector<uint32_t>& ids,
                                               const std::string& spec_text,
                                               const CalibrateOptions& o) {
  STRATA_ASSIGN_OR_RETURN(kernels::CodecSpec spec, kernels::CodecSpec::Parse(spec_text));
  const model::ModelConfig& c = l.model->config();
  kernels::Calibration cal;
  kernels::CodecSpec main = spec;
  main.sink_tokens = 0;
  cal.codec = main.ToString();
  cal.model_fingerprint = l.model->fingerprint();
  cal.kv_heads = c.num_kv_heads;
  cal.head_dim = c.head_dim;
  if (!spec.needs_calibration() && !spec.searches_layers()) return cal;
  STRATA_ASSIGN_OR_RETURN(std::vector<model::LayerKv> kv,
                          RunWindows(l, ids, o.context, o.windows));
  const uint32_t tokens = static_cast<uint32_t>(kv[0].k.size() / (size_t{c.num_kv_heads} * c.head_dim));
  cal.source = absl::StrCat(o.source, ", ", tokens, " tokens");
  cal.layers.resize(c.num_layers);
  if (spec.id == CodecId::kSkvq) {
    STRATA_RETURN_IF_ERROR(CalibrateSkvq(l, cal.codec, kv, tokens, o, cal));
  } else if (spec.id == CodecId::kStrata) {  // SKVQ is on the menu
    STRATA_RETURN_IF_ERROR(CalibrateSkvq(l, kStrataSkvq, kv, tokens, o, cal));
  }
  if (spec.searches_layers()) {
    STRATA_RETURN_IF_ERROR(SearchLayers(l, ids, spec, kv, tokens, o, cal));
  }
  return cal;
}

absl::Status RunCalibrate(const CalibrateOptions& o, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(l.model->config(), l.tokenizer->Encode(text, false));
  CalibrateOptions co = o;
  if (co.source.empty()) co.source = o.text_file;
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_ASSIGN_OR_RETURN(kernels::Calibration cal, Calibrate(l, ids, o.codec, co));
  STRATA_RETURN_IF_ERROR(cal.Save(o.out_file));
  out << absl::StrFormat("wrote %s: calibration %016x of %s for %s (%d layers; %s); %.1f s\n",
                         o.out_file, cal.fingerprint(), cal.codec, o.model_dir, cal.layers.size(),
                         cal.source, Seconds(t0));
  for (size_t i = 0; i < cal.layers.size(); ++i) {
    out << absl::StrFormat("  layer %d: clip K %.2f V %.2f\n", i, cal.layers[i].k_clip,
                           cal.layers[i].v_clip);
  }
  return absl::OkStatus();
}

namespace {

// Greedy continuation of each prompt with the given cache codec.
absl::StatusOr<std::vector<std::vector<uint32_t>>> Continue(
    const Loaded& l, const std::vector<std::vector<uint32_t>>& prompts,
    const model::KvCacheOptions& opts, uint32_t n) {
  const model::ModelConfig& c = l.model->config();
  std::vector<std::vector<uint32_t>> out;
  for (const std::vector<uint32_t>& p : prompts) {
    STRATA_ASSIGN_OR_RETURN(auto cache, l.model->NewCache(opts));
    STRATA_ASSIGN_OR_RETURN(std::vector<float> logits, l.model->Step(p, cache.get()));
    std::vector<uint32_t> gen;
    for (uint32_t i = 0; i < n; ++i) {
      const float* last = &logits[logits.size() - c.vocab_size];
      const uint32_t next =
          static_cast<uint32_t>(std::max_element(last, last + c.vocab_size) - last);
      gen.push_back(next);
      if (i + 1 == n) break;
      STRATA_ASSIGN_OR_RETURN(logits, l.model->Step({&next, 1}, cache.get()));
    }
    out.push_back(std::move(gen));
  }
  return out;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

double Max(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

}  // namespace

absl::Status RunEval(const EvalOptions& o, std::ostream& out) {
  if (o.codecs.empty()) return absl::InvalidArgumentError("eval: --codecs names no codec");
  for (const std::string& spec : o.codecs) {
    STRATA_RETURN_IF_ERROR(kernels::CodecSpec::Parse(spec).status());
  }
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  if (ids.size() < size_t{o.prompt_tokens} + o.generate_tokens + 2 || ids.size() < o.context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval: the text has ", ids.size(), " tokens; it needs at least --context (", o.context,
        ") and a prompt + continuation (", o.prompt_tokens + o.generate_tokens, ")"));
  }
  if (o.error_queries < 1 || o.error_queries >= o.context) {
    return absl::InvalidArgumentError("eval: error queries must be in [1, context)");
  }
  // The error window: the text's first `context` tokens, run once at full precision.
  std::vector<model::LayerKv> kv;
  const std::vector<uint32_t> window(ids.begin(), ids.begin() + o.context);
  STRATA_RETURN_IF_ERROR(l.model->Forward(window, &kv).status());
  // Continuation prompts spread over the text, each starting with BOS.
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < o.continuations; ++i) {
    const size_t span = ids.size() - o.prompt_tokens - o.generate_tokens;
    const size_t start = span * i / std::max<uint32_t>(1, o.continuations);
    std::vector<uint32_t> p(ids.begin() + start, ids.begin() + start + o.prompt_tokens);
    prompts.push_back(WithBos(c, std::move(p)));
  }
  model::KvCacheOptions base_opts{.codec = "fp16", .chunk_tokens = o.chunk_tokens,
                                  .window_tokens = o.window_tokens};
  STRATA_ASSIGN_OR_RETURN(auto baseline_gen,
                          Continue(l, prompts, base_opts, o.generate_tokens));
  ModelCommandOptions fp16 = o;
  fp16.codec = "fp16";
  // KL to fp16 over the first two windows (the reference log-probabilities are vocab-sized).
  const size_t kl_tokens = 2 * size_t{o.context};
  std::vector<float> reference;
  STRATA_ASSIGN_OR_RETURN(PplResult base, Perplexity(l, ids, fp16, o.context, o.max_windows,
                                                     kl_tokens, &reference));

  nlohmann::json report = {
      {"model", o.model_dir},
      {"text", o.text_file},
      {"context", o.context},
      {"windows", base.windows},
      {"kl_tokens", std::min(kl_tokens, base.scored)},
      {"scored_tokens", base.scored},
      {"chunk_tokens", o.chunk_tokens},
      {"window_tokens", o.window_tokens},
      {"continuations", o.continuations},
      {"prompt_tokens", o.prompt_tokens},
      {"generate_tokens", o.generate_tokens},
      {"fp16_perplexity", base.ppl},
      {"codecs", nlohmann::json::array()}};
  out << absl::StrFormat(
      "model %s, text %s: perplexity over %d tokens (%d windows of %d), errors on the first %d "
      "tokens (last %d queries), %d greedy continuations of %d tokens after %d-token prompts; "
      "%d-token chunks, full-precision window >= %d\n",
      o.model_dir, o.text_file, base.scored, base.windows, o.context, o.context, o.error_queries,
      o.continuations, o.generate_tokens, o.prompt_tokens, o.chunk_tokens, o.window_tokens);
  out << absl::StrFormat("%-32s %6s %9s %8s %8s %8s %8s %8s %8s %8s %7s %7s %8s\n", "codec",
                         "bits", "ppl", "d ppl %", "KL nats", "K err", "K worst", "V err",
                         "V worst", "attn err", "greedy", "prefix", "enc MB/s");
  std::map<std::string, std::vector<std::string>> layer_choices;
  std::vector<uint32_t> calib_ids;
  if (!o.calib_text_file.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string calib_text, ReadText(o.calib_text_file));
    calib_ids = WithBos(c, l.tokenizer->Encode(calib_text, false));
  }
  for (const std::string& spec : o.codecs) {
    ModelCommandOptions mo = o;
    mo.codec = spec;
    const kernels::CodecSpec parsed = *kernels::CodecSpec::Parse(spec);
    if (parsed.needs_calibration() || (parsed.searches_layers() && !calib_ids.empty())) {
      if (calib_ids.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "eval: codec ", spec, " needs calibration; give --calib_text (text disjoint from ",
            o.text_file, ")"));
      }
      CalibrateOptions co;
      co.context = std::min<uint32_t>(o.context, static_cast<uint32_t>(calib_ids.size()));
      co.windows = 2;
      co.chunk_tokens = o.chunk_tokens;
      co.error_queries = o.error_queries;
      co.source = o.calib_text_file;
      absl::StatusOr<kernels::Calibration> cal = Calibrate(l, calib_ids, spec, co);
      if (!cal.ok()) {  // e.g. a budget no per-layer choice fits: say so, go on
        out << absl::StrFormat("%-32s %s\n", spec, cal.status().ToString());
        report["codecs"].push_back({{"codec", spec}, {"error", cal.status().ToString()}});
        continue;
      }
      mo.calibration = std::make_shared<kernels::Calibration>(*std::move(cal));
      if (parsed.searches_layers()) {  // the per-layer choice, for the reader and the JSON
        std::vector<std::string> chosen;
        for (const kernels::LayerCalibration& lc : mo.calibration->layers) chosen.push_back(lc.spec);
        layer_choices[spec] = chosen;
        out << absl::StrFormat("%-32s layers: %s\n", spec, absl::StrJoin(chosen, " | "));
      }
    }
    STRATA_ASSIGN_OR_RETURN(auto codec, kernels::Codec::Create(spec, mo.calibration));
    STRATA_ASSIGN_OR_RETURN(PplResult r, Perplexity(l, ids, mo, o.context, o.max_windows,
                                                    kl_tokens, nullptr, &reference));
    STRATA_ASSIGN_OR_RETURN(LayerErrors e,
                            MeasureErrors(l, kv, o.context, *codec, o.chunk_tokens, o.error_queries));
    model::KvCacheOptions opts = base_opts;
    opts.codec = spec;
    opts.calibration = mo.calibration;
    STRATA_ASSIGN_OR_RETURN(auto gen, Continue(l, prompts, opts, o.generate_tokens));
    double same = 0, prefix = 0;
    for (size_t i = 0; i < gen.size(); ++i) {
      size_t p = 0;
      while (p < gen[i].size() && gen[i][p] == baseline_gen[i][p]) ++p;
      prefix += p;
      for (size_t t = 0; t < gen[i].size(); ++t) same += gen[i][t] == baseline_gen[i][t];
    }
    const double total = static_cast<double>(gen.size()) * o.generate_tokens;
    const double agreement = total > 0 ? same / total : 1.0;
    const double mean_prefix = gen.empty() ? 0 : prefix / gen.size();
    const double mbps = e.encode_seconds > 0 ? e.encoded_bytes_in / e.encode_seconds / 1e6 : 0;
    const double dppl = 100.0 * (r.ppl / base.ppl - 1.0);
    out << absl::StrFormat(
        "%-32s %6.3f %9.3f %+8.2f %8.5f %8.4f %8.4f %8.4f %8.4f %8.4f %6.1f%% %7.1f %8.1f\n", spec,
        r.bits(), r.ppl, dppl, r.kl, Mean(e.k), Max(e.k), Mean(e.v), Max(e.v), Mean(e.attn),
        100 * agreement, mean_prefix, mbps);
    report["codecs"].push_back({{"codec", spec},
                                {"bits_per_element", r.bits()},
                                {"perplexity", r.ppl},
                                {"perplexity_change_percent", dppl},
                                {"kl_to_fp16_nats", r.kl},
                                {"k_rel_error", {{"per_layer", e.k}, {"mean", Mean(e.k)}, {"worst", Max(e.k)}}},
                                {"v_rel_error", {{"per_layer", e.v}, {"mean", Mean(e.v)}, {"worst", Max(e.v)}}},
                                {"attn_rel_error",
                                 {{"per_layer", e.attn}, {"mean", Mean(e.attn)}, {"worst", Max(e.attn)}}},
                                {"greedy_agreement", agreement},
                                {"greedy_common_prefix_tokens", mean_prefix},
                                {"encode_mb_per_s_one_thread", mbps}});
    if (auto lc = layer_choices.find(spec); lc != layer_choices.end()) {
      report["codecs"].back()["layer_codecs"] = lc->second;
    }
  }
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    f << report.dump(1) << "\n";
    if (!f) return absl::InternalError(absl::StrCat("eval: cannot write ", o.json_out));
    out << "wrote " << o.json_out << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunDumpKv(const DumpKvOptions& o, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  if (ids.size() > o.max_tokens) ids.resize(o.max_tokens);
  std::vector<model::LayerKv> kv;
  STRATA_RETURN_IF_ERROR(l.model->Forward(ids, &kv).status());
  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  std::vector<model::TensorToWrite> tensors;
  const int64_t t = static_cast<int64_t>(ids.size());
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  tensors.push_back(
      {"token_ids",
       model::TensorDType::kI32,
       {t},
       absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(ids32.data()), ids32.size() * 4)});
  for (uint32_t i = 0; i < kv.size(); ++i) {
    for (const auto& [name, v] : {std::pair{"k", &kv[i].k}, std::pair{"v", &kv[i].v}}) {
      tensors.push_back(
          {absl::StrCat("layers.", i, ".", name),
           model::TensorDType::kF32,
           {t, c.num_kv_heads, c.head_dim},
           absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v->data()), v->size() * 4)});
    }
  }
  const std::string path = o.out_dir + "/kv.safetensors";
  STRATA_RETURN_IF_ERROR(model::WriteSafetensors(path, tensors));
  out << absl::StrFormat(
      "wrote %s: %d tokens, %d layers of K (after RoPE) and V, [%d, %d, %d] "
      "fp32 each\n",
      path, t, kv.size(), t, c.num_kv_heads, c.head_dim);
  return absl::OkStatus();
}

}  // namespace strata::tools
