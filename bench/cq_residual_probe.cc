// cq_residual_probe: shapes of CQ that no codec has, measured before one is built (a residual
// second stage, keys and values at different bits, runs over RoPE pairs, salient tokens at a
// larger codebook) against CQ as it is, at the same bits. On a model's real KV (issue 44), per
// layer: codebooks learned on calibration text, then the
// held-out window's K and V encoded by each candidate and compared with the originals (relative
// L2 error) and through attention (the last --queries queries of the window, each over every
// earlier token, the first 4 tokens kept exact as the codecs' sink4 keeps them: relative L2 error
// of the attention output).
//
// A candidate is one or more stages, "c8b8+c8b8": each stage k-means over the runs of its
// channels of what the stages before it left (the residual), its codes chosen greedily (the
// nearest centroid, stage after stage); bits per element is the sum of each stage's bits / c.
// "K/V" gives keys and values stages of their own ("c4b6/c4b8": keys at 1.5 bits, values at 2;
// bits per element their mean).
// Codebooks are learned unweighted (no attention weights, no metrics, no norms) for every
// candidate alike, so the comparison is between the stage structures, not the calibration
// options. This is a probe of the method, not a codec: nothing here is stored or served.
//
// --k_order rope couples each key channel with its RoPE partner: the keys' channels are taken in
// the order 0, D/2, 1, D/2 + 1, ... before the runs are cut (a run of 2 is one rotation pair, a
// run of 4 two neighbouring pairs), and put back after; values keep their order.
//
// --exact_tail N keeps the window's last N tokens exact too (a full-precision window, as serving
// keeps the chunk not yet full). --salient P:STAGES sends each --chunk's (256) P % most attended
// tokens through STAGES instead (ZipCache's split, with its normalized attention from the chunk's
// own queries, as a prefill node would measure it); bits then count both shares and a bit per
// token for the map.
//
// Usage: cq_residual_probe [--model DIR] [--calib FILE] [--heldout FILE] [--context N]
//                          [--calib_windows N] [--queries N] [--candidates a,b,...]
//                          [--k_order natural|rope] [--exact_tail N] [--chunk N]
//                          [--salient P:STAGES]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/half.h"
#include "kernels/codebook.h"
#include "model/llama.h"
#include "model/tokenizer.h"

namespace strata::bench {
namespace {

struct Stage {
  int group = 4, bits = 8;
};

// "c8b8+c4b4" -> stages; false on a malformed candidate.
bool ParseCandidate(const std::string& text, std::vector<Stage>* out) {
  for (absl::string_view s : absl::StrSplit(text, '+')) {
    Stage st;
    const size_t b = s.find('b');
    if (s.size() < 4 || s[0] != 'c' || b == absl::string_view::npos ||
        !absl::SimpleAtoi(s.substr(1, b - 1), &st.group) ||
        !absl::SimpleAtoi(s.substr(b + 1), &st.bits) ||
        (st.group != 2 && st.group != 4 && st.group != 8) || st.bits < 3 || st.bits > 8) {
      return false;
    }
    out->push_back(st);
  }
  return !out->empty();
}

// x [tokens, heads, dim] replaced by its nearest centroids under `books` (fp16 [heads, dim / c,
// 2^b, c], TrainCodebooks' layout).
void Quantize(std::vector<float>& x, uint32_t tokens, uint32_t heads, uint32_t dim, Stage st,
              const std::vector<uint16_t>& books) {
  const uint32_t runs = dim / st.group, entries = 1u << st.bits;
  std::vector<float> cent(size_t{entries} * st.group);
  std::vector<uint8_t> codes(tokens);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t r = 0; r < runs; ++r) {
      const uint16_t* book = &books[(size_t{h} * runs + r) * entries * st.group];
      for (size_t i = 0; i < cent.size(); ++i) cent[i] = HalfBitsToFloat(book[i]);
      float* first = &x[size_t{h} * dim + size_t{r} * st.group];
      const size_t stride = size_t{heads} * dim;
      kernels::CentroidSearch(cent.data(), entries, st.group)  // entries >= 8: bits >= 3
          .NearestMany(first, tokens, stride, codes.data(), 1);
      for (uint32_t t = 0; t < tokens; ++t) {
        std::memcpy(first + t * stride, &cent[size_t{codes[t]} * st.group],
                    sizeof(float) * st.group);
      }
    }
  }
}

// x [rows, dim] with each row's channels taken in the order 0, dim/2, 1, dim/2 + 1, ... (or put
// back from it, `back`).
void RopeOrder(std::vector<float>& x, uint32_t dim, bool back) {
  std::vector<float> row(dim);
  const uint32_t half = dim / 2;
  for (size_t r = 0; r < x.size() / dim; ++r) {
    float* p = &x[r * dim];
    for (uint32_t i = 0; i < half; ++i) {
      if (back) {
        row[i] = p[2 * i];
        row[i + half] = p[2 * i + 1];
      } else {
        row[2 * i] = p[i];
        row[2 * i + 1] = p[i + half];
      }
    }
    std::copy(row.begin(), row.end(), p);
  }
}

// p[0..pos] = softmax over tokens 0..pos of q . k_t / sqrt(D), k_t the rows of KV head kh in
// k [tokens, KH, D] (p holds at least pos + 1).
void Softmax(const float* q, const float* k, uint32_t pos, uint32_t KH, uint32_t kh, uint32_t D,
             std::vector<double>& p) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  double mx = -1e300;
  for (uint32_t t = 0; t <= pos; ++t) {
    const float* kt = &k[(size_t{t} * KH + kh) * D];
    double d = 0;
    for (uint32_t i = 0; i < D; ++i) d += double{q[i]} * kt[i];
    p[t] = d * scale;
    mx = std::max(mx, p[t]);
  }
  double sum = 0;
  for (uint32_t t = 0; t <= pos; ++t) sum += (p[t] = std::exp(p[t] - mx));
  for (uint32_t t = 0; t <= pos; ++t) p[t] /= sum;
}

// The held-out `x` [tokens, heads, dim] through `stages` whose codebooks are learned on `train`
// [train_tokens, heads, dim] (stage after stage, each on what the last left), keys' channels in
// RoPE-pair order where `reorder`.
std::vector<float> Through(std::vector<float> train, uint32_t train_tokens, std::vector<float> x,
                           uint32_t tokens, uint32_t heads, uint32_t dim,
                           const std::vector<Stage>& stages, bool reorder, uint32_t seed) {
  if (reorder) {
    RopeOrder(train, dim, false);
    RopeOrder(x, dim, false);
  }
  std::vector<float> out(x.size(), 0.0f);
  uint32_t n = 0;
  for (const Stage& s : stages) {
    const std::vector<uint16_t> books = kernels::TrainCodebooks(
        train.data(), train_tokens, heads, dim, s.group, s.bits, seed + 16 * ++n);
    std::vector<float> q = train;
    Quantize(q, train_tokens, heads, dim, s, books);
    for (size_t i = 0; i < q.size(); ++i) train[i] -= q[i];
    std::vector<float> xs = x;
    Quantize(xs, tokens, heads, dim, s, books);
    for (size_t i = 0; i < xs.size(); ++i) {
      x[i] -= xs[i];
      out[i] += xs[i];
    }
  }
  if (reorder) RopeOrder(out, dim, true);
  return out;
}

// Per token of the window, whether it is among its chunk's `percent` % (rounded up) with the most
// attention from the chunk's queries after it (summed over query heads, divided by how many
// queries see it: ZipCache's normalized attention).
std::vector<bool> SalientTokens(const model::ModelConfig& c, const model::LayerKv& kv,
                                uint32_t tokens, uint32_t chunk, double percent) {
  const uint32_t H = c.num_heads, KH = c.num_kv_heads, D = c.head_dim, G = H / KH;
  std::vector<bool> out(tokens, false);
  std::vector<double> p(tokens);
  for (uint32_t c0 = 0; c0 < tokens; c0 += chunk) {
    const uint32_t c1 = std::min(tokens, c0 + chunk);
    std::vector<double> score(c1 - c0, 0.0);
    for (uint32_t pos = c0; pos < c1; ++pos) {
      for (uint32_t h = 0; h < H; ++h) {
        Softmax(&kv.q[(size_t{pos} * H + h) * D], kv.k.data(), pos, KH, h / G, D, p);
        for (uint32_t t = c0; t <= pos; ++t) score[t - c0] += p[t];
      }
    }
    std::vector<uint32_t> order(c1 - c0);
    for (uint32_t i = 0; i < order.size(); ++i) {
      order[i] = i;
      score[i] /= c1 - (c0 + i);  // the queries of the chunk that see token c0 + i
    }
    const size_t keep =
        std::min<size_t>(order.size(), static_cast<size_t>(std::ceil(percent / 100.0 * chunk)));
    std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                      [&](uint32_t a, uint32_t b) { return score[a] > score[b]; });
    for (size_t i = 0; i < keep; ++i) out[c0 + order[i]] = true;
  }
  return out;
}

double RelError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double{a[i] - b[i]} * (a[i] - b[i]);
    den += double{a[i]} * a[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0;
}

// Attention outputs of the window's last `queries` queries (every query head) over K/V, causal;
// [queries, heads, dim].
std::vector<float> Attend(const model::ModelConfig& c, const model::LayerKv& exact,
                          const std::vector<float>& k, const std::vector<float>& v, uint32_t tokens,
                          uint32_t queries) {
  const uint32_t H = c.num_heads, KH = c.num_kv_heads, D = c.head_dim, G = H / KH;
  std::vector<float> out(size_t{queries} * H * D, 0.0f);
  std::vector<double> p(tokens);
  for (uint32_t qi = 0; qi < queries; ++qi) {
    const uint32_t pos = tokens - queries + qi;
    for (uint32_t h = 0; h < H; ++h) {
      const uint32_t kh = h / G;
      Softmax(&exact.q[(size_t{pos} * H + h) * D], k.data(), pos, KH, kh, D, p);
      float* o = &out[(size_t{qi} * H + h) * D];
      for (uint32_t t = 0; t <= pos; ++t) {
        const float* vt = &v[(size_t{t} * KH + kh) * D];
        const double w = p[t];
        for (uint32_t d = 0; d < D; ++d) o[d] += static_cast<float>(w * vt[d]);
      }
    }
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int Main(int argc, char** argv) {
  std::string model_dir = "models/strata-small";
  std::string calib = "models/strata-small/calibration.txt";
  std::string heldout = "models/strata-small/heldout.txt";
  uint32_t context = 2048, calib_windows = 4, queries = 64;
  bool rope_order = false;
  uint32_t exact_tail = 0, chunk = 256;
  double salient_percent = 0;
  std::vector<Stage> salient;
  std::string candidates =
      "c8b8,c4b6,c8b8+c8b4,c4b8,c8b8+c8b8,c8b8+c4b4,c4b6+c8b4,c4b8+c8b8,c2b6,c4b8+c4b4";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], val = argv[i + 1];
    bool ok = true;
    if (flag == "--model") {
      model_dir = val;
    } else if (flag == "--calib") {
      calib = val;
    } else if (flag == "--heldout") {
      heldout = val;
    } else if (flag == "--context") {
      ok = absl::SimpleAtoi(val, &context);
    } else if (flag == "--calib_windows") {
      ok = absl::SimpleAtoi(val, &calib_windows);
    } else if (flag == "--queries") {
      ok = absl::SimpleAtoi(val, &queries);
    } else if (flag == "--candidates") {
      candidates = val;
    } else if (flag == "--exact_tail") {
      ok = absl::SimpleAtoi(val, &exact_tail);
    } else if (flag == "--chunk") {
      ok = absl::SimpleAtoi(val, &chunk) && chunk > 0;
    } else if (flag == "--salient") {  // P:STAGES, e.g. 10:c2b8
      const std::vector<std::string> f = absl::StrSplit(val, ':');
      ok = f.size() == 2 && absl::SimpleAtod(f[0], &salient_percent) && salient_percent > 0 &&
           salient_percent <= 100 && ParseCandidate(f[1], &salient);
    } else if (flag == "--k_order") {
      ok = val == "natural" || val == "rope";
      rope_order = val == "rope";
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "cq_residual_probe: bad flag %s %s\n", flag.c_str(), val.c_str());
      return 2;
    }
  }
  struct Candidate {
    std::string name;
    std::vector<Stage> k, v;
  };
  std::vector<Candidate> cands;
  for (absl::string_view s : absl::StrSplit(candidates, ',')) {
    const std::vector<std::string> kv = absl::StrSplit(s, '/');
    Candidate cand{std::string(s), {}, {}};
    if (kv.size() > 2 || !ParseCandidate(kv[0], &cand.k) || !ParseCandidate(kv.back(), &cand.v)) {
      std::fprintf(stderr, "cq_residual_probe: bad candidate %s (e.g. c8b8+c4b4, c4b6/c4b8)\n",
                   std::string(s).c_str());
      return 2;
    }
    cands.push_back(std::move(cand));
  }
  auto model = model::LlamaModel::Load(model_dir);
  auto tok = model::Tokenizer::Load(model_dir);
  if (!model.ok() || !tok.ok()) {
    std::fprintf(stderr, "cq_residual_probe: %s\n",
                 (!model.ok() ? model.status() : tok.status()).ToString().c_str());
    return 1;
  }
  const model::ModelConfig& c = (*model)->config();
  auto ids_of = [&](const std::string& path) {
    std::vector<uint32_t> ids = (*tok)->Encode(ReadFile(path), false);
    if (c.bos_token_id >= 0) ids.insert(ids.begin(), static_cast<uint32_t>(c.bos_token_id));
    return ids;
  };
  const std::vector<uint32_t> cal_ids = ids_of(calib), held_ids = ids_of(heldout);
  if (held_ids.size() < context || cal_ids.size() < context || queries >= context ||
      exact_tail + 4 > context) {
    std::fprintf(stderr, "cq_residual_probe: texts shorter than one window of %u\n", context);
    return 1;
  }
  // Calibration K/V per layer, windows concatenated; one held-out window.
  std::vector<model::LayerKv> train;
  uint32_t train_tokens = 0;
  for (uint32_t w = 0; w < calib_windows && size_t{w + 1} * context <= cal_ids.size(); ++w) {
    std::vector<model::LayerKv> kv;
    const std::vector<uint32_t> window(cal_ids.begin() + size_t{w} * context,
                                       cal_ids.begin() + size_t{w + 1} * context);
    if (!(*model)->Forward(window, &kv).ok()) return 1;
    if (train.empty()) {
      train = std::move(kv);
    } else {
      for (size_t l = 0; l < kv.size(); ++l) {
        train[l].k.insert(train[l].k.end(), kv[l].k.begin(), kv[l].k.end());
        train[l].v.insert(train[l].v.end(), kv[l].v.begin(), kv[l].v.end());
      }
    }
    train_tokens += context;
  }
  std::vector<model::LayerKv> held;
  const std::vector<uint32_t> hw(held_ids.begin(), held_ids.begin() + context);
  if (!(*model)->Forward(hw, &held).ok()) return 1;

  const uint32_t KH = c.num_kv_heads, D = c.head_dim;
  std::printf(
      "model %s: codebooks on %u calibration tokens (%s), errors on %u held-out tokens (%s), "
      "attention of the last %u queries (first 4 tokens exact, and the last %u); keys' channels in "
      "%s order; %s\n",
      model_dir.c_str(), train_tokens, calib.c_str(), context, heldout.c_str(), queries, exact_tail,
      rope_order ? "RoPE-pair" : "natural",
      salient.empty()
          ? "no salient tokens"
          : absl::StrFormat("%.1f %% salient tokens per %u-token chunk", salient_percent, chunk)
                .c_str());
  std::printf("%-20s %5s %6s | per layer: K err / V err / attn err\n", "candidate", "bits", "attn");
  for (const Candidate& cand : cands) {
    const auto start = std::chrono::steady_clock::now();
    double bits = 0;
    for (const std::vector<Stage>* stages : {&cand.k, &cand.v}) {
      for (const Stage& s : *stages) bits += static_cast<double>(s.bits) / s.group / 2;
    }
    if (!salient.empty()) {
      double hi = 0;
      for (const Stage& s : salient) hi += static_cast<double>(s.bits) / s.group;
      const double share =
          std::ceil(salient_percent / 100.0 * chunk) / chunk;   // per chunk, rounded up
      bits = (1 - share) * bits + share * hi + 1.0 / (KH * D);  // + the token map's bit
    }
    std::string per_layer;
    double attn_sum = 0;
    for (uint32_t l = 0; l < c.num_layers; ++l) {
      std::vector<float> approx[2];
      // ZipCache's choice, as a prefill node makes it: per chunk, the tokens with the most
      // attention from the chunk's own queries (summed over heads, over the queries that see
      // them) are salient.
      std::vector<bool> is_salient;
      if (!salient.empty()) is_salient = SalientTokens(c, held[l], context, chunk, salient_percent);
      int ti = 0;
      for (std::vector<float> model::LayerKv::*member : {&model::LayerKv::k, &model::LayerKv::v}) {
        const bool reorder = rope_order && ti == 0;
        const uint32_t seed = 2 * l + ti + 1;
        approx[ti] = Through(train[l].*member, train_tokens, held[l].*member, context, KH, D,
                             ti == 0 ? cand.k : cand.v, reorder, seed);
        std::vector<float>& hq = approx[ti];
        if (!salient.empty()) {  // the chunk's salient tokens through the salient stages
          const std::vector<float> alt = Through(train[l].*member, train_tokens, held[l].*member,
                                                 context, KH, D, salient, reorder, seed + 1000);
          for (uint32_t t = 0; t < context; ++t) {
            if (is_salient[t]) {
              std::copy_n(&alt[size_t{t} * KH * D], size_t{KH} * D, &hq[size_t{t} * KH * D]);
            }
          }
        }
        // The sinks: the first 4 tokens exact; and the last exact_tail (a full-precision window).
        const std::vector<float>& exact = held[l].*member;
        std::copy_n(exact.begin(), size_t{4} * KH * D, hq.begin());
        std::copy(exact.end() - size_t{exact_tail} * KH * D, exact.end(),
                  hq.end() - size_t{exact_tail} * KH * D);
        ++ti;
      }
      const double ke = RelError(held[l].k, approx[0]), ve = RelError(held[l].v, approx[1]);
      const std::vector<float> ref = Attend(c, held[l], held[l].k, held[l].v, context, queries);
      const std::vector<float> got = Attend(c, held[l], approx[0], approx[1], context, queries);
      const double ae = RelError(ref, got);
      attn_sum += ae;
      per_layer += absl::StrFormat(" | %.3f %.3f %.4f", ke, ve, ae);
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%-20s %5.3f %6.4f%s  (%.0f s)\n", cand.name.c_str(), bits, attn_sum / c.num_layers,
                per_layer.c_str(), secs);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
