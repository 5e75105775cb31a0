#include "model/llama.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kernels/decode_attention.h"
#include "model/matmul.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

// Reads a tensor of the expected shape into fp32.
absl::Status ReadTensor(const Checkpoint& ck, const std::string& name, std::vector<int64_t> shape,
                        std::vector<float>* out) {
  STRATA_ASSIGN_OR_RETURN(Checkpoint::Tensor t, ck.Get(name));
  if (t.info->shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: tensor '", name, "' has shape [", absl::StrJoin(t.info->shape, ", "),
                     "], the config implies [", absl::StrJoin(shape, ", "), "]"));
  }
  const size_t n = static_cast<size_t>(t.info->numel());
  out->resize(n);
  switch (t.info->dtype) {
    case TensorDType::kF32:
      std::memcpy(out->data(), t.data.data(), n * 4);
      break;
    case TensorDType::kF16:
      HalfToFloat(reinterpret_cast<const Half*>(t.data.data()), out->data(), n);
      break;
    case TensorDType::kBF16:
      BFloat16ToFloat(reinterpret_cast<const BFloat16*>(t.data.data()), out->data(), n);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "model: tensor '", name, "' is ", TensorDTypeName(t.info->dtype), ", not F32/F16/BF16"));
  }
  return absl::OkStatus();
}

// y[n, out] = x[n, in] . W^T (+ b). Up to kRowInvariantRows rows (a decode step's batch) a
// row's result is the same bits alone or in any batch, so a sequence's output never depends on
// which others share its continuous batch (model/matmul.h).
void Linear(const float* x, int n, int in, const std::vector<float>& w, const std::vector<float>& b,
            int out, float* y) {
  MatMul(x, n, in, w.data(), out, y, ThreadPool::Default());
  if (!b.empty()) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < out; ++j) y[static_cast<size_t>(i) * out + j] += b[j];
    }
  }
}

void RmsNorm(const float* x, int n, int d, const std::vector<float>& w, double eps, float* y) {
  for (int i = 0; i < n; ++i) {
    const float* xi = x + static_cast<size_t>(i) * d;
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += double{xi[j]} * xi[j];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
    for (int j = 0; j < d; ++j) y[static_cast<size_t>(i) * d + j] = xi[j] * r * w[j];
  }
}

}  // namespace

namespace {
uint64_t FingerprintOf(const ModelConfig& c, const Checkpoint& ck) {
  return Fingerprint64(absl::StrCat(c.Fingerprint(), ":", ck.ContentDigest()));
}
}  // namespace

absl::StatusOr<uint64_t> ModelFingerprint(const std::string& dir) {
  STRATA_ASSIGN_OR_RETURN(const ModelConfig c, LoadModelConfig(dir));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ck, Checkpoint::Open(dir));
  return FingerprintOf(c, *ck);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& dir) {
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  STRATA_ASSIGN_OR_RETURN(m->config_, LoadModelConfig(dir));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ck, Checkpoint::Open(dir));
  const ModelConfig& c = m->config_;
  const int64_t hs = c.hidden_size, qd = int64_t{c.num_heads} * c.head_dim,
                kvd = int64_t{c.num_kv_heads} * c.head_dim, ff = c.intermediate_size;
  STRATA_RETURN_IF_ERROR(
      ReadTensor(*ck, "model.embed_tokens.weight", {c.vocab_size, hs}, &m->embed_));
  STRATA_RETURN_IF_ERROR(ReadTensor(*ck, "model.norm.weight", {hs}, &m->norm_));
  if (!c.tie_word_embeddings) {
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, "lm_head.weight", {c.vocab_size, hs}, &m->lm_head_));
  }
  m->layers_.resize(c.num_layers);
  for (uint32_t i = 0; i < c.num_layers; ++i) {
    Layer& l = m->layers_[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "input_layernorm.weight", {hs}, &l.input_norm));
    STRATA_RETURN_IF_ERROR(
        ReadTensor(*ck, p + "post_attention_layernorm.weight", {hs}, &l.post_norm));
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.q_proj.weight", {qd, hs}, &l.wq));
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.k_proj.weight", {kvd, hs}, &l.wk));
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.v_proj.weight", {kvd, hs}, &l.wv));
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.o_proj.weight", {hs, qd}, &l.wo));
    if (c.attention_bias && c.model_type != "qwen2") {  // Llama/Mistral: o_proj has one too
      STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.o_proj.bias", {hs}, &l.bo));
    }
    if (c.attention_bias) {
      STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.q_proj.bias", {qd}, &l.bq));
      STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.k_proj.bias", {kvd}, &l.bk));
      STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "self_attn.v_proj.bias", {kvd}, &l.bv));
    }
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "mlp.gate_proj.weight", {ff, hs}, &l.w_gate));
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "mlp.up_proj.weight", {ff, hs}, &l.w_up));
    STRATA_RETURN_IF_ERROR(ReadTensor(*ck, p + "mlp.down_proj.weight", {hs, ff}, &l.w_down));
  }
  m->fingerprint_ = FingerprintOf(c, *ck);
  // RoPE frequencies, with Llama 3's long-context scaling when configured.
  const uint32_t half = c.head_dim / 2;
  m->inv_freq_.resize(half);
  for (uint32_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(c.rope_theta, 2.0 * i / c.head_dim);
    if (c.rope_scaling_type == "linear") {
      f /= c.rope_scaling_factor;
    } else if (c.rope_scaling_type == "llama3") {
      const double low_wavelen = c.rope_original_max_position / c.rope_low_freq_factor;
      const double high_wavelen = c.rope_original_max_position / c.rope_high_freq_factor;
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= c.rope_scaling_factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (c.rope_original_max_position / wavelen - c.rope_low_freq_factor) /
                              (c.rope_high_freq_factor - c.rope_low_freq_factor);
        f = (1 - smooth) * f / c.rope_scaling_factor + smooth * f;
      }
    }
    m->inv_freq_[i] = static_cast<float>(f);
  }
  return m;
}

// Rotates (i, i + D/2) channel pairs of every head, as Hugging Face's rotate_half does.
void LlamaModel::Rope(float* x, uint32_t position0, uint32_t tokens, uint32_t heads) const {
  const uint32_t d = config_.head_dim, half = d / 2;
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(position0 + t) * inv_freq_[i];
      const float c = static_cast<float>(std::cos(ang)), s = static_cast<float>(std::sin(ang));
      for (uint32_t h = 0; h < heads; ++h) {
        float* v = x + (size_t{t} * heads + h) * d;
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<SequenceKvCache>> LlamaModel::NewCache(
    KvCacheOptions options) const {
  options.model_fingerprint = fingerprint_;
  return SequenceKvCache::Create(options, config_.num_layers, config_.num_kv_heads,
                                 config_.head_dim);
}

absl::StatusOr<std::vector<float>> LlamaModel::Forward(absl::Span<const uint32_t> tokens,
                                                       std::vector<LayerKv>* kv) const {
  return Run(tokens, nullptr, kv);
}

absl::StatusOr<std::vector<float>> LlamaModel::Step(absl::Span<const uint32_t> tokens,
                                                    SequenceKvCache* cache) const {
  if (cache == nullptr) return absl::InvalidArgumentError("model: Step needs a cache");
  return Run(tokens, cache, nullptr);
}

absl::StatusOr<std::vector<float>> LlamaModel::Run(absl::Span<const uint32_t> tokens,
                                                   SequenceKvCache* cache,
                                                   std::vector<LayerKv>* kv) const {
  const absl::Span<const uint32_t> one[] = {tokens};
  SequenceKvCache* const caches[] = {cache};
  STRATA_ASSIGN_OR_RETURN(std::vector<std::vector<float>> logits,
                          RunBatch(one,
                                   cache != nullptr ? absl::MakeConstSpan(caches)
                                                    : absl::Span<SequenceKvCache* const>(),
                                   kv));
  return std::move(logits[0]);
}

absl::StatusOr<std::vector<float>> LlamaModel::Prefill(absl::Span<const uint32_t> tokens,
                                                       SequenceKvCache* cache,
                                                       const LayerHook& hook,
                                                       const PieceLogits& piece_logits) const {
  if (cache == nullptr) return absl::InvalidArgumentError("model: Prefill needs a cache");
  if (tokens.empty()) return absl::InvalidArgumentError("model: Prefill of no tokens");
  const KvCacheOptions& o = cache->options();
  if (o.window_tokens != 0) {
    return absl::InvalidArgumentError(
        "model: Prefill needs a cache without a full-precision window (window_tokens 0)");
  }
  SequenceKvCache* const caches[] = {cache};
  return PrefillInPieces(
      tokens, cache->tokens(), o.chunk_tokens, config_.vocab_size,
      [&](absl::Span<const uint32_t> piece, bool last_only) -> absl::StatusOr<std::vector<float>> {
        const absl::Span<const uint32_t> one[] = {piece};
        STRATA_ASSIGN_OR_RETURN(std::vector<std::vector<float>> logits,
                                RunBatch(one, caches, nullptr, hook, last_only));
        return std::move(logits[0]);
      },
      piece_logits, "model");
}

absl::StatusOr<std::vector<std::vector<float>>> LlamaModel::StepBatch(
    absl::Span<const absl::Span<const uint32_t>> tokens, absl::Span<SequenceKvCache* const> caches,
    const LayerHook& hook) const {
  if (tokens.size() != caches.size() || tokens.empty()) {
    return absl::InvalidArgumentError("model: StepBatch needs one cache per sequence");
  }
  for (size_t i = 0; i < caches.size(); ++i) {
    if (caches[i] == nullptr) return absl::InvalidArgumentError("model: a null cache");
    for (size_t j = 0; j < i; ++j) {
      if (caches[j] == caches[i]) return absl::InvalidArgumentError("model: a cache twice");
    }
  }
  return RunBatch(tokens, caches, nullptr, hook);
}

// Every sequence's new tokens go through the matrix products together (one sgemm per weight for
// the whole batch); attention runs per sequence over its own cache, in one batched call.
absl::StatusOr<std::vector<std::vector<float>>> LlamaModel::RunBatch(
    absl::Span<const absl::Span<const uint32_t>> seqs, absl::Span<SequenceKvCache* const> caches,
    std::vector<LayerKv>* kv, const LayerHook& hook, bool last_only) const {
  const ModelConfig& c = config_;
  const bool cached = !caches.empty();
  std::vector<uint32_t> row0(seqs.size() + 1, 0), pos0(seqs.size(), 0);
  for (size_t s = 0; s < seqs.size(); ++s) {
    if (seqs[s].empty())
      return absl::InvalidArgumentError(absl::StrCat("model: sequence ", s, " has no tokens"));
    for (size_t i = 0; i < seqs[s].size(); ++i) {
      if (seqs[s][i] >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("model: token ", i, " of sequence ", s, " is ", seqs[s][i],
                         ", beyond the vocabulary of ", c.vocab_size));
      }
    }
    row0[s + 1] = row0[s] + static_cast<uint32_t>(seqs[s].size());
    pos0[s] = cached ? caches[s]->tokens() : 0;
    const uint64_t end = uint64_t{pos0[s]} + seqs[s].size();
    if (c.sliding_window != 0 && end > c.sliding_window) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: ", end, " tokens exceed the sliding window of ", c.sliding_window,
                       "; sliding-window attention is not implemented"));
    }
    if (end > c.max_position_embeddings * 4ull) {
      return absl::InvalidArgumentError(absl::StrCat("model: position ", end,
                                                     " is far beyond the model's context of ",
                                                     c.max_position_embeddings));
    }
  }
  const int n = static_cast<int>(row0.back());
  const int hs = static_cast<int>(c.hidden_size), qd = static_cast<int>(c.num_heads * c.head_dim),
            kvd = static_cast<int>(c.num_kv_heads * c.head_dim),
            ff = static_cast<int>(c.intermediate_size);
  std::vector<float> x(static_cast<size_t>(n) * hs), h(x.size()), q(size_t(n) * qd),
      k(size_t(n) * kvd), v(k.size()), att(q.size()), o(x.size()), g(size_t(n) * ff), u(g.size());
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (size_t i = 0; i < seqs[s].size(); ++i) {
      std::memcpy(&x[(row0[s] + i) * size_t(hs)], &embed_[size_t{seqs[s][i]} * hs],
                  hs * sizeof(float));
    }
  }
  if (kv != nullptr) kv->assign(c.num_layers, {});
  auto discard = [&] {
    for (SequenceKvCache* cache : caches) cache->DiscardUncommitted();
  };
  const kernels::DecodeAttentionParams params{c.num_heads, c.num_kv_heads, c.head_dim};
  std::vector<kernels::DecodeSequence> batch(seqs.size());
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    const Layer& l = layers_[li];
    RmsNorm(x.data(), n, hs, l.input_norm, c.rms_norm_eps, h.data());
    Linear(h.data(), n, hs, l.wq, l.bq, qd, q.data());
    Linear(h.data(), n, hs, l.wk, l.bk, kvd, k.data());
    Linear(h.data(), n, hs, l.wv, l.bv, kvd, v.data());
    for (size_t s = 0; s < seqs.size(); ++s) {
      const uint32_t rows = row0[s + 1] - row0[s];
      float* qs = &q[size_t{row0[s]} * qd];
      float* ks = &k[size_t{row0[s]} * kvd];
      float* vs = &v[size_t{row0[s]} * kvd];
      Rope(qs, pos0[s], rows, c.num_heads);
      Rope(ks, pos0[s], rows, c.num_kv_heads);
      kernels::DecodeSequence& seq = batch[s];
      if (cached) {
        caches[s]->AppendWindow(li, ks, vs, rows, qs, c.num_heads);
        seq = caches[s]->View(li);
        // A rotated layer (`rot`): its keys are rotated, so the queries are too.
        if (const kernels::HadamardRotation* r = caches[s]->rotation(li)) {
          r->Apply(qs, size_t{rows} * c.num_heads);
        }
      } else {
        seq = {};
        seq.window = {ks, vs, rows};
      }
      seq.q = qs;
      seq.query_tokens = rows;
      seq.out = &att[size_t{row0[s]} * qd];
    }
    if (kv != nullptr) {
      (*kv)[li].k = k;
      (*kv)[li].v = v;
      (*kv)[li].q = q;
    }
    const absl::Status attn = kernels::DecodeAttention(params, batch);
    if (!attn.ok()) {
      discard();
      return attn;
    }
    // A rotated layer's values are rotated, and so is what attention made of them.
    for (size_t s = 0; cached && s < seqs.size(); ++s) {
      if (const kernels::HadamardRotation* r = caches[s]->rotation(li)) {
        r->Invert(&att[size_t{row0[s]} * qd], size_t{row0[s + 1] - row0[s]} * c.num_heads);
      }
    }
    Linear(att.data(), n, qd, l.wo, l.bo, hs, o.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    RmsNorm(x.data(), n, hs, l.post_norm, c.rms_norm_eps, h.data());
    Linear(h.data(), n, hs, l.w_gate, {}, ff, g.data());
    Linear(h.data(), n, hs, l.w_up, {}, ff, u.data());
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    Linear(g.data(), n, ff, l.w_down, {}, hs, o.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    if (hook) {
      const absl::Status hs_status = hook(li);
      if (!hs_status.ok()) {
        discard();
        return hs_status;
      }
    }
  }
  for (size_t s = 0; s < caches.size(); ++s) {
    const absl::Status st = caches[s]->Commit(row0[s + 1] - row0[s]);
    if (!st.ok()) {  // earlier caches committed; later ones are put back as they were
      for (size_t t = s + 1; t < caches.size(); ++t) caches[t]->DiscardUncommitted();
      return st;
    }
  }
  // The final norm and the vocabulary projection, for every token or each sequence's last.
  std::vector<float> xs;
  const float* final_in = x.data();
  int rows = n;
  if (last_only) {
    xs.resize(seqs.size() * size_t(hs));
    for (size_t s = 0; s < seqs.size(); ++s) {
      std::memcpy(&xs[s * hs], &x[size_t{row0[s + 1] - 1} * hs], hs * sizeof(float));
    }
    final_in = xs.data();
    rows = static_cast<int>(seqs.size());
  }
  RmsNorm(final_in, rows, hs, norm_, c.rms_norm_eps, h.data());
  std::vector<float> logits(size_t(rows) * c.vocab_size);
  Linear(h.data(), rows, hs, lm_head_.empty() ? embed_ : lm_head_, {},
         static_cast<int>(c.vocab_size), logits.data());
  std::vector<std::vector<float>> out(seqs.size());
  for (size_t s = 0; s < seqs.size(); ++s) {
    const size_t first = last_only ? s : row0[s];
    const size_t end = last_only ? s + 1 : row0[s + 1];
    out[s].assign(logits.begin() + first * c.vocab_size, logits.begin() + end * c.vocab_size);
  }
  return out;
}

}  // namespace strata::model
