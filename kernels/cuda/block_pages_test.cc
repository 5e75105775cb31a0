// Blocks the CPU codecs write, as pages for the GPU kernels: the page holds exactly the values the
// CPU decodes from the block (checked on the CPU, everywhere), and the GPU's attention over such
// pages equals the CPU reference attention over the same blocks (skipped without a GPU).
#include "kernels/cuda/block_pages.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/block_reader.h"
#include "common/half.h"
#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/cuda/compress.h"
#include "kernels/decode_attention.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels::cuda {
namespace {

constexpr uint32_t kHeads = 2, kDim = 128, kTokens = 64;

struct Block {
  AlignedBuffer bytes;
  PreparedBlock prepared;
};

std::unique_ptr<Block> Encode(const std::string& spec, uint32_t chunk, uint64_t seed) {
  auto codec = Codec::Create(spec);
  EXPECT_TRUE(codec.ok()) << codec.status();
  const SyntheticKv kv = MakeSyntheticKv(kTokens, kHeads, kDim, seed, chunk * kTokens);
  absl::StatusOr<AlignedBuffer> b = (*codec)->Encode(
      {kv.k.data(), kv.v.data(), SourceDType::kFloat32, kTokens, kHeads, kDim},
      {.layer = 0, .chunk_index = chunk});
  EXPECT_TRUE(b.ok()) << b.status();
  auto block = std::make_unique<Block>();
  block->bytes = *std::move(b);
  absl::StatusOr<BlockView> view = BlockView::Parse(block->bytes.span());
  EXPECT_TRUE(view.ok()) << view.status();
  absl::StatusOr<PreparedBlock> p = PrepareBlock(*view);
  EXPECT_TRUE(p.ok()) << p.status();
  block->prepared = *std::move(p);
  return block;
}

// What the page says token t of head h is, as PagedKvLayout defines it.
double PageValue(const PagedKvLayout& L, const uint8_t* page, bool key, int h, int t, int c) {
  const uint8_t* head = page + static_cast<size_t>(h) * L.HeadBytes();
  const int D = L.head_dim;
  auto half_at = [&](size_t offset, size_t index) {
    uint16_t bits;
    std::memcpy(&bits, head + offset + 2 * index, 2);
    return static_cast<double>(HalfBitsToFloat(bits));
  };
  if (L.format == PageFormat::kFp16) {
    return half_at(key ? 0 : L.HeadBytes() / 2, static_cast<size_t>(t) * D + c);
  }
  const int bits = key ? L.key_bits : L.value_bits;
  const size_t codes = key ? L.KeyCodes() : L.ValueCodes();
  const size_t bit = static_cast<size_t>(c) * bits;
  const double code = (head[codes + static_cast<size_t>(t) * (D * bits / 8) + bit / 8] >> (bit % 8)) &
                      ((1 << bits) - 1);
  if (key) {
    const size_t i = static_cast<size_t>(t / L.k_group) * D + c;
    return half_at(L.KeyScales(), i) * code + half_at(L.KeyZeros(), i);
  }
  const size_t i = static_cast<size_t>(t) * (D / L.v_group) + c / L.v_group;
  return half_at(L.ValueScales(), i) * code + half_at(L.ValueZeros(), i);
}

TEST(BlockPagesTest, APageHoldsExactlyWhatTheCpuDecodesFromTheBlock) {
  for (const char* spec : {"fp16", "kivi:k4v4:g32", "kivi:k2v2:g32", "kivi:k4v2:g16", "kivi:k2v4:g64"}) {
    SCOPED_TRACE(spec);
    std::unique_ptr<Block> b = Encode(spec, 3, 17);
    ASSERT_EQ(b->prepared.parts.size(), 1u);
    const BlockOperands& ops = b->prepared.parts[0];
    absl::StatusOr<PagedKvLayout> L = PageLayoutFor(ops);
    ASSERT_TRUE(L.ok()) << L.status();
    std::vector<uint8_t> page(L->PageBytes());
    ASSERT_TRUE(PackPage(ops, *L, page.data()).ok());
    std::vector<float> k(kTokens * kHeads * kDim), v(k.size());
    ASSERT_TRUE(DecodeOperandsRef(ops, k.data(), v.data()).ok());
    double worst = 0;
    for (uint32_t t = 0; t < kTokens; ++t) {
      for (uint32_t h = 0; h < kHeads; ++h) {
        for (uint32_t c = 0; c < kDim; ++c) {
          const size_t i = (static_cast<size_t>(t) * kHeads + h) * kDim + c;
          worst = std::max(worst, std::abs(PageValue(*L, page.data(), true, h, t, c) - k[i]));
          worst = std::max(worst, std::abs(PageValue(*L, page.data(), false, h, t, c) - v[i]));
        }
      }
    }
    EXPECT_LT(worst, 1e-5);  // fp32 rounding of scale * code + zero, nothing more
  }
}

TEST(BlockPagesTest, BlocksThePageFormatCannotHoldAreRefusedSayingWhy) {
  std::unique_ptr<Block> gear = Encode("gear:k4v4:g32:r2:s2", 0, 5);
  absl::StatusOr<PagedKvLayout> L = PageLayoutFor(gear->prepared.parts[0]);
  EXPECT_EQ(L.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(L.status().message().find("low-rank"), std::string::npos) << L.status();
  std::unique_ptr<Block> int8 = Encode("int8", 0, 5);
  EXPECT_EQ(PageLayoutFor(int8->prepared.parts[0]).status().code(),
            absl::StatusCode::kUnimplemented);
  // A layout of another shape is refused.
  std::unique_ptr<Block> kivi = Encode("kivi:k4v4:g32", 0, 5);
  absl::StatusOr<PagedKvLayout> other = PageLayoutFor(kivi->prepared.parts[0]);
  ASSERT_TRUE(other.ok());
  other->key_bits = 2;
  std::vector<uint8_t> page(other->PageBytes());
  EXPECT_EQ(PackPage(kivi->prepared.parts[0], *other, page.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// The GPU over pages made from real blocks against the CPU's reference attention over the same
// blocks (and an fp16 window), 8 query heads over 2 KV heads, one sequence per codec.
TEST(BlockPagesGpuTest, GpuAttentionOverCodecBlocksEqualsTheCpuReference) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  constexpr int kQHeads = 8, kChunks = 6, kWindow = 19;
  for (const char* spec : {"fp16", "kivi:k4v4:g32", "kivi:k2v2:g32"}) {
    SCOPED_TRACE(spec);
    std::vector<std::unique_ptr<Block>> blocks;
    std::vector<const BlockOperands*> ops;
    for (int c = 0; c < kChunks; ++c) {
      blocks.push_back(Encode(spec, c, 100 + c));
      ops.push_back(&blocks.back()->prepared.parts[0]);
    }
    absl::StatusOr<PagedKvLayout> L = PageLayoutFor(*ops[0]);
    ASSERT_TRUE(L.ok()) << L.status();
    std::vector<uint8_t> pool(L->PageBytes() * kChunks);
    for (int c = 0; c < kChunks; ++c) {  // pages in reverse order in the pool
      ASSERT_TRUE(PackPage(*ops[c], *L, pool.data() + (kChunks - 1 - c) * L->PageBytes()).ok());
    }
    std::vector<int32_t> table(kChunks);
    for (int c = 0; c < kChunks; ++c) table[c] = kChunks - 1 - c;
    // The window at fp16 (the GPU's), the same values widened for the CPU.
    const SyntheticKv w = MakeSyntheticKv(kWindow, kHeads, kDim, 9, kChunks * kTokens);
    std::vector<uint16_t> wk(static_cast<size_t>(kHeads) * kWindow * kDim), wv(wk.size());
    std::vector<float> cpu_wk(w.k.size()), cpu_wv(w.v.size());
    for (int t = 0; t < kWindow; ++t) {
      for (uint32_t h = 0; h < kHeads; ++h) {
        for (uint32_t d = 0; d < kDim; ++d) {
          const size_t src = (static_cast<size_t>(t) * kHeads + h) * kDim + d;
          const size_t dst = (static_cast<size_t>(h) * kWindow + t) * kDim + d;
          wk[dst] = FloatToHalfBits(w.k[src]);
          wv[dst] = FloatToHalfBits(w.v[src]);
          cpu_wk[src] = HalfBitsToFloat(wk[dst]);
          cpu_wv[src] = HalfBitsToFloat(wv[dst]);
        }
      }
    }
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> q(kQHeads * kDim), want(q.size()), got(q.size(), NAN);
    for (float& x : q) x = normal(rng);
    DecodeSequence seq;
    seq.q = q.data();
    seq.blocks = ops;
    seq.window = {cpu_wk.data(), cpu_wv.data(), kWindow};
    seq.out = want.data();
    ASSERT_TRUE(DecodeAttentionRef({.q_heads = kQHeads, .kv_heads = kHeads, .head_dim = kDim},
                                   {&seq, 1})
                    .ok());

    void *d_pool, *d_table, *d_count, *d_wk, *d_wv, *d_wlen, *d_q, *d_out, *d_work;
    const int32_t count = kChunks, wlen = kWindow;
    ASSERT_EQ(cudaMalloc(&d_pool, pool.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_table, table.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_count, 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_wk, wk.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_wv, wv.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_wlen, 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_q, q.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, q.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_work, WorkspaceBytes(1, kQHeads, kDim, 2)), cudaSuccess);
    cudaMemcpy(d_pool, pool.data(), pool.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_count, &count, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_wk, wk.data(), wk.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(d_wv, wv.data(), wv.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(d_wlen, &wlen, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(d_out, 0xff, q.size() * 4);
    PagedDecodeArgs a;
    a.pages = static_cast<const uint8_t*>(d_pool);
    a.block_table = static_cast<const int32_t*>(d_table);
    a.max_pages = kChunks;
    a.page_counts = static_cast<const int32_t*>(d_count);
    a.window_k = static_cast<const __half*>(d_wk);
    a.window_v = static_cast<const __half*>(d_wv);
    a.window_lens = static_cast<const int32_t*>(d_wlen);
    a.max_window = kWindow;
    a.q = static_cast<const float*>(d_q);
    a.batch = 1;
    a.q_heads = kQHeads;
    a.out = static_cast<float*>(d_out);
    a.splits = 2;
    a.workspace = d_work;
    ASSERT_TRUE(PagedDecode(*L, a, kChunks, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost);
    for (void* p : {d_pool, d_table, d_count, d_wk, d_wv, d_wlen, d_q, d_out, d_work}) cudaFree(p);
    double err2 = 0, ref2 = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << i;
      err2 += (got[i] - want[i]) * (got[i] - want[i]);
      ref2 += want[i] * want[i];
    }
    EXPECT_LT(err2 / ref2, 1e-6);
  }
}

// The GPU's KIVI compression writes, byte for byte, the page made from the CPU codec's block of
// the same chunk (same arithmetic, same rounding), for several chunks at once into scattered
// pages.
TEST(BlockPagesGpuTest, GpuCompressionWritesTheCpuCodecsPagesByteForByte) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  constexpr int kChunks = 5;
  for (const char* spec : {"kivi:k4v4:g32", "kivi:k2v2:g32", "kivi:k4v2:g16", "kivi:k2v4:g64"}) {
    SCOPED_TRACE(spec);
    std::vector<float> k, v;
    std::vector<uint8_t> want;
    PagedKvLayout L;
    for (int c = 0; c < kChunks; ++c) {
      const SyntheticKv kv = MakeSyntheticKv(kTokens, kHeads, kDim, 40 + c, c * kTokens);
      k.insert(k.end(), kv.k.begin(), kv.k.end());
      v.insert(v.end(), kv.v.begin(), kv.v.end());
      std::unique_ptr<Block> b = Encode(spec, c, 40 + c);
      absl::StatusOr<PagedKvLayout> l = PageLayoutFor(b->prepared.parts[0]);
      ASSERT_TRUE(l.ok()) << l.status();
      L = *l;
      want.resize(static_cast<size_t>(kChunks) * L.PageBytes());
      // Chunk c to page kChunks - 1 - c.
      ASSERT_TRUE(PackPage(b->prepared.parts[0], L,
                           want.data() + static_cast<size_t>(kChunks - 1 - c) * L.PageBytes())
                      .ok());
    }
    std::vector<int32_t> ids(kChunks);
    for (int c = 0; c < kChunks; ++c) ids[c] = kChunks - 1 - c;
    void *d_k, *d_v, *d_pages, *d_ids;
    ASSERT_EQ(cudaMalloc(&d_k, k.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_v, v.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_pages, want.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_ids, ids.size() * 4), cudaSuccess);
    cudaMemcpy(d_k, k.data(), k.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_v, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(d_pages, 0, want.size());  // the padding between sections, as PackPage leaves it
    CompressArgs a;
    a.k = static_cast<const float*>(d_k);
    a.v = static_cast<const float*>(d_v);
    a.chunks = kChunks;
    a.pages = static_cast<uint8_t*>(d_pages);
    a.page_ids = static_cast<const int32_t*>(d_ids);
    ASSERT_TRUE(CompressToPages(L, a, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> got(want.size());
    cudaMemcpy(got.data(), d_pages, got.size(), cudaMemcpyDeviceToHost);
    for (void* p : {d_k, d_v, d_pages, d_ids}) cudaFree(p);
    size_t differ = 0, first = got.size();
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        ++differ;
        first = std::min(first, i);
      }
    }
    EXPECT_EQ(differ, 0u) << "first at byte " << first << " of " << got.size();
  }
}

}  // namespace
}  // namespace strata::kernels::cuda
