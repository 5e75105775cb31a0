#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/block_format.h"
#include "common/block_reader.h"
#include "common/block_writer.h"
#include "common/crc32c.h"
#include "common/endian.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using testing::HasSubstr;

constexpr uint32_t kT = 37, kH = 2, kD = 64, kRank = 3;

BlockHeader SampleHeader() {
  BlockHeader h;
  h.codec = CodecId::kGear;
  h.codec_spec = "gear:k2v2:g32:r3:s2";
  h.source_dtype = SourceDType::kBFloat16;
  h.layer = 5;
  h.chunk_index = 9;
  h.token_count = kT;
  h.kv_heads = kH;
  h.head_dim = kD;
  h.model_fingerprint = 0x1122334455667788ull;
  h.calibration_fingerprint = 0;
  return h;
}

// A GEAR-shaped block: codes, scales, zero points, low-rank factors and outliers for K and V.
std::vector<SectionDesc> SampleSections() {
  const uint32_t n = kT * kH * kD;
  std::vector<SectionDesc> s;
  for (Tensor t : {Tensor::kKey, Tensor::kValue}) {
    s.push_back({SectionKind::kCodes, t, ElemType::kUInt2, n, 64});
    s.push_back({SectionKind::kScales, t, ElemType::kFloat16, kH * kD * 2});
    s.push_back({SectionKind::kZeroPoints, t, ElemType::kFloat16, kH * kD * 2});
    s.push_back({SectionKind::kLowRankA, t, ElemType::kFloat16, kH * kT * kRank});
    s.push_back({SectionKind::kLowRankB, t, ElemType::kFloat16, kH * kD * kRank});
    s.push_back({SectionKind::kOutlierValues, t, ElemType::kFloat16, 11});
    s.push_back({SectionKind::kOutlierIndices, t, ElemType::kUInt16, 11});
  }
  return s;
}

AlignedBuffer MakeSampleBlock(uint32_t seed = 1) {
  absl::StatusOr<BlockBuilder> b = BlockBuilder::Create(SampleHeader(), SampleSections());
  EXPECT_TRUE(b.ok()) << b.status();
  std::mt19937 rng(seed);
  for (int i = 0; i < b->layout().section_count(); ++i) {
    for (uint8_t& x : b->section(i)) x = static_cast<uint8_t>(rng());
  }
  return std::move(*b).Finish();
}

std::vector<uint8_t> Bytes(const AlignedBuffer& b) {
  return std::vector<uint8_t>(b.data(), b.data() + b.size());
}

void Reseal(std::vector<uint8_t>& b) { SealBlock(absl::MakeSpan(b)); }

// Byte offset of field `field_offset` of section entry i.
size_t EntryAt(int i, size_t field_offset) { return 64 + 16 * i + field_offset; }

absl::Status ParseStatus(const std::vector<uint8_t>& b, bool verify = true) {
  return BlockView::Parse(b, ParseOptions{verify}).status();
}

TEST(BlockFormatTest, RoundTripKeepsHeaderAndSectionBytes) {
  absl::StatusOr<BlockBuilder> b = BlockBuilder::Create(SampleHeader(), SampleSections());
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::vector<uint8_t>> want;
  std::mt19937 rng(3);
  for (int i = 0; i < b->layout().section_count(); ++i) {
    for (uint8_t& x : b->section(i)) x = static_cast<uint8_t>(rng());
    want.emplace_back(b->section(i).begin(), b->section(i).end());
  }
  const AlignedBuffer block = std::move(*b).Finish();
  ASSERT_EQ(reinterpret_cast<uintptr_t>(block.data()) % 64, 0u);

  absl::StatusOr<BlockView> v = BlockView::Parse(block.span());
  ASSERT_TRUE(v.ok()) << v.status();
  const BlockHeader& h = v->header();
  EXPECT_EQ(h.codec, CodecId::kGear);
  EXPECT_EQ(h.codec_spec, "gear:k2v2:g32:r3:s2");
  EXPECT_EQ(h.codec_fingerprint, Fingerprint64("gear:k2v2:g32:r3:s2"));
  EXPECT_EQ(h.source_dtype, SourceDType::kBFloat16);
  EXPECT_EQ(h.layer, 5u);
  EXPECT_EQ(h.chunk_index, 9u);
  EXPECT_EQ(h.token_count, kT);
  EXPECT_EQ(h.kv_heads, kH);
  EXPECT_EQ(h.head_dim, kD);
  EXPECT_EQ(h.model_fingerprint, 0x1122334455667788ull);
  ASSERT_EQ(v->section_count(), static_cast<int>(want.size()));
  for (int i = 0; i < v->section_count(); ++i) {
    const SectionView& s = v->section(i);
    EXPECT_EQ(s.entry.offset % s.entry.alignment, 0u) << i;
    EXPECT_GE(s.entry.alignment, 16u);
    EXPECT_EQ(std::vector<uint8_t>(s.data.begin(), s.data.end()), want[i]) << i;
  }
  EXPECT_EQ(v->section(0).entry.alignment, 64u);
  EXPECT_EQ(v->section(0).data.size(), kT * kH * kD * 2 / 8);
  const SectionView* vb = v->Find(SectionKind::kLowRankB, Tensor::kValue);
  ASSERT_NE(vb, nullptr);
  EXPECT_EQ(vb->entry.count, kH * kD * kRank);
  EXPECT_EQ(v->Find(SectionKind::kHeadMean, Tensor::kKey), nullptr);
  EXPECT_EQ(v->Find(SectionKind::kCodes, Tensor::kKey, 1), nullptr);
  EXPECT_DOUBLE_EQ(v->bits_per_element(), block.size() * 8.0 / (2.0 * kT * kH * kD));
  EXPECT_EQ(v->checksum(), Crc32c(block.data() + 8, block.size() - 8));
}

TEST(BlockFormatTest, EqualContentsGiveEqualBytes) {
  EXPECT_EQ(Bytes(MakeSampleBlock(7)), Bytes(MakeSampleBlock(7)));
  EXPECT_NE(Bytes(MakeSampleBlock(7)), Bytes(MakeSampleBlock(8)));
}

TEST(BlockFormatTest, FullPrecisionTokensAndSharedMetadataAreAccepted) {
  BlockHeader h = SampleHeader();
  h.codec = CodecId::kZipCache;
  h.codec_spec = "zipcache:k4v2:sal0.1";
  const uint32_t hd = kH * kD;
  std::vector<SectionDesc> s = {
      {SectionKind::kCodes, Tensor::kKey, ElemType::kUInt3, (kT - 2) * hd},
      {SectionKind::kFullPrecisionValues, Tensor::kKey, ElemType::kFloat16, 2 * hd},
      {SectionKind::kFullPrecisionTokens, Tensor::kKey, ElemType::kUInt16, 2},
      {SectionKind::kCodes, Tensor::kValue, ElemType::kFloat16, kT * hd},
      {SectionKind::kTokenBits, Tensor::kShared, ElemType::kUInt8, kT},
  };
  absl::StatusOr<BlockBuilder> b = BlockBuilder::Create(h, s);
  ASSERT_TRUE(b.ok()) << b.status();
  const AlignedBuffer block = std::move(*b).Finish();
  absl::StatusOr<BlockView> v = BlockView::Parse(block.span());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->section(0).data.size(), ((kT - 2) * hd * 3 + 7) / 8);  // 3-bit packing rounds up
}

// Codes of coupled channels (CQ) stand for 2, 4 or 8 elements each: a K of one code per 4
// channels and a V of one per 8 cover the block; one code short does not.
TEST(BlockFormatTest, CodesOfCoupledChannelsCoverSeveralElementsEach) {
  BlockHeader h = SampleHeader();
  h.codec = CodecId::kCq;
  h.codec_spec = "cq:c4:b6";
  const uint32_t hd = kH * kD;
  std::vector<SectionDesc> s = {
      {SectionKind::kCodesPer4, Tensor::kKey, ElemType::kUInt6, kT * hd / 4},
      {SectionKind::kCodesPer8, Tensor::kValue, ElemType::kUInt8, kT * hd / 8},
  };
  absl::StatusOr<BlockLayout> ok = BlockLayout::Plan(h, s);
  ASSERT_TRUE(ok.ok()) << ok.status();
  s[1].count -= 1;
  absl::StatusOr<BlockLayout> short_v = BlockLayout::Plan(h, s);
  EXPECT_EQ(short_v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_v.status().message()), HasSubstr("V: codes"));
  EXPECT_EQ(ElementsPerCode(SectionKind::kCodesPer2), 2u);
  EXPECT_EQ(ElementsPerCode(SectionKind::kScales), 0u);
}

TEST(BlockWriterTest, RejectsImpossibleDescriptionsWithInvalidArgument) {
  struct Case {
    const char* why;
    std::function<void(BlockHeader&, std::vector<SectionDesc>&)> mutate;
    const char* message;
  };
  const Case cases[] = {
      {"codes short", [](auto&, auto& s) { s[0].count -= 1; }, "K: codes"},
      {"bad alignment", [](auto&, auto& s) { s[1].alignment = 24; }, "alignment 24"},
      {"small alignment", [](auto&, auto& s) { s[1].alignment = 8; }, "alignment 8"},
      {"zero heads", [](auto& h, auto&) { h.kv_heads = 0; }, "kv heads 0"},
      {"huge dim", [](auto& h, auto&) { h.head_dim = 4096; }, "head dim 4096"},
      {"no tokens", [](auto& h, auto&) { h.token_count = 0; }, "token count 0"},
      {"empty spec", [](auto& h, auto&) { h.codec_spec = ""; }, "codec spec length 0"},
      {"spec space", [](auto& h, auto&) { h.codec_spec = "gear k2"; }, "not printable"},
      {"unknown codec", [](auto& h, auto&) { h.codec = static_cast<CodecId>(99); },
       "unknown codec id 99"},
      {"outliers unpaired", [](auto&, auto& s) { s[5].count = 12; }, "outlier values"},
      {"rank mismatch", [](auto&, auto& s) { s[4].count = kH * kD * 2; }, "low-rank"},
      {"shared codes", [](auto&, auto& s) { s[0].tensor = Tensor::kShared; }, "not shared"},
      {"float indices", [](auto&, auto& s) { s[6].elem = ElemType::kFloat16; }, "index sections"},
      {"no sections", [](auto&, auto& s) { s.clear(); }, "0 sections"},
  };
  for (const Case& c : cases) {
    BlockHeader h = SampleHeader();
    std::vector<SectionDesc> s = SampleSections();
    c.mutate(h, s);
    absl::StatusOr<BlockLayout> l = BlockLayout::Plan(h, s);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << c.why;
    EXPECT_THAT(std::string(l.status().message()), HasSubstr(c.message)) << c.why;
  }
}

TEST(BlockReaderTest, EveryTruncationIsRejected) {
  const std::vector<uint8_t> full = Bytes(MakeSampleBlock());
  for (size_t n = 0; n < full.size(); ++n) {
    const std::vector<uint8_t> cut(full.begin(), full.begin() + n);
    const absl::Status s = ParseStatus(cut);
    if (n < 4) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n;
    } else {
      ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << n;
      EXPECT_THAT(std::string(s.message()), HasSubstr("truncated")) << n;
    }
    // Without the checksum the structural checks alone must still catch it.
    EXPECT_FALSE(ParseStatus(cut, /*verify=*/false).ok()) << n;
  }
}

TEST(BlockReaderTest, OversizedInputsAreRejected) {
  std::vector<uint8_t> b = Bytes(MakeSampleBlock());
  b.push_back(0);
  EXPECT_THAT(std::string(ParseStatus(b).message()), HasSubstr("1 trailing bytes"));
  b.pop_back();
  StoreLE<uint32_t>(b.data() + 12, 0xfffffff0u);  // total size far beyond the buffer
  EXPECT_EQ(ParseStatus(b).code(), absl::StatusCode::kDataLoss);
  std::vector<uint8_t> huge(kMaxBlockBytes / 1024, 0);  // a header claiming > 1 GiB sections
  std::memcpy(huge.data(), b.data(), 64);
  StoreLE<uint32_t>(huge.data() + 12, static_cast<uint32_t>(huge.size()));
  EXPECT_EQ(ParseStatus(huge).code(), absl::StatusCode::kDataLoss);
}

TEST(BlockReaderTest, EverySingleBitFlipIsDetected) {
  const std::vector<uint8_t> good = Bytes(MakeSampleBlock());
  for (size_t bit = 0; bit < good.size() * 8; ++bit) {
    std::vector<uint8_t> b = good;
    b[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    const absl::Status s = ParseStatus(b);
    ASSERT_FALSE(s.ok()) << "bit " << bit;
    if (bit < 32 || (bit >= 64 && bit < 80)) {
      // Magic and version flips say "not a block" / "unsupported version".
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "bit " << bit;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << "bit " << bit << ": " << s;
    }
    ParseStatus(b, /*verify=*/false).IgnoreError();  // must not crash or read out of bounds
  }
}

TEST(BlockReaderTest, ResealedTamperingIsCaughtByTheStructuralChecks) {
  const std::vector<uint8_t> good = Bytes(MakeSampleBlock());
  const uint32_t total = static_cast<uint32_t>(good.size());
  struct Case {
    const char* why;
    std::function<void(std::vector<uint8_t>&)> mutate;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"offset past end",
       [&](auto& b) { StoreLE<uint32_t>(&b[EntryAt(13, 4)], (total + 15) / 16 * 16); },
       absl::StatusCode::kDataLoss, "exceeds block size"},
      {"offset wraps", [&](auto& b) { StoreLE<uint32_t>(&b[EntryAt(13, 4)], 0xfffffff0u); },
       absl::StatusCode::kDataLoss, "exceeds block size"},
      {"misaligned",
       [&](auto& b) {
         StoreLE<uint32_t>(&b[EntryAt(2, 4)], LoadLE<uint32_t>(&b[EntryAt(2, 4)]) + 2);
       },
       absl::StatusCode::kDataLoss, "not a multiple of its alignment"},
      {"overlap", [&](auto& b) { std::memcpy(&b[EntryAt(2, 4)], &b[EntryAt(1, 4)], 4); },
       absl::StatusCode::kDataLoss, "packed in table order"},
      {"gap",
       [&](auto& b) {
         StoreLE<uint32_t>(&b[EntryAt(1, 4)], LoadLE<uint32_t>(&b[EntryAt(1, 4)]) + 16);
       },
       absl::StatusCode::kDataLoss, "packed in table order"},
      {"swapped",
       [&](auto& b) {
         uint8_t e0[16], e1[16];
         std::memcpy(e0, &b[EntryAt(5, 0)], 16);
         std::memcpy(e1, &b[EntryAt(6, 0)], 16);
         std::memcpy(&b[EntryAt(5, 0)], e1, 16);
         std::memcpy(&b[EntryAt(6, 0)], e0, 16);
       },
       absl::StatusCode::kDataLoss, "packed in table order"},
      {"padding", [&](auto& b) { b[LoadLE<uint32_t>(&b[EntryAt(0, 4)]) - 1] = 1; },
       absl::StatusCode::kDataLoss, "non-zero padding"},
      {"into header", [&](auto& b) { StoreLE<uint32_t>(&b[EntryAt(1, 4)], 64); },
       absl::StatusCode::kDataLoss, "inside the header"},
      {"length", [&](auto& b) { StoreLE<uint32_t>(&b[EntryAt(1, 8)], 16); },
       absl::StatusCode::kDataLoss, "length 16 but"},
      {"count vs shape",
       [&](auto& b) {
         StoreLE<uint32_t>(&b[EntryAt(0, 12)], kT * kH * kD - 4);
         StoreLE<uint32_t>(&b[EntryAt(0, 8)], (kT * kH * kD - 4) / 4);
       },
       absl::StatusCode::kDataLoss, "K: codes"},
      {"unknown kind", [&](auto& b) { b[EntryAt(3, 0)] = 200; }, absl::StatusCode::kDataLoss,
       "unknown kind 200"},
      {"unknown tensor", [&](auto& b) { b[EntryAt(3, 1)] = 7; }, absl::StatusCode::kDataLoss,
       "unknown tensor 7"},
      {"unknown elem", [&](auto& b) { b[EntryAt(3, 2)] = 99; }, absl::StatusCode::kDataLoss,
       "unknown element type 99"},
      {"alignment 2^31", [&](auto& b) { b[EntryAt(3, 3)] = 31; }, absl::StatusCode::kDataLoss,
       "alignment"},
      {"alignment 2^255", [&](auto& b) { b[EntryAt(3, 3)] = 255; }, absl::StatusCode::kDataLoss,
       "alignment"},
      {"version 2", [&](auto& b) { StoreLE<uint16_t>(&b[8], 2); },
       absl::StatusCode::kInvalidArgument, "format version 2"},
      {"header size", [&](auto& b) { StoreLE<uint16_t>(&b[10], 80); }, absl::StatusCode::kDataLoss,
       "header size 80"},
      {"flags", [&](auto& b) { StoreLE<uint16_t>(&b[22], 1); }, absl::StatusCode::kDataLoss,
       "unknown flags"},
      {"zero sections", [&](auto& b) { b[19] = 0; }, absl::StatusCode::kDataLoss,
       "section count 0"},
      {"too many sections", [&](auto& b) { b[19] = 200; }, absl::StatusCode::kDataLoss,
       "section count 200"},
      {"spec too long", [&](auto& b) { StoreLE<uint16_t>(&b[20], 60000); },
       absl::StatusCode::kDataLoss, "codec spec length 60000"},
      {"spec byte", [&](auto& b) { b[64 + 16 * 14] = 0x07; }, absl::StatusCode::kDataLoss,
       "not printable"},
      {"fingerprint", [&](auto& b) { b[40] ^= 1; }, absl::StatusCode::kDataLoss,
       "codec fingerprint"},
      {"codec", [&](auto& b) { StoreLE<uint16_t>(&b[16], 0); }, absl::StatusCode::kDataLoss,
       "unknown codec id 0"},
      {"dtype", [&](auto& b) { b[18] = 9; }, absl::StatusCode::kDataLoss, "unknown source dtype 9"},
      {"heads", [&](auto& b) { StoreLE<uint16_t>(&b[36], 0); }, absl::StatusCode::kDataLoss,
       "kv heads 0"},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> b = good;
    c.mutate(b);
    Reseal(b);
    const absl::Status s = ParseStatus(b);
    EXPECT_EQ(s.code(), c.code) << c.why << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.why;
    if (c.code == absl::StatusCode::kDataLoss && std::string(c.why) != "fingerprint") {
      EXPECT_FALSE(ParseStatus(b, /*verify=*/false).ok()) << c.why;
    }
  }
}

TEST(BlockReaderTest, TrailingSpaceInsideTheDeclaredSizeIsRejected) {
  std::vector<uint8_t> b = Bytes(MakeSampleBlock());
  b.resize(b.size() + 16, 0);
  StoreLE<uint32_t>(&b[12], static_cast<uint32_t>(b.size()));
  Reseal(b);
  EXPECT_THAT(std::string(ParseStatus(b).message()), HasSubstr("sections end at"));
}

TEST(BlockReaderTest, AnotherVersionIsNamedEvenWhenShort) {
  std::vector<uint8_t> b = Bytes(MakeSampleBlock());
  b.resize(12);
  StoreLE<uint16_t>(&b[8], 7);
  const absl::Status s = ParseStatus(b);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("format version 7"));
}

TEST(BlockReaderTest, NotABlockIsInvalidArgument) {
  EXPECT_EQ(ParseStatus({}).code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> junk(4096, 0xab);
  const absl::Status s = ParseStatus(junk);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not a Strata block"));
}

}  // namespace
}  // namespace strata
