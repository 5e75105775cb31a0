// The model's GPU steps (model_ops.h) against host references of the CPU engine's arithmetic
// (model/llama.cc), on random inputs: embedding, RMSNorm, RoPE, bias, SwiGLU, residual, narrowing,
// the KV write and dense causal attention with GQA, argmax with ties. Skipped, saying why, without
// a GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/cuda/model_ops.h"

namespace strata::kernels::cuda {
namespace {

template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& host) : n_(host.size()) {
    cudaMalloc(&p_, std::max<size_t>(1, n_) * sizeof(T));
    cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  explicit Dev(size_t n) : n_(n) { cudaMalloc(&p_, std::max<size_t>(1, n) * sizeof(T)); }
  ~Dev() { cudaFree(p_); }
  T* get() { return p_; }
  std::vector<T> Host() const {
    std::vector<T> h(n_);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

class ModelOpsGpuTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  }
  std::vector<float> Random(size_t n, float scale = 1) {
    std::normal_distribution<float> d(0, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::mt19937 rng_{std::random_device{}()};
};

TEST_F(ModelOpsGpuTest, RmsNormMatchesTheCpuAndNarrowsToTheWeightType) {
  const int rows = 5, d = 576;
  const std::vector<float> x = Random(rows * d, 3), w = Random(d);
  Dev<float> dx(x), dw(w);
  Dev<__half> out(rows * d);
  ASSERT_TRUE(RmsNormRows<__half>(dx.get(), dw.get(), rows, d, 1e-5, out.get(), nullptr).ok());
  const std::vector<__half> got = out.Host();
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += double{x[r * d + j]} * x[r * d + j];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / d + 1e-5));
    for (int j = 0; j < d; ++j) {
      const float want = x[r * d + j] * inv * w[j];
      EXPECT_NEAR(__half2float(got[r * d + j]), want, 1e-3 * std::max(1.f, std::fabs(want)));
    }
  }
}

TEST_F(ModelOpsGpuTest, RopeRotatesHalvesByPositionAsTheCpuDoes) {
  const int rows = 3, heads = 4, D = 128;
  std::vector<float> x = Random(rows * heads * D), inv(D / 2);
  for (int i = 0; i < D / 2; ++i)
    inv[i] = static_cast<float>(1.0 / std::pow(500000.0, 2.0 * i / D));
  const std::vector<int32_t> pos = {0, 17, 70000};
  Dev<float> dx(x), dinv(inv);
  Dev<int32_t> dpos(pos);
  ASSERT_TRUE(Rope(dx.get(), dpos.get(), dinv.get(), rows, heads, D, nullptr).ok());
  const std::vector<float> got = dx.Host();
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < D / 2; ++i) {
        const double ang = static_cast<double>(pos[r]) * inv[i];
        const float c = static_cast<float>(std::cos(ang)), s = static_cast<float>(std::sin(ang));
        const float* v = &x[(r * heads + h) * D];
        const float* g = &got[(r * heads + h) * D];
        EXPECT_NEAR(g[i], v[i] * c - v[i + D / 2] * s, 1e-5);
        EXPECT_NEAR(g[i + D / 2], v[i + D / 2] * c + v[i] * s, 1e-5);
      }
    }
  }
}

TEST_F(ModelOpsGpuTest, EmbedBiasSwiGluResidualAndNarrow) {
  const int vocab = 50, hidden = 96, rows = 4;
  const std::vector<float> table_f = Random(vocab * hidden);
  std::vector<__nv_bfloat16> table(table_f.size());
  for (size_t i = 0; i < table.size(); ++i) table[i] = __float2bfloat16_rn(table_f[i]);
  const std::vector<int32_t> ids = {3, 49, 0, 3};
  Dev<__nv_bfloat16> dt(table);
  Dev<int32_t> did(ids);
  Dev<float> x(rows * hidden);
  ASSERT_TRUE(EmbedRows<__nv_bfloat16>(dt.get(), did.get(), rows, hidden, x.get(), nullptr).ok());
  std::vector<float> got = x.Host();
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < hidden; ++j) {
      EXPECT_EQ(got[r * hidden + j], __bfloat162float(table[ids[r] * hidden + j]));
    }
  }
  const std::vector<float> b = Random(hidden);
  Dev<float> db(b);
  ASSERT_TRUE(AddBias(x.get(), db.get(), rows, hidden, nullptr).ok());
  const std::vector<float> biased = x.Host();
  for (int i = 0; i < rows * hidden; ++i) EXPECT_EQ(biased[i], got[i] + b[i % hidden]);
  const std::vector<float> g = Random(1000, 4), u = Random(1000);
  Dev<float> dg(g), du(u);
  Dev<__half> glu(1000);
  ASSERT_TRUE(SwiGlu<__half>(dg.get(), du.get(), 1000, glu.get(), nullptr).ok());
  const std::vector<__half> gl = glu.Host();
  for (int i = 0; i < 1000; ++i) {
    const float want = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    EXPECT_NEAR(__half2float(gl[i]), want, 2e-3 * std::max(1.f, std::fabs(want)));
  }
  ASSERT_TRUE(AddInPlace(dg.get(), du.get(), 1000, nullptr).ok());
  const std::vector<float> sum = dg.Host();
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(sum[i], g[i] + u[i]);
  Dev<__nv_bfloat16> nb(1000);
  ASSERT_TRUE(Narrow<__nv_bfloat16>(du.get(), 1000, nb.get(), nullptr).ok());
  const std::vector<__nv_bfloat16> n = nb.Host();
  for (int i = 0; i < 1000; ++i)
    EXPECT_EQ(__bfloat162float(n[i]), __bfloat162float(__float2bfloat16_rn(u[i])));
}

// A prefill on top of a cache that already holds `first` tokens, rows across several blocks of
// the tensor-core kernel and a tail, against a double-precision causal softmax: the exact kernel
// to 1e-4, the tensor-core kernel (fp16 operands) to 4e-3; then each of a few rows alone in its
// own launch (a decode step) gives the same bits as in the prefill, on both kernels.
TEST_F(ModelOpsGpuTest, DenseCausalAttentionWithGqaMatchesAReference) {
  for (int D : {64, 128}) {
    for (bool exact : {true, false}) {
      SCOPED_TRACE(testing::Message() << "D " << D << (exact ? " exact" : " tensor cores"));
      const int H = 8, KH = 2, first = 21, rows = 150, cap = first + rows + 7;
      std::vector<int32_t> pos(cap);
      for (int i = 0; i < cap; ++i) pos[i] = i;
      const int total = first + rows;
      const std::vector<float> q = Random(static_cast<size_t>(rows) * H * D),
                               k = Random(static_cast<size_t>(total) * KH * D),
                               v = Random(static_cast<size_t>(total) * KH * D);
      Dev<float> dq(q), dk(k), dv(v), ck(KH * cap * D), cv(KH * cap * D);
      // Poisoned: every output element must be written.
      Dev<float> out(std::vector<float>(static_cast<size_t>(rows) * H * D, std::nanf("")));
      Dev<int32_t> dpos(pos);
      ASSERT_TRUE(
          WriteKv(dk.get(), dv.get(), dpos.get(), total, KH, D, cap, ck.get(), cv.get(), nullptr)
              .ok());
      DenseAttentionArgs args{.q = dq.get(),
                              .k = ck.get(),
                              .v = cv.get(),
                              .positions = dpos.get() + first,
                              .out = out.get(),
                              .rows = rows,
                              .q_heads = H,
                              .kv_heads = KH,
                              .head_dim = D,
                              .capacity = cap,
                              .exact = exact};
      ASSERT_TRUE(DenseAttention(args, nullptr).ok());
      const std::vector<float> got = out.Host();
      double worst = 0;
      for (int r = 0; r < rows; ++r) {
        const int p = first + r;
        for (int h = 0; h < H; ++h) {
          const int kvh = h / (H / KH);
          std::vector<double> sc(p + 1);
          double mx = -1e300;
          for (int t = 0; t <= p; ++t) {
            double dot = 0;
            for (int c = 0; c < D; ++c)
              dot += double{q[(r * H + h) * D + c]} * k[(t * KH + kvh) * D + c];
            sc[t] = dot / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, sc[t]);
          }
          double l = 0;
          for (double& x : sc) l += (x = std::exp(x - mx));
          for (int c = 0; c < D; ++c) {
            double o = 0;
            for (int t = 0; t <= p; ++t) o += sc[t] * v[(t * KH + kvh) * D + c];
            const float g = got[(r * H + h) * D + c];
            ASSERT_TRUE(std::isfinite(g)) << "row " << r << " head " << h << " channel " << c;
            worst = std::max(worst, std::fabs(o / l - g));
          }
        }
      }
      EXPECT_LT(worst, exact ? 1e-4 : 4e-3);
      for (int r : {0, 37, 63, 64, 149}) {
        Dev<float> one(static_cast<size_t>(H) * D);
        DenseAttentionArgs solo = args;
        solo.q = dq.get() + static_cast<size_t>(r) * H * D;
        solo.positions = dpos.get() + first + r;
        solo.out = one.get();
        solo.rows = 1;
        ASSERT_TRUE(DenseAttention(solo, nullptr).ok());
        const std::vector<float> alone = one.Host();
        for (int i = 0; i < H * D; ++i) {
          ASSERT_EQ(alone[i], got[static_cast<size_t>(r) * H * D + i])
              << "row " << r << " at " << i;
        }
      }
    }
  }
  DenseAttentionArgs bad{.rows = 1, .q_heads = 8, .kv_heads = 3, .head_dim = 128};
  EXPECT_EQ(DenseAttention(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelOpsGpuTest, ArgmaxTakesTheLowestIndexAmongEqualMaxima) {
  const int vocab = 50000;
  std::vector<float> logits = Random(3 * vocab);
  logits[0 * vocab + 777] = 100;
  logits[1 * vocab + 49999] = 100;
  logits[2 * vocab + 4000] = 100;  // a tie: the lower index wins
  logits[2 * vocab + 3000] = 100;
  Dev<float> dl(logits);
  Dev<int32_t> idx(3);
  ASSERT_TRUE(ArgmaxRows(dl.get(), 3, vocab, idx.get(), nullptr).ok());
  EXPECT_EQ(idx.Host(), (std::vector<int32_t>{777, 49999, 3000}));
}

}  // namespace
}  // namespace strata::kernels::cuda
