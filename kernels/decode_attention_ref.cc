// The specification of decode attention: every block decoded to fp32, then textbook softmax
// attention in double. Slow on purpose; the fused kernels are held to it.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/decode_attention.h"
#include "kernels/internal/attention_segment.h"

namespace strata::kernels {

absl::Status DecodeAttentionRef(const DecodeAttentionParams& p,
                                absl::Span<const DecodeSequence> batch) {
  STRATA_RETURN_IF_ERROR(internal::ValidateAttention(p, batch));
  const uint32_t H = p.kv_heads, D = p.head_dim, G = p.q_heads / p.kv_heads;
  const double scale = internal::SoftmaxScale(p);
  for (const DecodeSequence& seq : batch) {
    // Gather every token's K and V at fp32: [N, H, D].
    std::vector<float> k, v;
    auto append = [&](const float* ks, const float* vs, size_t tokens) {
      k.insert(k.end(), ks, ks + tokens * H * D);
      v.insert(v.end(), vs, vs + tokens * H * D);
    };
    if (seq.sinks.tokens > 0) append(seq.sinks.k, seq.sinks.v, seq.sinks.tokens);
    for (const BlockOperands* b : seq.blocks) {
      std::vector<float> bk(size_t{b->tokens} * H * D), bv(bk.size());
      STRATA_RETURN_IF_ERROR(DecodeOperandsRef(*b, bk.data(), bv.data()));
      append(bk.data(), bv.data(), b->tokens);
    }
    if (seq.window.tokens > 0) append(seq.window.k, seq.window.v, seq.window.tokens);
    const size_t n = k.size() / (size_t{H} * D);
    std::vector<double> s(n);
    for (uint32_t qt = 0; qt < seq.query_tokens; ++qt) {
      // Query token qt sees everything up to and including itself.
      const size_t visible = n - (seq.query_tokens - 1 - qt);
      for (uint32_t qh = 0; qh < p.q_heads; ++qh) {
        const uint32_t h = qh / G;
        const float* q = seq.q + (size_t{qt} * p.q_heads + qh) * D;
        double mx = -INFINITY;
        for (size_t t = 0; t < visible; ++t) {
          double dot = 0;
          for (uint32_t d = 0; d < D; ++d) dot += double{q[d]} * k[(t * H + h) * D + d];
          s[t] = dot * scale;
          mx = std::max(mx, s[t]);
        }
        double sum = 0;
        for (size_t t = 0; t < visible; ++t) sum += (s[t] = std::exp(s[t] - mx));
        for (uint32_t d = 0; d < D; ++d) {
          double o = 0;
          for (size_t t = 0; t < visible; ++t) o += s[t] * v[(t * H + h) * D + d];
          seq.out[(size_t{qt} * p.q_heads + qh) * D + d] = static_cast<float>(o / sum);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
