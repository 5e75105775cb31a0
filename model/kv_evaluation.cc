#include "model/kv_evaluation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"
#include "common/block_format.h"
#include "common/block_reader.h"
#include "common/status_macros.h"
#include "kernels/block_operands.h"
#include "kernels/codec_spec.h"
#include "kernels/decode_attention.h"
#include "kernels/rotation.h"
#include "model/cpu_backend.h"

namespace strata::model {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

double RelError(absl::Span<const float> want, absl::Span<const float> got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double{want[i]} - got[i];
    num += d * d;
    den += double{want[i]} * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

absl::StatusOr<PerplexityResult> Perplexity(const LlamaModel& model,
                                            const std::vector<uint32_t>& ids,
                                            const KvCacheOptions& cache_options, uint32_t context,
                                            uint32_t max_windows, size_t kl_tokens,
                                            std::vector<float>* record,
                                            const std::vector<float>* reference) {
  return Perplexity(CpuBackend(&model), ids, cache_options, context, max_windows, kl_tokens, record,
                    reference);
}

absl::StatusOr<PerplexityResult> Perplexity(const ComputeBackend& model,
                                            const std::vector<uint32_t>& ids,
                                            const KvCacheOptions& cache_options, uint32_t context,
                                            uint32_t max_windows, size_t kl_tokens,
                                            std::vector<float>* record,
                                            const std::vector<float>* reference) {
  const ModelConfig& c = model.config();
  if (ids.size() < 2) return absl::InvalidArgumentError("ppl: the text has fewer than 2 tokens");
  if (context < 2) return absl::InvalidArgumentError("ppl: --context must be >= 2");
  const uint32_t chunk_tokens = cache_options.chunk_tokens;
  PerplexityResult r;
  double nll = 0, kl = 0;
  size_t kl_n = 0, top1_n = 0;
  std::vector<double> logp(c.vocab_size);
  if (record != nullptr) record->clear();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t start = 0; start + 1 < ids.size(); start += context) {
    if (max_windows != 0 && r.windows == max_windows) break;
    const size_t end = std::min(ids.size(), start + context);
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, model.NewCache(cache_options));
    KvCache* const caches[] = {cache.get()};
    for (size_t s = start; s < end; s += chunk_tokens) {
      const size_t e = std::min(end, s + chunk_tokens);
      const absl::Span<const uint32_t> piece[] = {absl::MakeConstSpan(ids).subspan(s, e - s)};
      STRATA_ASSIGN_OR_RETURN(std::vector<std::vector<float>> step, model.StepBatch(piece, caches));
      const std::vector<float>& logits = step[0];
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
            for (uint32_t v = 0; v < c.vocab_size; ++v) {
              d += std::exp(double{ref[v]}) * (ref[v] - logp[v]);
            }
            kl += d;
            ++kl_n;
            // Both in float, as the reference is kept: no tie the rounding made decides it.
            size_t best = 0;
            for (uint32_t v = 1; v < c.vocab_size; ++v) {
              if (static_cast<float>(logp[v]) > static_cast<float>(logp[best])) best = v;
            }
            top1_n += static_cast<size_t>(std::max_element(ref, ref + c.vocab_size) - ref) == best;
          }
        }
        ++r.scored;
      }
    }
    r.block_bytes += cache->block_bytes();
    r.block_elements += cache->blocks_per_layer() * size_t{chunk_tokens} * c.num_layers *
                        c.num_kv_heads * c.head_dim * 2;
    ++r.windows;
  }
  r.ppl = std::exp(nll / r.scored);
  r.kl = kl_n > 0 ? kl / kl_n : 0;
  r.top1 = kl_n > 0 ? static_cast<double>(top1_n) / kl_n : 0;
  r.seconds = Seconds(t0);
  return r;
}

absl::StatusOr<LayerErrors> MeasureLayerErrors(const ModelConfig& c,
                                               const std::vector<LayerKv>& kv, uint32_t tokens,
                                               const kernels::Codec& codec, uint32_t chunk,
                                               uint32_t queries, int only_layer) {
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
    // A rotating codec (`rot`) quantizes K and V rotated, and attention runs on rotated queries:
    // measured there, as the cache holds them. The transform is orthonormal, so each relative
    // error is what it would be in the original space.
    STRATA_ASSIGN_OR_RETURN(const kernels::CodecSpec spec,
                            kernels::CodecSpec::Parse(codec.LayerSpec(li)));
    LayerKv rotated;
    if (spec.rotate) {
      STRATA_ASSIGN_OR_RETURN(const kernels::HadamardRotation r,
                              kernels::HadamardRotation::Make(D, li));
      rotated = kv[li];
      r.Apply(rotated.k.data(), rotated.k.size() / D);
      r.Apply(rotated.v.data(), rotated.v.size() / D);
      r.Apply(rotated.q.data(), rotated.q.size() / D);
    }
    const LayerKv& lk = spec.rotate ? rotated : kv[li];
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

namespace {

// max over channels / median over channels of each channel's max |x| over the rows.
// x: [rows, channels]. `top` gets the largest channel's index.
double Spread(const float* x, size_t rows, size_t channels, uint32_t* top) {
  std::vector<double> peak(channels, 0.0);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < channels; ++c) {
      peak[c] = std::max(peak[c], static_cast<double>(std::fabs(x[r * channels + c])));
    }
  }
  if (top != nullptr) {
    *top = static_cast<uint32_t>(std::max_element(peak.begin(), peak.end()) - peak.begin());
  }
  const double mx = *std::max_element(peak.begin(), peak.end());
  std::nth_element(peak.begin(), peak.begin() + channels / 2, peak.end());
  const double median = peak[channels / 2];
  return median > 0 ? mx / median : 0;
}

}  // namespace

absl::StatusOr<KvStructure> MeasureKvStructure(const ModelConfig& c, const std::vector<LayerKv>& kv,
                                               uint32_t tokens, uint32_t sink_from) {
  const uint32_t H = c.num_kv_heads, D = c.head_dim, QH = c.num_heads;
  if (tokens == 0 || sink_from >= tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv structure: ", tokens, " tokens leave no query from token ", sink_from, " on"));
  }
  const size_t row = size_t{H} * D, qrow = size_t{QH} * D;
  KvStructure out;
  out.tokens = tokens;
  for (uint32_t li = 0; li < kv.size(); ++li) {
    const LayerKv& lk = kv[li];
    if (lk.k.size() < tokens * row || lk.v.size() < tokens * row || lk.q.size() < tokens * qrow) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv structure: layer ", li, " holds fewer than ", tokens, " tokens"));
    }
    KvStructure::Layer l;
    l.k_spread = Spread(lk.k.data(), tokens, row, &l.k_top_channel);
    l.v_spread = Spread(lk.v.data(), tokens, row, nullptr);
    STRATA_ASSIGN_OR_RETURN(const kernels::HadamardRotation r,
                            kernels::HadamardRotation::Make(D, li));
    std::vector<float> k(lk.k.begin(), lk.k.begin() + tokens * row);
    std::vector<float> v(lk.v.begin(), lk.v.begin() + tokens * row);
    r.Apply(k.data(), k.size() / D);
    r.Apply(v.data(), v.size() / D);
    l.k_spread_rotated = Spread(k.data(), tokens, row, nullptr);
    l.v_spread_rotated = Spread(v.data(), tokens, row, nullptr);
    // Causal softmax of each query over the keys up to it: the weight on key 0.
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    double mass = 0;
    size_t n = 0;
    std::vector<double> s(tokens);
    for (uint32_t t = sink_from; t < tokens; ++t) {
      for (uint32_t qh = 0; qh < QH; ++qh) {
        const float* q = &lk.q[t * qrow + size_t{qh} * D];
        const uint32_t h = qh / (QH / H);
        double mx = -1e300;
        for (uint32_t j = 0; j <= t; ++j) {
          const float* kj = &lk.k[j * row + size_t{h} * D];
          double d = 0;
          for (uint32_t i = 0; i < D; ++i) d += double{q[i]} * kj[i];
          s[j] = d * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (uint32_t j = 0; j <= t; ++j) sum += std::exp(s[j] - mx);
        mass += std::exp(s[0] - mx) / sum;
        ++n;
      }
    }
    l.first_token_mass = mass / static_cast<double>(n);
    out.layers.push_back(l);
  }
  return out;
}

}  // namespace strata::model
