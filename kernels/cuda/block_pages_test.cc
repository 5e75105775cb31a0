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
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "common/half.h"
#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/block_operands.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "kernels/cuda/compress.h"
#include "kernels/cuda/page_tiles.h"
#include "kernels/decode_attention.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels::cuda {
namespace {

constexpr uint32_t kHeads = 2, kDim = 128, kTokens = 64;

struct Block {
  AlignedBuffer bytes;
  BlockView view() const { return *BlockView::Parse(bytes.span()); }
};

std::unique_ptr<Block> Encode(const std::string& spec, uint32_t chunk, uint64_t seed,
                              uint32_t tokens = kTokens) {
  auto codec = Codec::Create(spec);
  EXPECT_TRUE(codec.ok()) << codec.status();
  const SyntheticKv kv = MakeSyntheticKv(tokens, kHeads, kDim, seed, chunk * tokens);
  absl::StatusOr<AlignedBuffer> b =
      (*codec)->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, tokens, kHeads, kDim},
                       {.layer = 0, .chunk_index = chunk});
  EXPECT_TRUE(b.ok()) << b.status();
  auto block = std::make_unique<Block>();
  block->bytes = *std::move(b);
  EXPECT_TRUE(BlockView::Parse(block->bytes.span()).ok());
  return block;
}

double HalfAt(const uint8_t* p, size_t offset, size_t index) {
  uint16_t bits;
  std::memcpy(&bits, p + offset + 2 * index, 2);
  return static_cast<double>(HalfBitsToFloat(bits));
}

double CodeAt(const uint8_t* p, size_t offset, size_t row_bytes, int bits, size_t row, size_t c) {
  const size_t bit = c * bits;
  return (p[offset + row * row_bytes + bit / 8] >> (bit % 8)) & ((1 << bits) - 1);
}

// What the page says token t of head h is, as PagedKvLayout defines it.
double PageValue(const PagedKvLayout& L, const uint8_t* page, bool key, int h, int t, int c) {
  const size_t D = L.head_dim;
  if (L.format == PageFormat::kFp16) {
    return HalfAt(page, key ? L.KeyCodesOf(h) : L.ValueCodesOf(h), t * D + c);
  }
  const int bits = key ? L.key_bits : L.value_bits;
  const double code =
      CodeAt(page, key ? L.KeyCodesOf(h) : L.ValueCodesOf(h), D * bits / 8, bits, t, c);
  if (key) {
    const size_t i = static_cast<size_t>(t / L.k_group) * D + c;
    return HalfAt(page, L.KeyScalesOf(h), i) * code + HalfAt(page, L.KeyZerosOf(h), i);
  }
  const size_t i = static_cast<size_t>(t) * (D / L.v_group) + c / L.v_group;
  return HalfAt(page, L.ValueScalesOf(h), i) * code + HalfAt(page, L.ValueZerosOf(h), i);
}

// What a staged slice (TileLayout) says token t of the slice is.
double TileValue(const TileLayout& T, const uint8_t* tile, bool key, int t, int c) {
  const size_t D = T.head_dim;
  if (T.format == PageFormat::kFp16) return HalfAt(tile, key ? 0 : T.FpValues(), t * D + c);
  const int bits = key ? T.key_bits : T.value_bits;
  const double code = CodeAt(tile, key ? T.KeyCodes() : T.ValueCodes(), D * bits / 8, bits, t, c);
  if (key) {
    const size_t i = static_cast<size_t>(t / T.k_group) * D + c;
    return HalfAt(tile, T.KeyScales(), i) * code + HalfAt(tile, T.KeyZeros(), i);
  }
  const size_t i = static_cast<size_t>(t) * (D / T.v_group) + c / T.v_group;
  return HalfAt(tile, T.ValueScales(), i) * code + HalfAt(tile, T.ValueZeros(), i);
}

// The chunk sizes clusters use: 64 to 256 tokens (256 the default), and 512.
constexpr uint32_t kChunkSizes[] = {64, 128, 256, 512};
constexpr const char* kSpecs[] = {"fp16",          "kivi:k4v4:g32", "kivi:k2v2:g32",
                                  "kivi:k4v2:g16", "kivi:k2v4:g64", "kivi:k4v4:g128",
                                  "kcvt:k4v4"};

// The block's own bytes are the page: read through the layout, they hold exactly the values the
// CPU decodes from the block.
TEST(BlockPagesTest, ABlockReadThroughItsLayoutHoldsExactlyWhatTheCpuDecodes) {
  for (uint32_t tokens : kChunkSizes) {
    for (const char* spec : kSpecs) {
      SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens"));
      std::unique_ptr<Block> b = Encode(spec, 3, 17, tokens);
      absl::StatusOr<PagedKvLayout> L = PageLayoutFor(b->view());
      ASSERT_TRUE(L.ok()) << L.status();
      EXPECT_EQ(L->page_tokens, static_cast<int>(tokens));
      EXPECT_GE(L->PageBytes(), b->bytes.size());
      EXPECT_LT(L->PageBytes(), b->bytes.size() + kPageAlignment);
      std::vector<float> k(static_cast<size_t>(tokens) * kHeads * kDim), v(k.size());
      ASSERT_TRUE(DecodeBlockRef(b->view(), k.data(), v.data()).ok());
      const uint8_t* page = b->bytes.data();
      double worst = 0;
      for (uint32_t t = 0; t < tokens; ++t) {
        for (uint32_t h = 0; h < kHeads; ++h) {
          for (uint32_t c = 0; c < kDim; ++c) {
            const size_t i = (static_cast<size_t>(t) * kHeads + h) * kDim + c;
            worst = std::max(worst, std::abs(PageValue(*L, page, true, h, t, c) - k[i]));
            worst = std::max(worst, std::abs(PageValue(*L, page, false, h, t, c) - v[i]));
          }
        }
      }
      EXPECT_LT(worst, 1e-5);  // fp32 rounding of scale * code + zero, nothing more
    }
  }
}

// What the kernels stage from a page (PartOf, a slice of TileTokens() tokens at a time, each
// part copied as 16-byte pieces the way cp.async copies them) holds the CPU's values of the
// slice's tokens: the addressing the GPU uses, checked on the CPU.
TEST(BlockPagesTest, TheKernelsSlicesOfAPageHoldTheCpusValuesOfTheirTokens) {
  for (uint32_t tokens : kChunkSizes) {
    for (const char* spec : kSpecs) {
      SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens"));
      std::unique_ptr<Block> b = Encode(spec, 2, 23, tokens);
      absl::StatusOr<PagedKvLayout> L = PageLayoutFor(b->view());
      ASSERT_TRUE(L.ok()) << L.status();
      const TileLayout T(*L);
      EXPECT_EQ(T.tokens * T.tiles_per_page, L->page_tokens);
      EXPECT_LE(T.tokens, 128);
      std::vector<uint8_t> page(L->PageBytes(), 0);
      std::memcpy(page.data(), b->bytes.data(), b->bytes.size());
      std::vector<float> k(static_cast<size_t>(tokens) * kHeads * kDim), v(k.size());
      ASSERT_TRUE(DecodeBlockRef(b->view(), k.data(), v.data()).ok());
      double worst = 0;
      for (int h = 0; h < L->kv_heads; ++h) {
        for (int sub = 0; sub < T.tiles_per_page; ++sub) {
          std::vector<uint8_t> tile(T.HeadBytes(), 0xAB);
          for (int p = 0; p < PartCount(*L); ++p) {
            const TilePart part = PartOf(*L, p, h, sub);
            ASSERT_EQ(part.bytes % 16, 0) << "part " << p;
            ASSERT_EQ(part.src % 16, 0u) << "part " << p;
            ASSERT_EQ(part.dst % 16, 0) << "part " << p;
            ASSERT_LE(part.src + part.bytes, page.size()) << "part " << p;
            ASSERT_LE(part.dst + part.bytes, tile.size()) << "part " << p;
            for (int i = 0; i < part.bytes; i += 16) {
              std::memcpy(tile.data() + part.dst + i, page.data() + part.src + i, 16);
            }
          }
          for (int t = 0; t < T.tokens; ++t) {
            for (uint32_t c = 0; c < kDim; ++c) {
              const size_t i = (static_cast<size_t>(sub * T.tokens + t) * kHeads + h) * kDim + c;
              worst = std::max(worst, std::abs(TileValue(T, tile.data(), true, t, c) - k[i]));
              worst = std::max(worst, std::abs(TileValue(T, tile.data(), false, t, c) - v[i]));
            }
          }
        }
      }
      EXPECT_LT(worst, 1e-5);
    }
  }
}

TEST(BlockPagesTest, BlocksTheKernelsCannotReadAreRefusedSayingWhy) {
  // head_dim 96: no kernel takes it.
  {
    auto codec = *Codec::Create("kivi:k4v4:g32");
    const SyntheticKv kv = MakeSyntheticKv(kTokens, kHeads, 96, 5);
    absl::StatusOr<AlignedBuffer> b =
        codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, kTokens, kHeads, 96}, {});
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<PagedKvLayout> L = PageLayoutFor(*BlockView::Parse(b->span()));
    EXPECT_EQ(L.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_NE(L.status().message().find("head_dim 96"), std::string::npos) << L.status();
  }
  // A calibrated codec's blocks without their calibration, and described without the constants
  // that hold its channel orders.
  const CodecSpec skvq = *CodecSpec::Parse("skvq:k2v2:g32");
  std::shared_ptr<Calibration> cal = MakeSyntheticCalibration(skvq, kHeads, kDim, 3);
  auto codec = *Codec::Create("skvq:k2v2:g32", cal);
  const SyntheticKv kv = MakeSyntheticKv(kTokens, kHeads, kDim, 5);
  absl::StatusOr<AlignedBuffer> b =
      codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, kTokens, kHeads, kDim}, {});
  ASSERT_TRUE(b.ok()) << b.status();
  const BlockView view = *BlockView::Parse(b->span());
  EXPECT_EQ(PageLayoutFor(view).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(PageLayoutFor(view, cal.get())->format, PageFormat::kGeneral);
  absl::StatusOr<PageDesc> no_constants = DescribePage(view, cal.get(), nullptr);
  EXPECT_EQ(no_constants.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(no_constants.status().message().find("channel orders"), std::string::npos)
      << no_constants.status();
  const PageConstants constants = PageConstants::For(cal.get());
  EXPECT_TRUE(DescribePage(view, cal.get(), &constants).ok());
  // A page of another pool's layout is refused; one of the same codec and shape is not.
  std::unique_ptr<Block> kivi = Encode("kivi:k4v4:g32", 1, 5);
  absl::StatusOr<PagedKvLayout> same = PageLayoutForCodec("kivi:k4v4:g32", kTokens, kHeads, kDim);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->format, PageFormat::kAffine);
  EXPECT_TRUE(CheckPage(kivi->view(), *same).ok()) << CheckPage(kivi->view(), *same);
  PagedKvLayout other = *same;
  other.key_bits = 2;
  EXPECT_EQ(CheckPage(kivi->view(), other).code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<PagedKvLayout> longer =
      PageLayoutForCodec("kivi:k4v4:g32", 2 * kTokens, kHeads, kDim);
  ASSERT_TRUE(longer.ok()) << longer.status();
  EXPECT_EQ(CheckPage(kivi->view(), *longer).code(), absl::StatusCode::kInvalidArgument);
  // A general pool takes any codec's pages of its shape, not another shape's.
  absl::StatusOr<PagedKvLayout> general =
      PageLayoutForCodec("gear:k4v4:g32:r2:s2", kTokens, kHeads, kDim);
  ASSERT_TRUE(general.ok()) << general.status();
  EXPECT_EQ(general->format, PageFormat::kGeneral);
  EXPECT_TRUE(CheckPage(Encode("gear:k4v4:g32:r2:s2", 1, 5)->view(), *general).ok());
  EXPECT_EQ(CheckPage(Encode("gear:k4v4:g32:r2:s2", 1, 5, 2 * kTokens)->view(), *general).code(),
            absl::StatusCode::kInvalidArgument);
  // Checking and describing at once: the same refusals, no descriptor for a fast layout.
  absl::StatusOr<std::optional<PageDesc>> fast =
      CheckAndDescribePage(kivi->view(), *same, nullptr, nullptr);
  ASSERT_TRUE(fast.ok()) << fast.status();
  EXPECT_FALSE(fast->has_value());
  EXPECT_EQ(CheckAndDescribePage(kivi->view(), other, nullptr, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckAndDescribePage(Encode("gear:k4v4:g32:r2:s2", 1, 5, 2 * kTokens)->view(), *general,
                                 nullptr, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A layout whose sections overlap or leave the page is refused by the kernels' own check.
  PagedKvLayout bad = *same;
  bad.value_codes = bad.key_codes + 16;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  bad = *same;
  bad.page_bytes = bad.value_zeros;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  bad = *same;
  bad.key_scales += 8;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Every codec family, with sinks, fp8 metadata, rotation, 3- and 8-bit codes, calibrations.
constexpr const char* kGeneralSpecs[] = {"bf16",
                                         "int8",
                                         "fp8e4m3",
                                         "kivi:k3v3:g64",
                                         "kivi:k8v8:g16",
                                         "kivi:k2v2:g32:m8",
                                         "kivi:k2v2:g32:sink4",
                                         "kivi:k3v3:g32:rot",
                                         "kcvt:k3v3",
                                         "gearl:k2v2:g32:r4",
                                         "gear:k2v2:g32:r4:s2",
                                         "gear:k4v4:kcvt:r2:s1",
                                         "gear:k2v2:g32:r4:s2:sink2",
                                         "zipcache:k2v2:h4:s10",
                                         "zipcache:k2v2:h4:s10:sink2",
                                         "skvq:k2v2:g32",
                                         "skvq:k2v2:g32:m8",
                                         "skvq:k4v4:g16:sink2",
                                         "tada:k2v2:g32",
                                         "tada:k2v2:g32:sink2",
                                         "cq:c4:b6",
                                         "cq:c8:b8:sink2",
                                         "cq:c4:b8:norm:sink2"};

struct CodecBlocks {
  std::shared_ptr<Calibration> calibration;
  std::vector<AlignedBuffer> blocks;  // chunk i of the sequence
};

// Chunks of synthetic KV from `seed`; the calibration (for codecs that need one) from `cal_seed`
// (blocks of different data under one calibration: give them one cal_seed).
CodecBlocks EncodeChunks(const std::string& spec, uint32_t chunks, uint32_t tokens, uint64_t seed,
                         uint64_t cal_seed = 0) {
  CodecBlocks out;
  const CodecSpec parsed = *CodecSpec::Parse(spec);
  if (parsed.needs_calibration()) {
    out.calibration = MakeSyntheticCalibration(parsed, kHeads, kDim, cal_seed ? cal_seed : seed);
  }
  auto codec = Codec::Create(spec, out.calibration);
  EXPECT_TRUE(codec.ok()) << codec.status();
  for (uint32_t c = 0; c < chunks; ++c) {
    const SyntheticKv kv = MakeSyntheticKv(tokens, kHeads, kDim, seed + c, c * tokens);
    absl::StatusOr<AlignedBuffer> b =
        (*codec)->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, tokens, kHeads, kDim},
                         {.layer = 0, .chunk_index = c});
    EXPECT_TRUE(b.ok()) << b.status();
    out.blocks.push_back(*std::move(b));
  }
  return out;
}

// Each part of each page, decoded element by element through its descriptor (the general
// kernel's own functions, run on the CPU), equals the CPU reference decoder's values of that part,
// at the original channels.
TEST(BlockPagesTest, EveryCodecsPageDecodesThroughItsDescriptorAsTheCpuDecodesIt) {
  for (const char* spec : kGeneralSpecs) {
    for (uint32_t tokens : {64u, 256u}) {
      SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens"));
      CodecBlocks cb = EncodeChunks(spec, 2, tokens, 31);
      const PageConstants constants = PageConstants::For(cb.calibration.get());
      absl::StatusOr<PagedKvLayout> pool =
          PageLayoutForCodec(spec, tokens, kHeads, kDim, cb.calibration);
      ASSERT_TRUE(pool.ok()) << pool.status();
      EXPECT_EQ(pool->format, PageFormat::kGeneral);
      for (const AlignedBuffer& block : cb.blocks) {
        const BlockView view = *BlockView::Parse(block.span());
        EXPECT_TRUE(CheckPage(view, *pool, cb.calibration.get()).ok())
            << CheckPage(view, *pool, cb.calibration.get());
        absl::StatusOr<PageDesc> desc = DescribePage(view, cb.calibration.get(), &constants);
        ASSERT_TRUE(desc.ok()) << desc.status();
        // The backend's one-parse path gives the same descriptor.
        absl::StatusOr<std::optional<PageDesc>> once =
            CheckAndDescribePage(view, *pool, cb.calibration.get(), &constants);
        ASSERT_TRUE(once.ok()) << once.status();
        ASSERT_TRUE(once->has_value());
        EXPECT_EQ(std::memcmp(&**once, &*desc, sizeof(PageDesc)), 0);
        absl::StatusOr<PreparedBlock> prepared = PrepareBlock(view, cb.calibration.get());
        ASSERT_TRUE(prepared.ok()) << prepared.status();
        ASSERT_EQ(desc->parts, prepared->parts.size());
        double worst = 0, scale = 0;
        for (uint32_t p = 0; p < desc->parts; ++p) {
          const BlockOperands& ops = prepared->parts[p];
          const PagePartDesc& pd = desc->part[p];
          ASSERT_EQ(pd.tokens, ops.tokens);
          std::vector<float> k(static_cast<size_t>(ops.tokens) * kHeads * kDim), v(k.size());
          ASSERT_TRUE(DecodeOperandsRef(ops, k.data(), v.data()).ok());
          for (uint32_t h = 0; h < kHeads; ++h) {
            for (uint32_t t = 0; t < ops.tokens; ++t) {
              for (uint32_t d = 0; d < kDim; ++d) {
                for (const bool is_k : {true, false}) {
                  const PageTensorDesc& td = is_k ? pd.k : pd.v;
                  const float x = PageElement(block.data(), constants.bytes().data(), td, is_k,
                                              ops.tokens, kDim, h, t, d);
                  const uint32_t c = PageChannel(constants.bytes().data(), td, kDim, h, d);
                  ASSERT_LT(c, kDim);
                  const float want =
                      (is_k ? k : v)[(static_cast<size_t>(t) * kHeads + h) * kDim + c];
                  worst = std::max(worst, std::abs(static_cast<double>(x) - want));
                  scale = std::max(scale, std::abs(static_cast<double>(want)));
                }
              }
            }
          }
        }
        EXPECT_LE(worst, 1e-6 * std::max(1.0, scale));  // the same arithmetic, term for term
      }
    }
  }
}

// The general kernel's column decoding (PageDecodeColumn over every channel, rows split between
// two threads' strides, then PageOutlier for every item) gives each element PageElement's value,
// for every codec, at 64- and 256-token pages, for row windows that straddle affine groups.
TEST(BlockPagesTest, ColumnsDecodeAsElementsDo) {
  constexpr uint32_t kRows = 16, kStride = kDim + 4;
  for (const char* spec : kGeneralSpecs) {
    for (uint32_t tokens : {64u, 256u}) {
      SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens"));
      CodecBlocks cb = EncodeChunks(spec, 1, tokens, 47);
      const PageConstants constants = PageConstants::For(cb.calibration.get());
      const uint8_t* cs = constants.bytes().data();
      const AlignedBuffer& block = cb.blocks[0];
      const BlockView view = *BlockView::Parse(block.span());
      absl::StatusOr<PageDesc> desc = DescribePage(view, cb.calibration.get(), &constants);
      ASSERT_TRUE(desc.ok()) << desc.status();
      double worst = 0, scale = 0;
      size_t checked = 0;
      for (uint32_t p = 0; p < desc->parts; ++p) {
        const PagePartDesc& pd = desc->part[p];
        const uint32_t T = pd.tokens;
        for (uint32_t h = 0; h < kHeads; ++h) {
          // Windows of 16 rows from 0, and two that are not aligned to groups.
          std::vector<std::pair<uint32_t, uint32_t>> windows;
          for (uint32_t t0 = 0; t0 < T; t0 += kRows)
            windows.push_back({t0, std::min(kRows, T - t0)});
          if (T > 40) {
            windows.push_back({5, 13});   // not group-aligned
            windows.push_back({25, 14});  // across a 32-token group
          }
          for (const bool is_k : {true, false}) {
            const PageTensorDesc& td = is_k ? pd.k : pd.v;
            for (const auto& [t0, n] : windows) {
              std::vector<float> rows(kRows * kStride, std::nanf(""));
              for (uint32_t d = 0; d < kDim; ++d) {
                for (uint32_t r0 = 0; r0 < 2; ++r0) {
                  PageDecodeColumn(block.data(), cs, td, T, kDim, h, t0, n, d, r0, 2, rows.data(),
                                   kStride);
                }
              }
              for (uint32_t i = 0; i < PageOutlierItems(td, is_k, kDim, n); ++i) {
                PageOutlier(block.data(), cs, td, is_k, T, kDim, h, t0, n, i, rows.data(), kStride,
                            [](float* at, float x) { *at += x; });
              }
              for (uint32_t r = 0; r < n; ++r) {
                for (uint32_t d = 0; d < kDim; ++d) {
                  const float want = PageElement(block.data(), cs, td, is_k, T, kDim, h, t0 + r, d);
                  const float got = rows[r * kStride + PageChannel(cs, td, kDim, h, d)];
                  ASSERT_FALSE(std::isnan(got)) << "row " << r << " channel " << d;
                  worst = std::max(worst, std::abs(static_cast<double>(got) - want));
                  scale = std::max(scale, std::abs(static_cast<double>(want)));
                  ++checked;
                }
              }
            }
          }
        }
      }
      EXPECT_GT(checked, 0u);
      EXPECT_LE(worst, 1e-6 * std::max(1.0, scale));
    }
  }
}

// A pool of blocks with two layouts (the sinks' first chunk) or several codecs (the mix) is
// general; a codec's blocks with one fast layout stay on the fast kernels; descriptors of equal
// pages are one entry of the table.
TEST(BlockPagesTest, APoolIsGeneralOnlyWhereItsPagesNeedIt) {
  EXPECT_EQ(PageLayoutForCodec("kivi:k2v2:g32", kTokens, kHeads, kDim)->format,
            PageFormat::kAffine);
  EXPECT_EQ(PageLayoutForCodec("fp16", kTokens, kHeads, kDim)->format, PageFormat::kFp16);
  absl::StatusOr<PagedKvLayout> sinks =
      PageLayoutForCodec("kivi:k4v4:g32:sink4", kTokens, kHeads, kDim);
  ASSERT_TRUE(sinks.ok()) << sinks.status();
  EXPECT_EQ(sinks->format, PageFormat::kGeneral);
  CodecBlocks cb = EncodeChunks("kivi:k4v4:g32:sink4", 4, kTokens, 7);
  PageDescTable table(8);
  std::vector<uint16_t> ids;
  for (const AlignedBuffer& b : cb.blocks) {
    EXPECT_LE(b.size(), sinks->PageBytes());
    absl::StatusOr<PageDesc> d = DescribePage(*BlockView::Parse(b.span()), nullptr, nullptr);
    ASSERT_TRUE(d.ok()) << d.status();
    absl::StatusOr<uint16_t> id = table.Intern(*d);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  EXPECT_EQ(table.descs().size(), 2u);  // the first chunk's, and every later one's
  EXPECT_EQ(table.descs()[0].parts, 2u);
  EXPECT_EQ(table.descs()[1].parts, 1u);
  EXPECT_EQ(ids, (std::vector<uint16_t>{0, 1, 1, 1}));
  // Blocks whose per-block numbers differ (fp8's tensor scale, m8's metadata multipliers) share
  // one descriptor: it holds where those numbers are, not the numbers.
  for (const char* spec : {"fp8e4m3", "kivi:k2v2:g32:m8", "skvq:k2v2:g32:m8"}) {
    SCOPED_TRACE(spec);
    CodecBlocks many = EncodeChunks(spec, 12, kTokens, 3);
    const PageConstants constants = PageConstants::For(many.calibration.get());
    PageDescTable one(4);
    for (const AlignedBuffer& b : many.blocks) {
      absl::StatusOr<PageDesc> d =
          DescribePage(*BlockView::Parse(b.span()), many.calibration.get(), &constants);
      ASSERT_TRUE(d.ok()) << d.status();
      ASSERT_TRUE(one.Intern(*d).ok());
    }
    EXPECT_EQ(one.descs().size(), 1u);
  }
  PageDescTable tiny(1);
  ASSERT_TRUE(tiny.Intern(table.descs()[0]).ok());
  EXPECT_EQ(tiny.Intern(table.descs()[1]).status().code(), absl::StatusCode::kResourceExhausted);
}

// A pool of CQ (with or without fp16 sinks) is a codebook pool (its runs and bits in the layout,
// for the codebook kernel) and takes no other page.
TEST(BlockPagesTest, PoolsOfCqAloneAreCodebookPools) {
  struct Case {
    const char* spec;
    int group, bits;
  };
  for (const Case& c : {Case{"cq:c4:b8", 4, 8}, Case{"cq:c8:b6:norm", 8, 6}, Case{"cq:c2:b5", 2, 5},
                        Case{"cq:c4:b8:sink2", 4, 8}}) {
    SCOPED_TRACE(c.spec);
    CodecBlocks cb = EncodeChunks(c.spec, 2, kTokens, 5);
    absl::StatusOr<PagedKvLayout> L =
        PageLayoutForCodec(c.spec, kTokens, kHeads, kDim, cb.calibration);
    ASSERT_TRUE(L.ok()) << L.status();
    EXPECT_EQ(L->format, PageFormat::kGeneral);
    EXPECT_EQ(L->codebook_group, c.group);
    EXPECT_EQ(L->codebook_bits, c.bits);
    EXPECT_TRUE(L->Validate().ok()) << L->Validate();
    const PageConstants constants = PageConstants::For(cb.calibration.get());
    for (const AlignedBuffer& b : cb.blocks) {
      const BlockView view = *BlockView::Parse(b.span());
      EXPECT_TRUE(CheckPage(view, *L, cb.calibration.get()).ok());
      EXPECT_TRUE(CheckAndDescribePage(view, *L, cb.calibration.get(), &constants).ok());
    }
  }
  // A codebook pool refuses pages of CQ with other runs or bits, and of other codecs.
  CodecBlocks c4 = EncodeChunks("cq:c4:b8", 1, kTokens, 5);
  absl::StatusOr<PagedKvLayout> pool =
      PageLayoutForCodec("cq:c4:b8", kTokens, kHeads, kDim, c4.calibration);
  ASSERT_TRUE(pool.ok()) << pool.status();
  // (Pages made large enough for any of them: refused for what they hold, not their size.)
  PagedKvLayout roomy = *pool;
  roomy.page_bytes = 1 << 20;
  for (const char* other : {"cq:c8:b8", "cq:c4:b6", "cq:c8:b8:sink2", "kivi:k2v2:g32:sink4"}) {
    SCOPED_TRACE(other);
    CodecBlocks ob = EncodeChunks(other, 1, kTokens, 5);
    const BlockView view = *BlockView::Parse(ob.blocks[0].span());
    const PageConstants constants = PageConstants::For(ob.calibration.get());
    const absl::Status s = CheckPage(view, roomy, ob.calibration.get());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "alone, runs of 4 channels at 8 bits")) << s;
    EXPECT_EQ(CheckAndDescribePage(view, roomy, ob.calibration.get(), &constants).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Codebook fields the kernel does not take, or on a fast layout, are refused.
  for (const auto& [group, bits] : {std::pair{3, 8}, std::pair{4, 9}, std::pair{4, 3}}) {
    PagedKvLayout bad = *pool;
    bad.codebook_group = group;
    bad.codebook_bits = bits;
    EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument) << group << " " << bits;
  }
  PagedKvLayout fast = *PageLayoutForCodec("kivi:k2v2:g32", kTokens, kHeads, kDim);
  fast.codebook_group = 4;
  fast.codebook_bits = 8;
  EXPECT_EQ(fast.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// A Strata mix's pool is general; its layers of CQ (with fp16 sinks or not) are codebook pools of
// their own (the codebook kernel's), each holding its pages to that, and its other layers are the
// pool's.
TEST(BlockPagesTest, AMixsCqLayersAreCodebookPoolsOfTheirOwn) {
  const std::shared_ptr<Calibration> c4 =
      MakeSyntheticCalibration(*CodecSpec::Parse("cq:c4:b8"), kHeads, kDim, 3);
  const std::shared_ptr<Calibration> c8 =
      MakeSyntheticCalibration(*CodecSpec::Parse("cq:c8:b6:norm"), kHeads, kDim, 4);
  auto mix = std::make_shared<Calibration>();
  mix->codec = "strata:b3";
  mix->kv_heads = kHeads;
  mix->head_dim = kDim;
  mix->layers = {c4->layers[0], LayerCalibration{}, c8->layers[0], LayerCalibration{}};
  mix->layers[0].spec = "cq:c4:b8:sink4";
  mix->layers[1].spec = "kivi:k4v4:g32";
  mix->layers[2].spec = "cq:c8:b6:norm";
  mix->layers[3].spec = "gear:k2v2:g32:r2:s2";
  std::vector<PagedKvLayout> layers;
  absl::StatusOr<PagedKvLayout> pool =
      PageLayoutForCodec("strata:b3", kTokens, kHeads, kDim, mix, 4, &layers);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(pool->format, PageFormat::kGeneral);
  EXPECT_EQ(pool->codebook_group, 0);
  ASSERT_EQ(layers.size(), 4u);
  const int want[4][2] = {{4, 8}, {0, 0}, {8, 6}, {0, 0}};
  for (uint32_t l = 0; l < 4; ++l) {
    SCOPED_TRACE(l);
    EXPECT_EQ(layers[l].format, PageFormat::kGeneral);
    EXPECT_EQ(layers[l].page_bytes, pool->page_bytes);
    EXPECT_EQ(layers[l].codebook_group, want[l][0]);
    EXPECT_EQ(layers[l].codebook_bits, want[l][1]);
  }
  // Each layer's blocks are pages of its layout; layer 0's are not pages of layer 2's.
  auto codec = Codec::Create("strata:b3", mix);
  ASSERT_TRUE(codec.ok()) << codec.status();
  const SyntheticKv kv = MakeSyntheticKv(kTokens, kHeads, kDim, 8, kTokens);
  for (uint32_t l = 0; l < 4; ++l) {
    absl::StatusOr<AlignedBuffer> b =
        (*codec)->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, kTokens, kHeads, kDim},
                         {.layer = l, .chunk_index = 1});
    ASSERT_TRUE(b.ok()) << b.status();
    const BlockView view = *BlockView::Parse(b->span());
    EXPECT_TRUE(CheckPage(view, layers[l], mix.get()).ok())
        << CheckPage(view, layers[l], mix.get());
    EXPECT_TRUE(CheckPage(view, *pool, mix.get()).ok());
    if (l == 0) {
      const absl::Status s = CheckPage(view, layers[2], mix.get());
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "runs of 8 channels at 6 bits")) << s;
    }
  }
  // A single codec: every layer the pool's.
  std::vector<PagedKvLayout> kivi;
  ASSERT_TRUE(PageLayoutForCodec("kivi:k2v2:g32", kTokens, kHeads, kDim, nullptr, 3, &kivi).ok());
  ASSERT_EQ(kivi.size(), 3u);
  for (const PagedKvLayout& l : kivi) EXPECT_EQ(l.format, PageFormat::kAffine);
}

// The GPU over blocks copied into device memory as they are, against the CPU's reference
// attention over the same blocks (and an fp16 window), 8 query heads over 2 KV heads, one
// sequence per codec and chunk size.
TEST(BlockPagesGpuTest, GpuAttentionOverCodecBlocksEqualsTheCpuReference) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  constexpr int kQHeads = 8, kChunks = 6, kWindow = 19;
  const std::pair<const char*, uint32_t> cases[] = {
      {"fp16", 64},           {"kivi:k4v4:g32", 64},   {"kivi:k2v2:g32", 64},  {"fp16", 256},
      {"kivi:k4v4:g32", 256}, {"kivi:k2v2:g128", 256}, {"kivi:k4v2:g16", 128}, {"kcvt:k4v4", 512}};
  for (const auto& [spec, tokens] : cases) {
    SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens"));
    std::vector<std::unique_ptr<Block>> blocks;
    std::vector<PreparedBlock> prepared;
    for (int c = 0; c < kChunks; ++c) {
      blocks.push_back(Encode(spec, c + 1, 100 + c, tokens));
      absl::StatusOr<PreparedBlock> p = PrepareBlock(blocks.back()->view());
      ASSERT_TRUE(p.ok()) << p.status();
      prepared.push_back(*std::move(p));
    }
    std::vector<const BlockOperands*> ops;
    for (const PreparedBlock& p : prepared) ops.push_back(&p.parts[0]);
    absl::StatusOr<PagedKvLayout> L = PageLayoutFor(blocks[0]->view());
    ASSERT_TRUE(L.ok()) << L.status();
    std::vector<uint8_t> pool(L->PageBytes() * kChunks);
    for (int c = 0; c < kChunks; ++c) {  // the blocks' bytes as they are, in reverse order
      ASSERT_TRUE(CheckPage(blocks[c]->view(), *L).ok());
      std::memcpy(pool.data() + (kChunks - 1 - c) * L->PageBytes(), blocks[c]->bytes.data(),
                  blocks[c]->bytes.size());
    }
    std::vector<int32_t> table(kChunks);
    for (int c = 0; c < kChunks; ++c) table[c] = kChunks - 1 - c;
    // The window at fp16 (the GPU's), the same values widened for the CPU.
    const SyntheticKv w = MakeSyntheticKv(kWindow, kHeads, kDim, 9, (kChunks + 1) * tokens);
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
    ASSERT_TRUE(
        DecodeAttentionRef({.q_heads = kQHeads, .kv_heads = kHeads, .head_dim = kDim}, {&seq, 1})
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

// Device copies of host bytes (at least 16 bytes each; null host: uninitialized), freed with it.
class DeviceCopies {
 public:
  DeviceCopies() = default;
  DeviceCopies(const DeviceCopies&) = delete;
  DeviceCopies& operator=(const DeviceCopies&) = delete;
  ~DeviceCopies() {
    for (void* p : owned_) cudaFree(p);
  }
  void* operator()(const void* host, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(bytes, 16)), cudaSuccess);
    if (host != nullptr && bytes > 0) cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
    owned_.push_back(d);
    return d;
  }

 private:
  std::vector<void*> owned_;
};

// Two sequences of `spec`'s blocks (5 and 3 chunks of `tokens` tokens, different data, one
// calibration; pages in scattered order, each naming its descriptor, calibration constants beside
// them) and fp16 windows of `window` tokens, in a general pool (a codebook pool of runs of
// `want_codebook_group` channels where it is > 0; not checked where it is < 0), through PagedDecode
// with `kernel`, against the CPU reference attention over the same blocks and windows: err2 / ref2
// of the outputs below `tolerance`. Over `splits` splits (more than a sequence's pages: splits with
// no page, the last one's window alone). With kAuto on a codebook pool, the codebook kernel must be
// the one that runs.
void ExpectGeneralPoolMatchesCpu(const std::string& spec, uint32_t tokens, uint32_t q_heads,
                                 int window, PagedKernel kernel, int want_codebook_group,
                                 double tolerance, int splits = 3) {
  constexpr int kBatch = 2;
  const int chunks_of[kBatch] = {5, 3};
  std::vector<CodecBlocks> seqs;
  // Different data per sequence (a kernel reading the wrong block table row fails), one
  // calibration: the same cal_seed makes the same calibration.
  for (int b = 0; b < kBatch; ++b) {
    seqs.push_back(EncodeChunks(spec, chunks_of[b], tokens, 60 + 100 * b, /*cal_seed=*/7));
  }
  const Calibration* cal = seqs[0].calibration.get();
  const PageConstants constants = PageConstants::For(cal);
  absl::StatusOr<PagedKvLayout> L =
      PageLayoutForCodec(spec, tokens, kHeads, kDim, seqs[0].calibration);
  ASSERT_TRUE(L.ok()) << L.status();
  ASSERT_EQ(L->format, PageFormat::kGeneral);
  if (want_codebook_group >= 0) {
    ASSERT_EQ(L->codebook_group, want_codebook_group);
  }
  const int pages = chunks_of[0] + chunks_of[1];
  std::vector<uint8_t> pool(static_cast<size_t>(L->PageBytes()) * pages, 0);
  std::vector<int32_t> table(kBatch * chunks_of[0], 0);
  std::vector<uint16_t> desc_ids(pages);
  PageDescTable descs(16);
  int next = pages - 1;  // pages handed out from the end
  for (int b = 0; b < kBatch; ++b) {
    for (int c = 0; c < chunks_of[b]; ++c, --next) {
      const AlignedBuffer& block = seqs[b].blocks[c];
      const BlockView view = *BlockView::Parse(block.span());
      ASSERT_TRUE(CheckPage(view, *L, cal).ok()) << CheckPage(view, *L, cal);
      std::memcpy(pool.data() + static_cast<size_t>(next) * L->PageBytes(), block.data(),
                  block.size());
      absl::StatusOr<PageDesc> d = DescribePage(view, cal, &constants);
      ASSERT_TRUE(d.ok()) << d.status();
      absl::StatusOr<uint16_t> id = descs.Intern(*d);
      ASSERT_TRUE(id.ok()) << id.status();
      desc_ids[next] = *id;
      table[b * chunks_of[0] + c] = next;
    }
  }
  // Windows at fp16 (the GPU's), the same values widened for the CPU; queries.
  std::vector<uint16_t> wk(static_cast<size_t>(kBatch) * kHeads * window * kDim), wv(wk.size());
  std::vector<std::vector<float>> cpu_wk(kBatch), cpu_wv(kBatch);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> q(kBatch * q_heads * kDim), want(q.size()), got(q.size(), NAN);
  for (float& x : q) x = normal(rng);
  std::vector<PreparedBlock> prepared;
  prepared.reserve(pages);
  for (int b = 0; b < kBatch; ++b) {
    const SyntheticKv w = MakeSyntheticKv(window, kHeads, kDim, 90 + b, chunks_of[b] * tokens);
    cpu_wk[b].resize(w.k.size());
    cpu_wv[b].resize(w.v.size());
    for (int t = 0; t < window; ++t) {
      for (uint32_t h = 0; h < kHeads; ++h) {
        for (uint32_t d = 0; d < kDim; ++d) {
          const size_t src = (static_cast<size_t>(t) * kHeads + h) * kDim + d;
          const size_t dst = ((static_cast<size_t>(b) * kHeads + h) * window + t) * kDim + d;
          wk[dst] = FloatToHalfBits(w.k[src]);
          wv[dst] = FloatToHalfBits(w.v[src]);
          cpu_wk[b][src] = HalfBitsToFloat(wk[dst]);
          cpu_wv[b][src] = HalfBitsToFloat(wv[dst]);
        }
      }
    }
    std::vector<const BlockOperands*> ops;
    for (const AlignedBuffer& block : seqs[b].blocks) {
      absl::StatusOr<PreparedBlock> p = PrepareBlock(*BlockView::Parse(block.span()), cal);
      ASSERT_TRUE(p.ok()) << p.status();
      prepared.push_back(*std::move(p));
      for (const BlockOperands& part : prepared.back().parts) ops.push_back(&part);
    }
    DecodeSequence seq;
    seq.q = q.data() + b * q_heads * kDim;
    seq.blocks = ops;
    seq.window = {cpu_wk[b].data(), cpu_wv[b].data(), static_cast<uint32_t>(window)};
    seq.out = want.data() + b * q_heads * kDim;
    ASSERT_TRUE(
        DecodeAttentionRef({.q_heads = q_heads, .kv_heads = kHeads, .head_dim = kDim}, {&seq, 1})
            .ok());
  }
  const int32_t counts[kBatch] = {chunks_of[0], chunks_of[1]};
  const int32_t wlens[kBatch] = {window, window};
  DeviceCopies upload;
  PagedDecodeArgs a;
  a.pages = static_cast<const uint8_t*>(upload(pool.data(), pool.size()));
  a.block_table = static_cast<const int32_t*>(upload(table.data(), table.size() * 4));
  a.max_pages = chunks_of[0];
  a.page_counts = static_cast<const int32_t*>(upload(counts, sizeof(counts)));
  a.window_k = static_cast<const __half*>(upload(wk.data(), wk.size() * 2));
  a.window_v = static_cast<const __half*>(upload(wv.data(), wv.size() * 2));
  a.window_lens = static_cast<const int32_t*>(upload(wlens, sizeof(wlens)));
  a.max_window = window;
  a.q = static_cast<const float*>(upload(q.data(), q.size() * 4));
  a.batch = kBatch;
  a.kernel = kernel;
  a.q_heads = q_heads;
  float* d_out = static_cast<float*>(upload(got.data(), got.size() * 4));
  a.out = d_out;
  a.splits = splits;
  a.workspace = upload(nullptr, WorkspaceBytes(kBatch, q_heads, kDim, splits));
  a.page_descs = static_cast<const PageDesc*>(
      upload(descs.descs().data(), descs.descs().size() * sizeof(PageDesc)));
  a.page_desc_ids = static_cast<const uint16_t*>(upload(desc_ids.data(), desc_ids.size() * 2));
  a.constants =
      static_cast<const uint8_t*>(upload(constants.bytes().data(), constants.bytes().size()));
  // The codebook kernel where asked for, on a device with a Hopper's or an A100's shared memory
  // (every shape here fits either; smaller parts may fall back to the general kernel).
  int device = 0, optin = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
            cudaSuccess);
  const bool codebook = want_codebook_group > 0 && kernel == PagedKernel::kAuto;
  if (!codebook || optin >= 160 * 1024) {
    ASSERT_EQ(RunsCodebookKernel(*L, a), codebook);
  }
  ASSERT_TRUE(PagedDecode(*L, a, chunks_of[0], nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost);
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << i;
    err2 += (got[i] - want[i]) * (got[i] - want[i]);
    ref2 += want[i] * want[i];
  }
  // The same decoded values; fp32 sums on the GPU against the reference's doubles, with
  // __expf and another order of summation.
  EXPECT_LT(err2 / ref2, tolerance);
}

// The general kernel over every codec's pages against the CPU reference attention over the same
// blocks and an fp16 window: 8 query heads over 2 KV heads, chunk sizes of 64 and 256, two
// sequences of different lengths in one batch, split along the sequence.
TEST(BlockPagesGpuTest, GeneralKernelOverEveryCodecsPagesEqualsTheCpuReference) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  // GQA groups of 4 for every codec; of 1, 3 and 8 (fewer threads than channels, rows split
  // three ways with idle threads, eight ways) for a few that exercise every decoding path.
  const std::set<std::string> few = {"kivi:k3v3:g64", "gear:k2v2:g32:r4:s2:sink2",
                                     "zipcache:k2v2:h4:s10", "skvq:k4v4:g16:sink2",
                                     "cq:c4:b8:norm:sink2"};
  for (const uint32_t q_heads : {8u, 2u, 6u, 16u}) {
    for (const char* spec : kGeneralSpecs) {
      if (q_heads != 8 && !few.contains(spec)) continue;
      for (uint32_t tokens : {64u, 256u}) {
        SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens, ", q_heads, " query heads"));
        // kSimt: the general kernel on codebook pools too (the codebook kernel's test is below).
        ExpectGeneralPoolMatchesCpu(spec, tokens, q_heads, 21, PagedKernel::kSimt, -1, 1e-8);
      }
    }
  }
}

// The codebook kernel (pools of CQ) against the CPU reference, as above: every run width and
// several code widths, with and without norms and fp16 sinks; GQA groups of 1, 3, 4 and 8 (at c4:b8
// a group of 8 takes two blocks of 4 query heads); 64-, 96- (a tile of 64 and one of 32) and
// 256-token chunks; windows of 21 and of 70 tokens (two tiles). The general kernel on the same
// pools (kSimt) must agree as closely.
TEST(BlockPagesGpuTest, CodebookKernelOverCqPagesEqualsTheCpuReference) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  struct Case {
    const char* spec;
    int group;
  };
  // With fp16 sinks (chunk 0: a part of 4 or 2 tokens at fp16 beside the CQ part) or without.
  const Case cases[] = {{"cq:c4:b8:sink4", 4}, {"cq:c8:b8:norm", 8},      {"cq:c2:b5", 2},
                        {"cq:c4:b6:norm", 4},  {"cq:c8:b4", 8},           {"cq:c4:b8", 4},
                        {"cq:c2:b8:norm", 2},  {"cq:c8:b6:norm:sink2", 8}};
  struct Shape {
    uint32_t q_heads, tokens;
    int window, splits;
  };
  // Every case at groups of 4; the first two also at 1, 3, 6 and 8 query heads per KV head (at
  // c4:b8 a block takes 4: 6 runs as 4 + 2, 8 as 4 + 4). 8 splits over 5 and 3 pages: splits with
  // no page, the last with the window alone.
  const Shape every[] = {{8, 64, 21, 3}, {8, 96, 21, 3}, {8, 256, 21, 3}, {8, 64, 70, 8}};
  const Shape first[] = {
      {2, 64, 21, 3}, {6, 96, 70, 3}, {12, 64, 21, 3}, {16, 256, 21, 8}, {16, 64, 70, 3}};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    std::vector<Shape> shapes(std::begin(every), std::end(every));
    if (i < 2) shapes.insert(shapes.end(), std::begin(first), std::end(first));
    for (const Shape& s : shapes) {
      for (const PagedKernel kernel : {PagedKernel::kAuto, PagedKernel::kSimt}) {
        SCOPED_TRACE(
            absl::StrCat(c.spec, " at ", s.tokens, " tokens, ", s.q_heads, " query heads, window ",
                         s.window, ", ", s.splits, " splits",
                         kernel == PagedKernel::kAuto ? ", codebook kernel" : ", general kernel"));
        ExpectGeneralPoolMatchesCpu(c.spec, s.tokens, s.q_heads, s.window, kernel, c.group, 1e-8,
                                    s.splits);
      }
    }
  }
}

// One sequence's blocks through PagedDecode (no window) on the GPU, against the CPU reference:
// err2 / ref2 of the output. Pages in a pool laid out by PageLayoutForCodec, descriptors for
// general pools.
double GpuAgainstCpu(const std::string& spec, uint32_t tokens,
                     const std::vector<AlignedBuffer>& blocks,
                     const std::shared_ptr<Calibration>& cal, int q_heads, uint64_t seed) {
  absl::StatusOr<PagedKvLayout> L = PageLayoutForCodec(spec, tokens, kHeads, kDim, cal);
  EXPECT_TRUE(L.ok()) << L.status();
  if (!L.ok()) return 1;
  const int pages = static_cast<int>(blocks.size());
  const PageConstants constants = PageConstants::For(cal.get());
  std::vector<uint8_t> pool(static_cast<size_t>(L->PageBytes()) * pages, 0);
  std::vector<int32_t> table(pages);
  std::vector<uint16_t> desc_ids(pages, 0);
  PageDescTable descs(16);
  std::vector<PreparedBlock> prepared;
  prepared.reserve(pages);
  std::vector<const BlockOperands*> ops;
  for (int c = 0; c < pages; ++c) {
    const BlockView view = *BlockView::Parse(blocks[c].span());
    EXPECT_TRUE(CheckPage(view, *L, cal.get()).ok());
    const int page = pages - 1 - c;
    table[c] = page;
    std::memcpy(pool.data() + static_cast<size_t>(page) * L->PageBytes(), blocks[c].data(),
                blocks[c].size());
    if (L->format == PageFormat::kGeneral) {
      absl::StatusOr<PageDesc> d = DescribePage(view, cal.get(), &constants);
      EXPECT_TRUE(d.ok()) << d.status();
      if (!d.ok()) return 1;
      desc_ids[page] = *descs.Intern(*d);
    }
    prepared.push_back(*PrepareBlock(view, cal.get()));
    for (const BlockOperands& part : prepared.back().parts) ops.push_back(&part);
  }
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> q(static_cast<size_t>(q_heads) * kDim), want(q.size()), got(q.size(), NAN);
  for (float& x : q) x = normal(rng);
  DecodeSequence seq;
  seq.q = q.data();
  seq.blocks = ops;
  seq.out = want.data();
  EXPECT_TRUE(DecodeAttentionRef(
                  {.q_heads = static_cast<uint32_t>(q_heads), .kv_heads = kHeads, .head_dim = kDim},
                  {&seq, 1})
                  .ok());
  DeviceCopies upload;
  const int32_t count = pages;
  PagedDecodeArgs a;
  a.pages = static_cast<const uint8_t*>(upload(pool.data(), pool.size()));
  a.block_table = static_cast<const int32_t*>(upload(table.data(), table.size() * 4));
  a.max_pages = pages;
  a.page_counts = static_cast<const int32_t*>(upload(&count, 4));
  a.q = static_cast<const float*>(upload(q.data(), q.size() * 4));
  a.batch = 1;
  a.q_heads = q_heads;
  float* d_out = static_cast<float*>(upload(got.data(), got.size() * 4));
  a.out = d_out;
  const int splits = ChooseSplits(*L, a, pages);
  a.splits = splits;
  a.workspace = upload(nullptr, WorkspaceBytes(1, q_heads, kDim, splits));
  a.page_descs = static_cast<const PageDesc*>(
      upload(descs.descs().data(), descs.descs().size() * sizeof(PageDesc)));
  a.page_desc_ids = static_cast<const uint16_t*>(upload(desc_ids.data(), desc_ids.size() * 2));
  a.constants =
      static_cast<const uint8_t*>(upload(constants.bytes().data(), constants.bytes().size()));
  const absl::Status ran = PagedDecode(*L, a, pages, nullptr);
  EXPECT_TRUE(ran.ok()) << ran;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost);
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return 1e30;
    err2 += (got[i] - want[i]) * (got[i] - want[i]);
    ref2 += want[i] * want[i];
  }
  return ref2 > 0 ? err2 / ref2 : err2;
}

// Issue 42's numerical traps, on the fast and the general kernels: keys and values near fp16's
// limit (scales folded into the query stay in fp32: no overflow), and one sequence of 128k tokens
// (long score and P·V accumulations, every split of the sequence merged).
TEST(BlockPagesGpuTest, LargeValuesAndLongContextsStayFiniteAndFollowTheCpu) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  for (const char* spec : {"kivi:k4v4:g32", "kivi:k2v2:g32", "int8", "gear:k4v4:g32:r2:s2"}) {
    SCOPED_TRACE(absl::StrCat(spec, ", values near 30000"));
    auto codec = *Codec::Create(spec);
    std::vector<AlignedBuffer> blocks;
    for (uint32_t c = 0; c < 4; ++c) {
      SyntheticKv kv = MakeSyntheticKv(64, kHeads, kDim, 500 + c, c * 64);
      float peak = 0;
      for (float x : kv.k) peak = std::max(peak, std::abs(x));
      for (float x : kv.v) peak = std::max(peak, std::abs(x));
      for (float& x : kv.k) x *= 30000.f / peak;
      for (float& x : kv.v) x *= 30000.f / peak;
      blocks.push_back(
          *codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, 64, kHeads, kDim},
                         {.layer = 0, .chunk_index = c}));
    }
    EXPECT_LT(GpuAgainstCpu(spec, 64, blocks, nullptr, 8, 3), 1e-6);
  }
  for (const char* spec : {"kivi:k2v2:g32", "int8"}) {
    SCOPED_TRACE(absl::StrCat(spec, ", 131072 tokens"));
    auto codec = *Codec::Create(spec);
    std::vector<AlignedBuffer> blocks;
    for (uint32_t c = 0; c < 512; ++c) {
      const SyntheticKv kv = MakeSyntheticKv(256, kHeads, kDim, 900 + c, c * 256);
      blocks.push_back(
          *codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, 256, kHeads, kDim},
                         {.layer = 0, .chunk_index = c}));
    }
    EXPECT_LT(GpuAgainstCpu(spec, 256, blocks, nullptr, 8, 4), 1e-6);
  }
}

// The GPU's KIVI compression writes, byte for byte, the CPU codec's block of the same chunk
// (same arithmetic, same rounding) into the page that holds the block's header, for several
// chunks at once into scattered pages.
TEST(BlockPagesGpuTest, GpuCompressionWritesTheCpuCodecsBlocksByteForByte) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  constexpr int kChunks = 5;
  const std::pair<const char*, uint32_t> cases[] = {
      {"kivi:k4v4:g32", 64}, {"kivi:k2v2:g32", 64},  {"kivi:k4v2:g16", 64},
      {"kivi:k2v4:g64", 64}, {"kivi:k4v4:g32", 256}, {"kivi:k2v2:g128", 512}};
  for (const auto& [spec, tokens] : cases) {
    SCOPED_TRACE(absl::StrCat(spec, " at ", tokens, " tokens"));
    std::vector<float> k, v;
    std::vector<uint8_t> want, headers;
    PagedKvLayout L;
    for (int c = 0; c < kChunks; ++c) {
      // The values Encode makes for chunk c + 1 (its seed and first position).
      const SyntheticKv kv = MakeSyntheticKv(tokens, kHeads, kDim, 40 + c, (c + 1) * tokens);
      k.insert(k.end(), kv.k.begin(), kv.k.end());
      v.insert(v.end(), kv.v.begin(), kv.v.end());
      std::unique_ptr<Block> b = Encode(spec, c + 1, 40 + c, tokens);
      absl::StatusOr<PagedKvLayout> l = PageLayoutFor(b->view());
      ASSERT_TRUE(l.ok()) << l.status();
      L = *l;
      want.resize(static_cast<size_t>(kChunks) * L.PageBytes());
      headers.resize(want.size());
      // Chunk c to page kChunks - 1 - c: the whole block, and (for the device) its header alone.
      uint8_t* page = want.data() + static_cast<size_t>(kChunks - 1 - c) * L.PageBytes();
      std::memcpy(page, b->bytes.data(), b->bytes.size());
      std::memcpy(headers.data() + static_cast<size_t>(kChunks - 1 - c) * L.PageBytes(),
                  b->bytes.data(), L.key_codes);
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
    // The headers in place and zeros elsewhere (the padding between sections, as the codec writes
    // it).
    cudaMemcpy(d_pages, headers.data(), headers.size(), cudaMemcpyHostToDevice);
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
