// The GPU paged decode attention against a double-precision reference on the same values (the
// codes dequantized exactly as the layout defines them), on fresh random inputs each run: pages
// in a shuffled pool, sequences of different lengths (none, part of one split, many pages),
// windows of every size, splits chosen and forced, GQA groups of 1 to 8, both head sizes, fp16
// and 2/4-bit codes, each case through both kernels (the tensor cores' where the layout allows, and
// the SIMT one). Outputs are poisoned (NaN) before each run. Tests that need a GPU skip, and
// say why, without one; the layout checks run everywhere.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/cuda/page_tiles.h"
#include "kernels/cuda/paged_decode.h"

namespace strata::kernels::cuda {
namespace {

#define ASSERT_CUDA(expr)                                          \
  do {                                                             \
    const cudaError_t e_ = (expr);                                 \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

template <typename T>
struct Device {
  T* p = nullptr;
  size_t n = 0;
  explicit Device(size_t count) : n(count) {
    if (count > 0 && cudaMalloc(&p, count * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Device() { cudaFree(p); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  cudaError_t From(const std::vector<T>& v) {
    return cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
};

float HalfValue(uint16_t bits) { return __half2float(__half(__half_raw{bits})); }
uint16_t HalfBits(float f) { return static_cast<__half_raw>(__float2half_rn(f)).x; }

// One case: a random pool of pages and the sequences over it, with its reference output.
struct Case {
  PagedKvLayout layout;
  int batch = 3, q_heads = 8, max_window = 0, splits = 0;
  std::vector<int> pages_per_seq, windows;
  bool slots_reversed = false;  // sequence s's window in row batch - 1 - s (window_slots)
};

// The layout's sections one after another behind a block-sized header, in the block format's
// order and 16-byte alignment (block_pages_test checks the codecs' own blocks).
PagedKvLayout Sections(PagedKvLayout L) {
  size_t at = 176;
  auto place = [&](uint32_t* offset, size_t bytes) {
    at = Align16(at);
    *offset = static_cast<uint32_t>(at);
    at += bytes;
  };
  const size_t H = L.kv_heads;
  place(&L.key_codes, H * L.KeyCodeBytes());
  if (L.format == PageFormat::kAffine) {
    place(&L.key_scales, H * L.KeyMetaBytes());
    place(&L.key_zeros, H * L.KeyMetaBytes());
  }
  place(&L.value_codes, H * L.ValueCodeBytes());
  if (L.format == PageFormat::kAffine) {
    place(&L.value_scales, H * L.ValueMetaBytes());
    place(&L.value_zeros, H * L.ValueMetaBytes());
  }
  L.page_bytes = static_cast<uint32_t>((at + 127) / 128 * 128);
  return L;
}

// The dequantized K and V of token `t` of page `page` (KV head `h`) as the layout defines them.
void Dequantize(const PagedKvLayout& L, const std::vector<uint8_t>& pool, int page, int h, int t,
                std::vector<double>* k, std::vector<double>* v) {
  const uint8_t* base = pool.data() + static_cast<size_t>(page) * L.PageBytes();
  const int D = L.head_dim;
  auto half_at = [&](size_t offset, size_t index) {
    uint16_t bits;
    std::memcpy(&bits, base + offset + 2 * index, 2);
    return static_cast<double>(HalfValue(bits));
  };
  auto code_at = [&](size_t offset, int row_bytes, int bits, int row, int i) {
    const size_t bit = static_cast<size_t>(i) * bits;
    const uint8_t byte = base[offset + static_cast<size_t>(row) * row_bytes + bit / 8];
    return static_cast<double>((byte >> (bit % 8)) & ((1 << bits) - 1));
  };
  for (int c = 0; c < D; ++c) {
    if (L.format == PageFormat::kFp16) {
      (*k)[c] = half_at(L.KeyCodesOf(h), static_cast<size_t>(t) * D + c);
      (*v)[c] = half_at(L.ValueCodesOf(h), static_cast<size_t>(t) * D + c);
      continue;
    }
    const int g = t / L.k_group;
    (*k)[c] = half_at(L.KeyScalesOf(h), static_cast<size_t>(g) * D + c) *
                  code_at(L.KeyCodesOf(h), D * L.key_bits / 8, L.key_bits, t, c) +
              half_at(L.KeyZerosOf(h), static_cast<size_t>(g) * D + c);
    const int vg = c / L.v_group, groups = D / L.v_group;
    (*v)[c] = half_at(L.ValueScalesOf(h), static_cast<size_t>(t) * groups + vg) *
                  code_at(L.ValueCodesOf(h), D * L.value_bits / 8, L.value_bits, t, c) +
              half_at(L.ValueZerosOf(h), static_cast<size_t>(t) * groups + vg);
  }
}

// Fills KV head h's parts of an affine or fp16 page with random but realistic values (the bytes
// between and after the sections stay as they are).
void FillHead(const PagedKvLayout& L, uint8_t* page, int h, std::mt19937& rng) {
  std::normal_distribution<float> normal(0, 1);
  std::uniform_real_distribution<float> scale(0.02f, 0.3f);
  auto put_half = [&](size_t offset, size_t index, float f) {
    const uint16_t b = HalfBits(f);
    std::memcpy(page + offset + 2 * index, &b, 2);
  };
  const int D = L.head_dim, T = L.page_tokens;
  if (L.format == PageFormat::kFp16) {
    for (size_t i = 0; i < static_cast<size_t>(T) * D; ++i) {
      put_half(L.KeyCodesOf(h), i, normal(rng));
      put_half(L.ValueCodesOf(h), i, normal(rng));
    }
    return;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t i = 0; i < L.KeyCodeBytes(); ++i) {
    page[L.KeyCodesOf(h) + i] = static_cast<uint8_t>(byte(rng));
  }
  for (size_t i = 0; i < L.ValueCodeBytes(); ++i) {
    page[L.ValueCodesOf(h) + i] = static_cast<uint8_t>(byte(rng));
  }
  for (int i = 0; i < T / L.k_group * D; ++i) {
    put_half(L.KeyScalesOf(h), i, scale(rng));
    put_half(L.KeyZerosOf(h), i, normal(rng));
  }
  for (int i = 0; i < T * (D / L.v_group); ++i) {
    put_half(L.ValueScalesOf(h), i, scale(rng));
    put_half(L.ValueZerosOf(h), i, normal(rng));
  }
}

void RunCaseWith(const Case& c, uint32_t seed, PagedKernel kernel) {
  const PagedKvLayout& L = c.layout;
  ASSERT_TRUE(L.Validate().ok()) << L.Validate();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  const int D = L.head_dim;
  const int total_pages = std::accumulate(c.pages_per_seq.begin(), c.pages_per_seq.end(), 0) + 3;
  // The pool, shuffled: sequence s's page i is pool page ids[s][i]; 3 pages nobody uses.
  // Bytes outside the sections (a block's header, padding) are random too: never read.
  std::vector<uint8_t> pool(static_cast<size_t>(total_pages) * L.PageBytes(), 0);
  std::uniform_int_distribution<int> any_byte(0, 255);
  for (uint8_t& b : pool) b = static_cast<uint8_t>(any_byte(rng));
  for (int p = 0; p < total_pages; ++p) {
    for (int h = 0; h < L.kv_heads; ++h) {
      FillHead(L, pool.data() + static_cast<size_t>(p) * L.PageBytes(), h, rng);
    }
  }
  std::vector<int> order(total_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int max_pages = std::max(1, *std::max_element(c.pages_per_seq.begin(), c.pages_per_seq.end()));
  std::vector<int32_t> table(static_cast<size_t>(c.batch) * max_pages, -1);
  int next = 0;
  for (int s = 0; s < c.batch; ++s) {
    for (int i = 0; i < c.pages_per_seq[s]; ++i) table[static_cast<size_t>(s) * max_pages + i] = order[next++];
  }
  const int max_window = std::max(1, c.max_window);
  std::vector<uint16_t> wk(static_cast<size_t>(c.batch) * L.kv_heads * max_window * D),
      wv(wk.size());
  for (size_t i = 0; i < wk.size(); ++i) {
    wk[i] = HalfBits(normal(rng));
    wv[i] = HalfBits(normal(rng));
  }
  std::vector<float> q(static_cast<size_t>(c.batch) * c.q_heads * D);
  for (float& x : q) x = normal(rng);

  Device<uint8_t> d_pool(pool.size());
  Device<int32_t> d_table(table.size()), d_counts(c.batch), d_windows(c.batch), d_slots(c.batch);
  std::vector<int32_t> slots(c.batch);
  for (int s = 0; s < c.batch; ++s) slots[s] = c.slots_reversed ? c.batch - 1 - s : s;
  Device<uint16_t> d_wk(wk.size()), d_wv(wv.size());
  Device<float> d_q(q.size()), d_out(q.size());
  const int max_pages_in_batch = *std::max_element(c.pages_per_seq.begin(), c.pages_per_seq.end());
  PagedDecodeArgs a;
  a.kernel = kernel;
  a.batch = c.batch;
  a.q_heads = c.q_heads;
  a.max_pages = max_pages;
  a.max_window = max_window;
  a.splits = c.splits;
  const int splits = ChooseSplits(L, a, max_pages_in_batch);
  Device<uint8_t> d_work(WorkspaceBytes(c.batch, c.q_heads, D, splits));
  ASSERT_CUDA(d_pool.From(pool));
  ASSERT_CUDA(d_table.From(table));
  ASSERT_CUDA(d_counts.From(std::vector<int32_t>(c.pages_per_seq.begin(), c.pages_per_seq.end())));
  ASSERT_CUDA(d_windows.From(std::vector<int32_t>(c.windows.begin(), c.windows.end())));
  ASSERT_CUDA(d_slots.From(slots));
  ASSERT_CUDA(d_wk.From(wk));
  ASSERT_CUDA(d_wv.From(wv));
  ASSERT_CUDA(d_q.From(q));
  ASSERT_CUDA(cudaMemset(d_out.p, 0xff, q.size() * sizeof(float)));  // NaN: every output written?
  a.pages = d_pool.p;
  a.block_table = d_table.p;
  a.page_counts = d_counts.p;
  a.window_k = reinterpret_cast<const __half*>(d_wk.p);
  a.window_v = reinterpret_cast<const __half*>(d_wv.p);
  a.window_lens = c.max_window > 0 ? d_windows.p : nullptr;
  a.window_slots = c.slots_reversed ? d_slots.p : nullptr;
  a.q = d_q.p;
  a.out = d_out.p;
  a.workspace = d_work.p;
  ASSERT_TRUE(PagedDecode(L, a, max_pages_in_batch, nullptr).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> out(q.size());
  ASSERT_CUDA(cudaMemcpy(out.data(), d_out.p, out.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // The reference, in double.
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int group = c.q_heads / L.kv_heads;
  double err2 = 0, ref2 = 0, worst = 0;
  std::vector<double> k(D), v(D);
  for (int s = 0; s < c.batch; ++s) {
    for (int kvh = 0; kvh < L.kv_heads; ++kvh) {
      std::vector<std::vector<double>> keys, values;
      for (int i = 0; i < c.pages_per_seq[s]; ++i) {
        for (int t = 0; t < L.page_tokens; ++t) {
          Dequantize(L, pool, table[static_cast<size_t>(s) * max_pages + i], kvh, t, &k, &v);
          keys.push_back(k);
          values.push_back(v);
        }
      }
      const int window = c.max_window > 0 ? c.windows[s] : 0;
      for (int t = 0; t < window; ++t) {
        const size_t base =
            ((static_cast<size_t>(slots[s]) * L.kv_heads + kvh) * max_window + t) * D;
        for (int ch = 0; ch < D; ++ch) {
          k[ch] = HalfValue(wk[base + ch]);
          v[ch] = HalfValue(wv[base + ch]);
        }
        keys.push_back(k);
        values.push_back(v);
      }
      for (int g = 0; g < group; ++g) {
        const int qh = kvh * group + g;
        const float* qv = q.data() + (static_cast<size_t>(s) * c.q_heads + qh) * D;
        std::vector<double> logits(keys.size());
        double mx = -INFINITY;
        for (size_t t = 0; t < keys.size(); ++t) {
          double dot = 0;
          for (int ch = 0; ch < D; ++ch) dot += qv[ch] * keys[t][ch];
          logits[t] = dot * scale;
          mx = std::max(mx, logits[t]);
        }
        double sum = 0;
        for (double& x : logits) sum += (x = std::exp(x - mx));
        const float* got = out.data() + (static_cast<size_t>(s) * c.q_heads + qh) * D;
        for (int ch = 0; ch < D; ++ch) {
          double want = 0;
          for (size_t t = 0; t < keys.size(); ++t) want += logits[t] * values[t][ch];
          want = keys.empty() ? 0 : want / sum;
          ASSERT_FALSE(std::isnan(got[ch])) << "output " << s << "/" << qh << "/" << ch << " not written";
          err2 += (got[ch] - want) * (got[ch] - want);
          ref2 += want * want;
          worst = std::max(worst, std::abs(got[ch] - want));
        }
      }
    }
  }
  const double nmse = ref2 > 0 ? err2 / ref2 : err2;
  EXPECT_LT(nmse, 1e-6) << "splits " << splits << ", worst |error| " << worst;
  EXPECT_LT(worst, 2e-3) << "splits " << splits;
}

// Every kernel on the same data: the tensor cores' (where the layout allows; its registers
// capped for three blocks, and for four), and the SIMT one.
void RunCase(const Case& c, uint32_t seed) {
  for (PagedKernel kernel : {PagedKernel::kAuto, PagedKernel::kSimt, PagedKernel::kMmaFourBlocks}) {
    // Four blocks is another kernel on affine pages only; elsewhere it reruns kAuto's.
    if (kernel == PagedKernel::kMmaFourBlocks && c.layout.format != PageFormat::kAffine) continue;
    SCOPED_TRACE(kernel == PagedKernel::kAuto   ? "kernel: auto"
                 : kernel == PagedKernel::kSimt ? "kernel: simt"
                                                : "kernel: four blocks");
    RunCaseWith(c, seed, kernel);
  }
}

PagedKvLayout Layout(PageFormat f, int head_dim, int kb = 4, int vb = 4) {
  PagedKvLayout L;
  L.format = f;
  L.kv_heads = 2;
  L.head_dim = head_dim;
  L.page_tokens = 64;
  L.key_bits = kb;
  L.value_bits = vb;
  L.k_group = 32;
  L.v_group = 32;
  return Sections(L);
}

class PagedDecodeGpuTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  }
  uint32_t Seed() { return std::random_device{}(); }
};

TEST_F(PagedDecodeGpuTest, Fp16MatchesTheReferenceForEverySplitAndWindow) {
  for (int d : {64, 128}) {
    for (int splits : {0, 1, 3, 16}) {
      Case c{.layout = Layout(PageFormat::kFp16, d), .batch = 4, .q_heads = 8, .max_window = 70,
             .splits = splits, .pages_per_seq = {0, 1, 7, 20}, .windows = {5, 0, 70, 33}};
      SCOPED_TRACE(testing::Message() << "d " << d << " splits " << splits);
      RunCase(c, Seed());
    }
  }
}

TEST_F(PagedDecodeGpuTest, AffineCodesMatchTheReferenceOnTheSameDequantizedValues) {
  for (auto [kb, vb] : std::vector<std::pair<int, int>>{{4, 4}, {2, 2}, {4, 2}, {2, 4}}) {
    for (int d : {64, 128}) {
      Case c{.layout = Layout(PageFormat::kAffine, d, kb, vb), .batch = 3, .q_heads = 8,
             .max_window = 40, .splits = 0, .pages_per_seq = {9, 2, 0}, .windows = {17, 40, 3}};
      SCOPED_TRACE(testing::Message() << "k" << kb << "v" << vb << " d " << d);
      RunCase(c, Seed());
    }
  }
}

TEST_F(PagedDecodeGpuTest, GqaGroupsAndKeyGroupsOfEverySupportedSize) {
  for (int group : {1, 2, 4, 8}) {
    PagedKvLayout L = Layout(PageFormat::kAffine, 128, 2, 2);
    L.k_group = group == 8 ? 64 : 16;
    L.v_group = group == 1 ? 4 : 64;
    Case c{.layout = Sections(L),
           .batch = 2,
           .q_heads = 2 * group,
           .max_window = 0,
           .splits = 2,
           .pages_per_seq = {5, 3},
           .windows = {0, 0}};
    SCOPED_TRACE(testing::Message() << "group " << group);
    RunCase(c, Seed());
  }
}

// Page sizes and groups the tensor-core kernel takes besides 64-token pages: 16-, 32- and
// 128-token pages (one, two or eight slices per warp and page), 256- and 512-token pages (staged
// 64 tokens at a time, key groups inside a slice or spanning several), key groups of one slice or
// a whole page, value groups of 32 channels to a whole head, groups of 4 and 8 query heads, and
// windows longer than the window tile; and an 8-token page (the one-warp-per-head kernel).
TEST_F(PagedDecodeGpuTest, PagesOfEverySixteenTokenMultipleAndWideGroups) {
  struct Shape {
    PageFormat format;
    int d, page, kb, vb, k_group, v_group, group;
  };
  for (const Shape& sh : std::vector<Shape>{{PageFormat::kFp16, 128, 16, 4, 4, 32, 32, 4},
                                            {PageFormat::kFp16, 64, 128, 4, 4, 32, 32, 8},
                                            {PageFormat::kAffine, 128, 16, 4, 2, 16, 128, 4},
                                            {PageFormat::kAffine, 128, 32, 2, 4, 32, 64, 8},
                                            {PageFormat::kAffine, 64, 128, 4, 4, 128, 32, 4},
                                            {PageFormat::kAffine, 64, 32, 2, 2, 16, 64, 8},
                                            {PageFormat::kFp16, 128, 256, 4, 4, 32, 32, 4},
                                            {PageFormat::kAffine, 128, 256, 4, 4, 32, 32, 4},
                                            {PageFormat::kAffine, 128, 256, 2, 2, 128, 32, 4},
                                            {PageFormat::kAffine, 128, 512, 2, 4, 512, 128, 8},
                                            {PageFormat::kFp16, 64, 512, 4, 4, 32, 32, 2},
                                            {PageFormat::kAffine, 128, 8, 4, 4, 8, 32, 4}}) {
    PagedKvLayout L = Layout(sh.format, sh.d, sh.kb, sh.vb);
    L.page_tokens = sh.page;
    L.k_group = sh.k_group;
    L.v_group = sh.v_group;
    Case c{.layout = Sections(L),
           .batch = 3,
           .q_heads = 2 * sh.group,
           .max_window = 150,
           .splits = 0,
           .pages_per_seq = {1, 6, 11},
           .windows = {150, 0, 37}};
    SCOPED_TRACE(testing::Message()
                 << (sh.format == PageFormat::kFp16 ? "fp16" : "affine") << " d " << sh.d
                 << " page " << sh.page << " k" << sh.kb << "v" << sh.vb << " k_group "
                 << sh.k_group << " v_group " << sh.v_group << " group " << sh.group);
    RunCase(c, Seed());
  }
}

// Windows in a pool of rows, sequence s's in row window_slots[s] (a batch's sequences keep their
// windows in place between steps).
TEST_F(PagedDecodeGpuTest, WindowsComeFromTheirSlotsInAPool) {
  for (PageFormat f : {PageFormat::kFp16, PageFormat::kAffine}) {
    Case c{.layout = Layout(f, 128),
           .batch = 4,
           .q_heads = 16,
           .max_window = 40,
           .splits = 2,
           .pages_per_seq = {2, 0, 5, 1},
           .windows = {40, 7, 1, 0},
           .slots_reversed = true};
    RunCase(c, Seed());
  }
}

TEST_F(PagedDecodeGpuTest, LongSequencesSplitAcrossTheDevice) {
  Case c{.layout = Layout(PageFormat::kAffine, 128, 2, 2), .batch = 2, .q_heads = 16,
         .max_window = 64, .splits = 0, .pages_per_seq = {256, 31}, .windows = {64, 1}};
  c.layout.kv_heads = 4;
  c.layout = Sections(c.layout);  // four heads' sections
  RunCase(c, Seed());
}

TEST(PagedDecodeLayoutTest, RefusesWhatTheKernelsDoNotHandle) {
  PagedKvLayout L = Layout(PageFormat::kAffine, 128);
  EXPECT_TRUE(L.Validate().ok());
  PagedKvLayout bad = L;
  bad.head_dim = 96;
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.key_bits = 3;
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.k_group = 24;  // does not divide 64
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.v_group = 2;  // under a lane's 4 channels
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.page_tokens = 200;  // over 128 and not a multiple of 64
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.page_tokens = 1024;
  EXPECT_FALSE(bad.Validate().ok());
  bad = Sections(L);
  bad.page_tokens = 256;
  bad.k_group = 96;  // neither divides nor is a multiple of the 64-token slice
  EXPECT_FALSE(Sections(bad).Validate().ok());
  // Sections: 16-byte aligned, inside the page, apart.
  bad = L;
  bad.value_scales += 8;
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.page_bytes = bad.value_zeros + 16;
  EXPECT_FALSE(bad.Validate().ok());
  bad = L;
  bad.key_zeros = bad.key_scales;
  EXPECT_FALSE(bad.Validate().ok());
  // A staged slice: parts 16-byte aligned and in order; 4-bit K and V with fp16 metadata per 32
  // is 4.5 bits per element on average, plus alignment.
  for (PagedKvLayout l : {L, Layout(PageFormat::kAffine, 64, 2, 2)}) {
    const TileLayout T(l);
    const size_t offsets[] = {T.KeyCodes(),    T.KeyScales(),  T.KeyZeros(), T.ValueCodes(),
                              T.ValueScales(), T.ValueZeros(), T.HeadBytes()};
    for (size_t i = 0; i < 7; ++i) {
      EXPECT_EQ(offsets[i] % 16, 0u);
      if (i > 0) EXPECT_GT(offsets[i], offsets[i - 1]);
    }
  }
  EXPECT_EQ(TileLayout(L).HeadBytes(), 64u * 64 + 2 * 2 * 128 * 2 + 64u * 64 + 2 * 64 * 4 * 2);
  EXPECT_EQ(TileLayout(Layout(PageFormat::kFp16, 128)).HeadBytes(), 2u * 64 * 128 * 2);
  // Pages longer than 128 tokens are staged 64 tokens at a time.
  PagedKvLayout big = L;
  big.page_tokens = 256;
  big = Sections(big);
  EXPECT_TRUE(big.Validate().ok()) << big.Validate();
  EXPECT_EQ(TileLayout(big).tokens, 64);
  EXPECT_EQ(TileLayout(big).tiles_per_page, 4);
}

TEST(PagedDecodeLayoutTest, RefusesBadArgumentsWithoutLaunching) {
  PagedDecodeArgs a;
  a.batch = 1;
  a.q_heads = 3;  // not a multiple of kv_heads (2)
  const absl::Status s = PagedDecode(Layout(PageFormat::kFp16, 128), a, 1, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  a.q_heads = 8;
  EXPECT_EQ(PagedDecode(Layout(PageFormat::kFp16, 128), a, 1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // null pointers
}

}  // namespace
}  // namespace strata::kernels::cuda
