#include "kernels/codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "common/block_writer.h"
#include "kernels/codec_layout.h"
#include "common/endian.h"
#include "common/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bit_pack.h"
#include "kernels/block_operands.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels {
namespace {

using testing::HasSubstr;

KvChunkView View(const SyntheticKv& kv) {
  return KvChunkView{kv.k.data(), kv.v.data(), SourceDType::kFloat32,
                     kv.tokens,   kv.kv_heads, kv.head_dim};
}

double RelativeError(const std::vector<float>& want, const std::vector<float>& got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double{want[i]} - got[i]) * (double{want[i]} - got[i]);
    den += double{want[i]} * want[i];
  }
  return std::sqrt(num / den);
}

struct RoundTrip {
  double k_error = 0, v_error = 0, bits = 0;
  size_t bytes = 0;
};

RoundTrip EncodeDecode(const std::string& spec, const SyntheticKv& kv) {
  auto codec = Codec::Create(spec);
  EXPECT_TRUE(codec.ok()) << codec.status();
  absl::StatusOr<AlignedBuffer> block = (*codec)->Encode(View(kv), {.layer = 2, .chunk_index = 1});
  EXPECT_TRUE(block.ok()) << spec << ": " << block.status();
  absl::StatusOr<BlockView> view = BlockView::Parse(block->span());
  EXPECT_TRUE(view.ok()) << spec << ": " << view.status();
  EXPECT_EQ(view->header().codec_spec, spec);
  EXPECT_EQ(view->header().layer, 2u);
  std::vector<float> k(kv.k.size()), v(kv.v.size());
  const absl::Status s = DecodeBlockRef(*view, k.data(), v.data());
  EXPECT_TRUE(s.ok()) << spec << ": " << s;
  RoundTrip r;
  r.k_error = RelativeError(kv.k, k);
  r.v_error = RelativeError(kv.v, v);
  r.bits = view->bits_per_element();
  r.bytes = block->size();
  absl::StatusOr<double> planned = (*codec)->BitsPerElement(kv.tokens, kv.kv_heads, kv.head_dim);
  EXPECT_TRUE(planned.ok());
  EXPECT_DOUBLE_EQ(*planned, r.bits) << spec;
  return r;
}

const char* kAllCodecs[] = {"fp16",
                            "bf16",
                            "int8",
                            "fp8e4m3",
                            "kivi:k8v8:g32",
                            "kivi:k4v4:g32",
                            "kivi:k3v3:g32",
                            "kivi:k2v2:g32",
                            "kcvt:k4v4",
                            "kcvt:k2v2",
                            "gearl:k2v2:g32:r4",
                            "gear:k2v2:g32:r4:s2",
                            "gear:k4v4:kcvt:r4:s2",
                            "gear:k3v3:g64:r2:s1",
                            "zipcache:k2v2:h4:s10",
                            "zipcache:k2v2:h8:s20:p10",
                            "kivi:k2v2:g32:sink4",
                            "int8:sink2",
                            "tada:k2v2:g32",
                            "tada:k4v4:kcvt:sink4",
                            "kivi:k2v2:g32:m8",
                            "kcvt:k4v4:m8",
                            "gear:k2v2:g32:r4:s2:m8:sink2"};

// Error bounds on the synthetic KV (relative Frobenius), loose enough for any seed.
double Bound(const std::string& spec) {
  static const std::map<std::string, double> kBounds = {{"fp16", 1e-3},
                                                        {"bf16", 8e-3},
                                                        {"int8", 3e-2},
                                                        {"fp8e4m3", 8e-2},
                                                        {"kivi:k8v8:g32", 1e-2},
                                                        {"kivi:k4v4:g32", 0.12},
                                                        {"kivi:k3v3:g32", 0.25},
                                                        {"kivi:k2v2:g32", 0.55},
                                                        {"kcvt:k4v4", 0.35},
                                                        {"kcvt:k2v2", 1.6},
                                                        {"gearl:k2v2:g32:r4", 0.55},
                                                        {"gear:k2v2:g32:r4:s2", 0.5},
                                                        {"gear:k4v4:kcvt:r4:s2", 0.15},
                                                        {"gear:k3v3:g64:r2:s1", 0.3},
                                                        {"zipcache:k2v2:h4:s10", 1.6},
                                                        {"zipcache:k2v2:h8:s20:p10", 1.6},
                                                        {"kivi:k2v2:g32:sink4", 0.55},
                                                        {"int8:sink2", 3e-2},
                                                        {"tada:k2v2:g32", 0.6},
                                                        {"tada:k4v4:kcvt:sink4", 0.4},
                                                        {"kivi:k2v2:g32:m8", 0.6},
                                                        {"kcvt:k4v4:m8", 0.35},
                                                        {"gear:k2v2:g32:r4:s2:m8:sink2", 0.5}};
  return kBounds.at(spec);
}

// A GEAR spec that asks for outliers gets at least one per side of every vector: s1 on a 64-wide
// head (0.32 per side) and on a 64-token chunk's channels used to round to none.
TEST(CodecLayoutTest, GearKeepsAtLeastOneOutlierPerSide) {
  absl::StatusOr<CodecSpec> s = CodecSpec::Parse("gear:k2v2:g32:r2:s1");
  ASSERT_TRUE(s.ok()) << s.status();
  const CodecLayout small = MakeCodecLayout(*s, 64, 2, 64);
  EXPECT_EQ(small.k.outliers, 2u);  // per channel over 64 tokens
  EXPECT_EQ(small.v.outliers, 2u);  // per token over 64 channels
  const CodecLayout large = MakeCodecLayout(*s, 1024, 2, 128);
  EXPECT_EQ(large.k.outliers, 10u);  // 1024 * 1 % / 2 = 5.12 per side
  EXPECT_EQ(large.v.outliers, 2u);   // 0.64 per side: rounded up to one
  // And the block carries them: encoded, every V vector's two outliers are there.
  auto codec = Codec::Create("gear:k2v2:g32:r2:s1");
  ASSERT_TRUE(codec.ok());
  const SyntheticKv kv = MakeSyntheticKv(64, 2, 64, 3);
  absl::StatusOr<AlignedBuffer> b =
      (*codec)->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, 64, 2, 64}, {});
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<PreparedBlock> p = PrepareBlock(*BlockView::Parse(b->span()));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->parts[0].v.outliers_per_vector, 2u);
  EXPECT_EQ(p->parts[0].k.outliers_per_vector, 2u);
}

TEST(CodecTest, EveryCodecRoundTripsWithinItsErrorBoundAtEveryShape) {
  struct Shape {
    uint32_t t, h, d;
  } shapes[] = {{1, 1, 64}, {7, 2, 64}, {37, 2, 128}, {256, 4, 128}, {33, 1, 8}};
  for (const Shape& sh : shapes) {
    const SyntheticKv kv = MakeSyntheticKv(sh.t, sh.h, sh.d, /*seed=*/sh.t * 31 + sh.d);
    for (const char* spec : kAllCodecs) {
      const RoundTrip r = EncodeDecode(spec, kv);
      const double bound = sh.t < 4 && std::string(spec).find("kcvt") != std::string::npos
                               ? 2 * Bound(spec)
                               : Bound(spec);
      EXPECT_LT(r.k_error, bound) << spec << " T=" << sh.t << " D=" << sh.d;
      EXPECT_LT(r.v_error, bound) << spec << " T=" << sh.t << " D=" << sh.d;
    }
  }
}

TEST(CodecTest, MoreBitsMeanLessErrorAndGearBeatsKivi) {
  const SyntheticKv kv = MakeSyntheticKv(256, 2, 128, 99);
  const RoundTrip k8 = EncodeDecode("kivi:k8v8:g32", kv), k4 = EncodeDecode("kivi:k4v4:g32", kv),
                  k3 = EncodeDecode("kivi:k3v3:g32", kv), k2 = EncodeDecode("kivi:k2v2:g32", kv);
  EXPECT_LT(k8.k_error, k4.k_error);
  EXPECT_LT(k4.k_error, k3.k_error);
  EXPECT_LT(k3.k_error, k2.k_error);
  EXPECT_NEAR(k8.bits, 9.0, 0.1);  // 8 bits + fp16 scale and zero per 32
  EXPECT_GT(k2.bits, 2.0);         // metadata is counted
  const RoundTrip gearl = EncodeDecode("gearl:k2v2:g32:r4", kv);
  const RoundTrip gear = EncodeDecode("gear:k2v2:g32:r4:s2", kv);
  EXPECT_LT(gearl.k_error, k2.k_error);
  EXPECT_LT(gear.k_error, gearl.k_error);
  EXPECT_LT(gear.v_error, k2.v_error);
  EXPECT_GT(gear.bits, gearl.bits);
  EXPECT_GT(gearl.bits, k2.bits);
}

TEST(CodecTest, HalfAndBFloat16InputsAreAccepted) {
  const SyntheticKv kv = MakeSyntheticKv(16, 2, 64, 5);
  std::vector<Half> k16(kv.k.size()), v16(kv.v.size());
  std::vector<BFloat16> kb(kv.k.size()), vb(kv.v.size());
  FloatToHalf(kv.k.data(), k16.data(), k16.size());
  FloatToHalf(kv.v.data(), v16.data(), v16.size());
  FloatToBFloat16(kv.k.data(), kb.data(), kb.size());
  FloatToBFloat16(kv.v.data(), vb.data(), vb.size());
  auto codec = *Codec::Create("fp16");
  absl::StatusOr<AlignedBuffer> b =
      codec->Encode({k16.data(), v16.data(), SourceDType::kFloat16, 16, 2, 64}, {});
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<float> k(kv.k.size()), v(kv.v.size());
  ASSERT_TRUE(DecodeBlockRef(*BlockView::Parse(b->span()), k.data(), v.data()).ok());
  for (size_t i = 0; i < k.size(); ++i) ASSERT_EQ(k[i], k16[i].ToFloat());  // fp16 is exact
  EXPECT_EQ(BlockView::Parse(b->span())->header().source_dtype, SourceDType::kFloat16);
  auto gear = *Codec::Create("gear:k2v2:g32:r4:s2");
  EXPECT_TRUE(gear->Encode({kb.data(), vb.data(), SourceDType::kBFloat16, 16, 2, 64}, {}).ok());
}

TEST(CodecTest, ConstantChannelsAndTokensFewerThanTheGroupAreExact) {
  SyntheticKv kv = MakeSyntheticKv(5, 1, 16, 1);
  for (float& x : kv.k) x = 1.25f;
  for (float& x : kv.v) x = -3.5f;
  for (const char* spec :
       {"kivi:k2v2:g32", "kcvt:k2v2", "gear:k2v2:g32:r4:s2", "gearl:k3v3:kcvt:r2"}) {
    auto codec = *Codec::Create(spec);
    absl::StatusOr<AlignedBuffer> b = codec->Encode(View(kv), {});
    ASSERT_TRUE(b.ok()) << spec << b.status();
    std::vector<float> k(kv.k.size()), v(kv.v.size());
    ASSERT_TRUE(DecodeBlockRef(*BlockView::Parse(b->span()), k.data(), v.data()).ok());
    for (size_t i = 0; i < k.size(); ++i) {
      ASSERT_NEAR(k[i], 1.25f, 1e-6) << spec;
      ASSERT_NEAR(v[i], -3.5f, 1e-6) << spec;
    }
  }
}

TEST(CodecTest, GearOutliersAreCorrectedAlmostExactly) {
  // Spikes far outside each vector's range: GEAR extracts them (top/bottom s/2 % per vector) and
  // its sparse part restores them to fp16 precision, where KIVI smears them over their group.
  SyntheticKv kv = MakeSyntheticKv(64, 2, 64, 12);
  const std::vector<size_t> spikes = {5 * 128 + 3, 17 * 128 + 70, 40 * 128 + 127, 63 * 128 + 64};
  for (size_t p : spikes) {
    kv.k[p] = 400.0f;
    kv.v[p] = -300.0f;
  }
  auto decode = [&](const char* spec, std::vector<float>& k, std::vector<float>& v) {
    AlignedBuffer b = *(*Codec::Create(spec))->Encode(View(kv), {});
    k.resize(kv.k.size());
    v.resize(kv.v.size());
    ASSERT_TRUE(DecodeBlockRef(*BlockView::Parse(b.span()), k.data(), v.data()).ok());
  };
  std::vector<float> gk, gv, kk, kv_;
  decode("gear:k2v2:g32:r2:s4", gk, gv);
  decode("kivi:k2v2:g32", kk, kv_);
  for (size_t p : spikes) {
    EXPECT_NEAR(gk[p], 400.0f, 0.5f) << p;
    EXPECT_NEAR(gv[p], -300.0f, 0.5f) << p;
  }
  // Elsewhere in the spiked groups, GEAR's error is far below KIVI's.
  double gear_err = 0, kivi_err = 0;
  for (size_t p : spikes) {
    for (size_t q = p - p % 32; q < p - p % 32 + 32; ++q) {
      if (q == p) continue;
      gear_err += std::fabs(gv[q] - kv.v[q]);
      kivi_err += std::fabs(kv_[q] - kv.v[q]);
    }
  }
  EXPECT_LT(gear_err, 0.2 * kivi_err);
}

TEST(CodecTest, EncodingIsDeterministic) {
  const SyntheticKv kv = MakeSyntheticKv(64, 2, 64, 3);
  auto codec = *Codec::Create("gear:k2v2:g32:r4:s2");
  const AlignedBuffer a = *codec->Encode(View(kv), {}), b = *codec->Encode(View(kv), {});
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0);
}

// Encoding into the caller's memory (a transport's registered buffer) gives Encode's bytes, for
// every codec; the allocator is asked once, for the exact size; short or unaligned memory and the
// allocator's own error are refused.
TEST(CodecTest, EncodeIntoCallerMemoryEqualsEncode) {
  const SyntheticKv kv = MakeSyntheticKv(64, 2, 64, 11);
  AlignedBuffer arena(1 << 20);
  for (const char* spec : kAllCodecs) {
    auto codec = *Codec::Create(spec);
    const AlignedBuffer want = *codec->Encode(View(kv), {.layer = 1, .chunk_index = 2});
    std::memset(arena.data(), 0xAB, arena.size());  // what was there before: overwritten
    int asked = 0;
    absl::StatusOr<size_t> n = codec->EncodeInto(
        View(kv), {.layer = 1, .chunk_index = 2},
        [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
          ++asked;
          EXPECT_EQ(bytes, want.size()) << spec;
          return arena.span().subspan(128, bytes + 64);  // more than asked, aligned
        });
    ASSERT_TRUE(n.ok()) << spec << ": " << n.status();
    EXPECT_EQ(asked, 1) << spec;
    ASSERT_EQ(*n, want.size()) << spec;
    EXPECT_EQ(std::memcmp(arena.data() + 128, want.data(), want.size()), 0) << spec;
    EXPECT_EQ(arena.data()[128 + want.size()], 0xAB) << spec << ": wrote past the block";
  }
  auto codec = *Codec::Create("kivi:k2v2:g32");
  const size_t size = codec->Encode(View(kv), {})->size();
  EXPECT_EQ(codec->EncodeInto(View(kv), {}, [&](size_t) -> absl::StatusOr<absl::Span<uint8_t>> {
                               return arena.span().subspan(0, size - 1);
                             }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(codec->EncodeInto(View(kv), {}, [&](size_t n) -> absl::StatusOr<absl::Span<uint8_t>> {
                               return arena.span().subspan(8, n);
                             }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(codec->EncodeInto(View(kv), {}, [](size_t) -> absl::StatusOr<absl::Span<uint8_t>> {
                               return absl::ResourceExhaustedError("ring full");
                             }).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(CodecTest, BadInputIsRejectedWithItsPosition) {
  SyntheticKv kv = MakeSyntheticKv(8, 2, 64, 4);
  kv.v[(3 * 2 + 1) * 64 + 5] = std::numeric_limits<float>::quiet_NaN();
  auto codec = *Codec::Create("kivi:k2v2:g32");
  absl::Status s = codec->Encode(View(kv), {}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("V[token 3, head 1, channel 5]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("not finite"));
  kv = MakeSyntheticKv(8, 2, 64, 4);
  kv.k[0] = 1e6f;
  EXPECT_THAT(std::string(codec->Encode(View(kv), {}).status().message()),
              HasSubstr("exceeds this codec's range"));
  // SKVQ from fp16 (its rows are widened, checked and reordered in one pass, eight tokens at a
  // time): a bad value is still named in the input's token, head and channel order.
  for (const uint32_t tok : {2u, 9u, 17u}) {  // in a full eight, the next, the tail
    SyntheticKv skv = MakeSyntheticKv(19, 2, 64, 4);
    std::vector<Half> k16(skv.k.size()), v16(skv.v.size());
    FloatToHalf(skv.k.data(), k16.data(), k16.size());
    FloatToHalf(skv.v.data(), v16.data(), v16.size());
    k16[(tok * 2 + 1) * 64 + 37] = Half::FromFloat(std::numeric_limits<float>::infinity());
    const KvChunkView view16{k16.data(), v16.data(), SourceDType::kFloat16, 19, 2, 64};
    auto skvq = *Codec::Create(
        "skvq:k2v2:g32", MakeSyntheticCalibration(*CodecSpec::Parse("skvq:k2v2:g32"), 2, 64, 64));
    const absl::Status bad = skvq->Encode(view16, {}).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad.message()),
                HasSubstr(absl::StrCat("K[token ", tok, ", head 1, channel 37] = inf")));
  }
  EXPECT_TRUE((*Codec::Create("fp8e4m3"))->Encode(View(kv), {}).ok());  // fp32 scale: fine
  const SyntheticKv odd = MakeSyntheticKv(8, 1, 12, 4);
  EXPECT_THAT(std::string(codec->Encode(View(odd), {}).status().message()),
              HasSubstr("not a multiple of 8"));
  EXPECT_TRUE((*Codec::Create("fp16"))->Encode(View(odd), {}).ok());
  EXPECT_EQ(Codec::Create("nope").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockOperandsTest, InconsistentBlocksAreDataLoss) {
  const SyntheticKv kv = MakeSyntheticKv(16, 1, 64, 8);
  AlignedBuffer block = *(*Codec::Create("gear:k2v2:g32:r4:s2"))->Encode(View(kv), {});
  const BlockView view = *BlockView::Parse(block.span());
  // An outlier index past the chunk, resealed so only the codec-level check can catch it.
  const SectionView* idx = view.Find(SectionKind::kOutlierIndices, Tensor::kValue);
  ASSERT_NE(idx, nullptr);
  std::vector<uint8_t> bad(block.data(), block.data() + block.size());
  bad[idx->entry.offset] = 200;
  SealBlock(absl::MakeSpan(bad));
  absl::StatusOr<BlockView> bad_view = BlockView::Parse(bad);
  ASSERT_TRUE(bad_view.ok());
  absl::Status s = PrepareBlock(*bad_view).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("V outlier 0 has index 200, beyond 64"));
  // A block whose sections do not match its spec: a KIVI block relabelled as GEAR-L.
  AlignedBuffer kivi = *(*Codec::Create("kivi:k2v2:g32"))->Encode(View(kv), {});
  const BlockView kivi_view = *BlockView::Parse(kivi.span());
  BlockHeader h = kivi_view.header();
  h.codec = CodecId::kGearL;
  h.codec_spec = "gearl:k2v2:g32:r4";
  std::vector<SectionDesc> descs;
  for (const SectionView& sv : kivi_view.sections()) {
    descs.push_back(
        {sv.entry.kind, sv.entry.tensor, sv.entry.elem, sv.entry.count, sv.entry.alignment});
  }
  AlignedBuffer relabelled = std::move(*BlockBuilder::Create(h, descs)).Finish();
  s = PrepareBlock(*BlockView::Parse(relabelled.span())).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("writes 10 sections, block has 6"));
}

// Sinks: the first N tokens of a sequence (chunk 0 only) come back exactly at fp16, in token
// order, with the rest quantized; later chunks have no sinks but keep the (all-main) token map.
TEST(CodecTest, SinksStayFullPrecisionInTheFirstChunkOnly) {
  const SyntheticKv kv = MakeSyntheticKv(64, 2, 64, /*seed=*/5);
  auto codec = *Codec::Create("kivi:k2v2:g32:sink4");
  for (uint32_t chunk : {0u, 1u}) {
    AlignedBuffer block = *codec->Encode(View(kv), {.chunk_index = chunk});
    const BlockView view = *BlockView::Parse(block.span());
    const PreparedBlock ops = *PrepareBlock(view);
    ASSERT_EQ(ops.parts.size(), chunk == 0 ? 2u : 1u);
    std::vector<float> k(kv.k.size()), v(kv.v.size());
    ASSERT_TRUE(DecodePreparedRef(ops, k.data(), v.data()).ok());
    const size_t row = 2 * 64;
    for (size_t i = 0; i < 4 * row; ++i) {
      const float want_k = HalfBitsToFloat(FloatToHalfBits(kv.k[i]));
      if (chunk == 0) {
        ASSERT_EQ(k[i], want_k) << i;
        ASSERT_EQ(v[i], HalfBitsToFloat(FloatToHalfBits(kv.v[i]))) << i;
      }
    }
    if (chunk == 1) {
      double diff = 0;
      for (size_t i = 0; i < 4 * row; ++i) diff += std::fabs(k[i] - kv.k[i]);
      EXPECT_GT(diff, 0) << "chunk 1 must quantize its first tokens too";
    }
    // The quantized tokens are still within KIVI-2's bound.
    EXPECT_LT(RelativeError(kv.k, k), 0.55);
    EXPECT_EQ(ops.part_tokens.back().size(), chunk == 0 ? 60u : 64u);
  }
}

// ZipCache with probe queries keeps the tokens the probes attend to at high bits: plant a few
// keys every query matches strongly, and those must be the salient (4-bit) part.
TEST(CodecTest, ZipCacheKeepsTheTokensProbeQueriesAttendToAtHighBits) {
  const uint32_t T = 128, H = 2, D = 64, QH = 4;
  SyntheticKv kv = MakeSyntheticKv(T, H, D, /*seed=*/11);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> dir(D);
  for (float& x : dir) x = normal(rng);
  const uint32_t hot[] = {3, 40, 77, 90, 101};
  for (float& x : kv.k) x = 0.2f * normal(rng);  // plain keys; the hot ones stand out
  for (uint32_t t : hot) {
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t d = 0; d < D; ++d) kv.k[(size_t{t} * H + h) * D + d] = 0.5f * dir[d];
    }
  }
  std::vector<float> q(size_t{T} * QH * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 2.0f * dir[i % D] + 0.1f * normal(rng);
  KvChunkView view = View(kv);
  view.q = q.data();
  view.q_heads = QH;
  auto codec = *Codec::Create("zipcache:k2v2:h4:s5:p10");  // 5 % of 128 = 6 salient tokens
  AlignedBuffer block = *codec->Encode(view, {.layer = 1, .chunk_index = 3});
  const PreparedBlock ops = *PrepareBlock(*BlockView::Parse(block.span()));
  ASSERT_EQ(ops.parts.size(), 2u);
  EXPECT_EQ(ops.parts[0].k.bits, 4);
  EXPECT_EQ(ops.parts[1].k.bits, 2);
  ASSERT_EQ(ops.part_tokens[0].size(), 6u);
  for (uint32_t t : hot) {
    EXPECT_THAT(ops.part_tokens[0], testing::Contains(t)) << "token " << t << " not salient";
  }
  // Same chunk without queries: still a valid block of the same size (data-only fallback).
  AlignedBuffer fallback = *codec->Encode(View(kv), {.layer = 1, .chunk_index = 3});
  EXPECT_EQ(fallback.size(), block.size());
  // Queries whose head count does not divide into the KV heads are refused.
  view.q_heads = 3;
  EXPECT_EQ(codec->Encode(view, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

Calibration MakeSkvqCalibration(const SyntheticKv& kv, bool reorder, float k_clip, float v_clip) {
  Calibration c;
  c.codec = "skvq:k2v2:g16";
  c.kv_heads = kv.kv_heads;
  c.head_dim = kv.head_dim;
  LayerCalibration l;
  if (reorder) {
    for (uint32_t h = 0; h < kv.kv_heads; ++h) {
      for (const auto& [x, perm] : {std::pair{&kv.k, &l.k_perm}, std::pair{&kv.v, &l.v_perm}}) {
        const std::vector<uint16_t> p =
            ChannelOrderByRange(x->data(), kv.tokens, kv.kv_heads, kv.head_dim, h);
        perm->insert(perm->end(), p.begin(), p.end());
      }
    }
  }
  l.k_clip = k_clip;
  l.v_clip = v_clip;
  c.layers = {l, l};
  return c;
}

// SKVQ: the calibration is required to encode and to read; reordering channels by range puts
// the outlier channels in groups of their own and cuts the error of per-token groups.
TEST(CodecTest, SkvqNeedsItsCalibrationAndReorderingHelps) {
  const SyntheticKv kv = MakeSyntheticKv(128, 2, 64, /*seed=*/21);
  EXPECT_EQ(Codec::Create("skvq:k2v2:g16").status().code(), absl::StatusCode::kFailedPrecondition);
  auto other = std::make_shared<Calibration>(MakeSkvqCalibration(kv, true, 1, 1));
  other->codec = "skvq:k4v4:g16";
  EXPECT_EQ(Codec::Create("skvq:k2v2:g16", other).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto error = [&](bool reorder) {
    auto cal = std::make_shared<Calibration>(MakeSkvqCalibration(kv, reorder, 1, 1));
    auto codec = *Codec::Create("skvq:k2v2:g16", cal);
    AlignedBuffer block = *codec->Encode(View(kv), {.layer = 1});
    const BlockView view = *BlockView::Parse(block.span());
    EXPECT_EQ(view.header().calibration_fingerprint, cal->fingerprint());
    // Without the calibration, or with another one, the block is refused.
    absl::Status s = PrepareBlock(view).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), HasSubstr("loaded: none"));
    Calibration changed = *cal;
    changed.layers[1].k_clip = 0.5f;
    EXPECT_EQ(PrepareBlock(view, &changed).status().code(), absl::StatusCode::kFailedPrecondition);
    std::vector<float> k(kv.k.size()), v(kv.v.size());
    EXPECT_TRUE(DecodeBlockRef(view, k.data(), v.data(), cal.get()).ok());
    // K's error channel by channel (relative to each channel's own size), averaged: what a
    // query that weighs the ordinary channels sees. (V here has no channel structure.)
    const uint32_t rows = kv.tokens * kv.kv_heads, D = kv.head_dim;
    double sum = 0;
    for (uint32_t d = 0; d < D; ++d) {
      double num = 0, den = 0;
      for (uint32_t r = 0; r < rows; ++r) {
        num += std::pow(double{kv.k[r * D + d]} - k[r * D + d], 2);
        den += std::pow(double{kv.k[r * D + d]}, 2);
      }
      sum += std::sqrt(num / den);
    }
    EXPECT_LT(RelativeError(kv.v, v), 0.6);
    return sum / D;
  };
  const double plain = error(false), reordered = error(true);
  EXPECT_LT(reordered, 0.93 * plain) << "plain " << plain << " reordered " << reordered;
}

TEST(CalibrationTest, RoundTripsAndRejectsBadFiles) {
  const SyntheticKv kv = MakeSyntheticKv(32, 2, 16, /*seed=*/3);
  Calibration c = MakeSkvqCalibration(kv, true, 0.9f, 0.85f);
  c.model_fingerprint = 0x0123456789abcdefull;
  c.source = "test";
  const absl::StatusOr<Calibration> back = Calibration::Parse(c.Serialize());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, c);
  EXPECT_EQ(back->fingerprint(), c.fingerprint());
  Calibration d = c;
  d.layers[0].v_clip = 0.8f;
  EXPECT_NE(d.fingerprint(), c.fingerprint());
  struct Case {
    std::string json, message;
  } cases[] = {
      {"[]", "not a JSON object"},
      {"{\"version\": 9}", "version 9"},
      {"{\"version\": 1}", "malformed field"},
  };
  for (const Case& k : cases) {
    absl::Status s = Calibration::Parse(k.json).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.json;
    EXPECT_THAT(std::string(s.message()), HasSubstr(k.message)) << k.json;
  }
  Calibration bad = c;
  bad.layers[1].k_perm[3] = bad.layers[1].k_perm[4];  // not a permutation
  absl::Status s = Calibration::Parse(bad.Serialize()).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("layer 1 k_perm head 0 is not a permutation"));
  bad = c;
  bad.layers[0].v_clip = 1.5f;
  s = Calibration::Parse(bad.Serialize()).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("layer 0 v_clip 1.5 is not in (0, 1]"));
  bad = c;
  bad.layers[0].v_perm.pop_back();
  s = Calibration::Parse(bad.Serialize()).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("entries, not kv_heads x head_dim"));
  EXPECT_EQ(Calibration::Load("/nonexistent.json").status().code(), absl::StatusCode::kNotFound);
}

// fp8 metadata cuts the scale/zero cost at little extra error, at any magnitude (the
// multipliers carry the range).
TEST(CodecTest, Fp8MetadataIsSmallerAtAnyMagnitude) {
  SyntheticKv kv = MakeSyntheticKv(256, 2, 64, /*seed=*/8);
  for (float scale : {1.0f, 30.0f, 1e-3f}) {
    SyntheticKv scaled = kv;
    for (float& x : scaled.k) x *= scale;
    for (float& x : scaled.v) x *= scale;
    const RoundTrip f16 = EncodeDecode("kcvt:k2v2", scaled);
    const RoundTrip f8 = EncodeDecode("kcvt:k2v2:m8", scaled);
    EXPECT_LT(f8.bits, f16.bits - 0.1);
    EXPECT_LT(f8.v_error, 1.25 * f16.v_error) << scale;
    EXPECT_LT(f8.k_error, 1.25 * f16.k_error) << scale;
  }
}

// A token map naming a part the codec does not have is data loss, not a crash.
TEST(BlockOperandsTest, TokenMapOutOfRangeIsDataLoss) {
  const SyntheticKv kv = MakeSyntheticKv(32, 1, 64, /*seed=*/2);
  AlignedBuffer block = *(*Codec::Create("kivi:k4v4:g32:sink4"))->Encode(View(kv), {});
  const BlockView view = *BlockView::Parse(block.span());
  const SectionView* map = view.Find(SectionKind::kTokenBits, Tensor::kShared);
  ASSERT_NE(map, nullptr);
  std::vector<uint8_t> bad(block.data(), block.data() + block.size());
  bad[map->entry.offset + 7] = 9;
  SealBlock(absl::MakeSpan(bad));
  absl::Status s = PrepareBlock(*BlockView::Parse(bad)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token 7 is in part 9"));
  // Moving a token between parts changes the parts' sizes: the sections no longer match.
  bad[map->entry.offset + 7] = 0;
  SealBlock(absl::MakeSpan(bad));
  s = PrepareBlock(*BlockView::Parse(bad)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("but codec kivi:k4v4:g32:sink4 writes"));
}

}  // namespace
}  // namespace strata::kernels

namespace strata::kernels {
namespace {

TEST(BitPackTest, EveryWidthRoundTripsAtEveryLength) {
  std::mt19937 rng(3);
  for (int bits = 1; bits <= 8; ++bits) {
    for (size_t n : {0, 1, 7, 8, 9, 31, 64, 1000}) {
      std::vector<uint8_t> codes(n);
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
      std::vector<uint8_t> packed(PackedBytes(n, bits) + 1, 0xee);
      PackBits(codes.data(), n, bits, packed.data());
      EXPECT_EQ(packed.back(), 0xee) << "wrote past the end, bits=" << bits << " n=" << n;
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(UnpackBit(packed.data(), i, bits), codes[i]);
    }
  }
}

}  // namespace
}  // namespace strata::kernels
