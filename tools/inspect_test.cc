#include "tools/inspect.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/block_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/file_util.h"

namespace strata::tools {
namespace {

using testing::HasSubstr;

AlignedBuffer SmallBlock() {
  BlockHeader h;
  h.codec = CodecId::kKivi;
  h.codec_spec = "kivi:k2v2:g32";
  h.token_count = 32;
  h.kv_heads = 2;
  h.head_dim = 64;
  h.layer = 3;
  h.model_fingerprint = 0xabcdefull;
  const uint32_t n = 32 * 2 * 64;
  const SectionDesc s[] = {
      {SectionKind::kCodes, Tensor::kKey, ElemType::kUInt2, n},
      {SectionKind::kScales, Tensor::kKey, ElemType::kFloat16, 2 * 64},
      {SectionKind::kCodes, Tensor::kValue, ElemType::kUInt2, n},
      {SectionKind::kScales, Tensor::kValue, ElemType::kFloat16, 2 * 32 * 2},
  };
  absl::StatusOr<BlockBuilder> b = BlockBuilder::Create(h, s);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b).Finish();
}

TEST(InspectTest, PrintsHeaderAndSections) {
  const std::string path = absl::StrCat(testing::TempDir(), "/inspect_ok.blk");
  ASSERT_TRUE(WriteFileAtomic(path, SmallBlock().span()).ok());
  std::ostringstream out;
  ASSERT_TRUE(InspectBlockFile(path, out).ok());
  const std::string text = out.str();
  EXPECT_THAT(text, HasSubstr("verified"));
  EXPECT_THAT(text, HasSubstr("spec \"kivi:k2v2:g32\""));
  EXPECT_THAT(text, HasSubstr("layer 3"));
  EXPECT_THAT(text, HasSubstr("kv_heads 2  head_dim 64"));
  EXPECT_THAT(text, HasSubstr("sections  4"));
  EXPECT_THAT(text, HasSubstr("codes"));
  EXPECT_THAT(text, HasSubstr("u2"));
  EXPECT_THAT(text, HasSubstr("bits per element"));
}

TEST(InspectTest, CorruptFileIsReportedAndStillShown) {
  AlignedBuffer b = SmallBlock();
  b.data()[b.size() - 1] ^= 1;
  const std::string path = absl::StrCat(testing::TempDir(), "/inspect_bad.blk");
  ASSERT_TRUE(WriteFileAtomic(path, b.span()).ok());
  std::ostringstream out;
  const absl::Status s = InspectBlockFile(path, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("checksum mismatch"));
  EXPECT_THAT(out.str(), HasSubstr("NOT VERIFIED"));
}

TEST(InspectTest, MissingAndNonBlockFilesGiveClearErrors) {
  std::ostringstream out;
  const absl::Status missing = InspectBlockFile("/nonexistent/strata.blk", out);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("/nonexistent/strata.blk"));
  const std::string path = absl::StrCat(testing::TempDir(), "/not_a_block.txt");
  const std::string text = "hello, this is text";
  ASSERT_TRUE(WriteFileAtomic(path, absl::MakeConstSpan(
                                        reinterpret_cast<const uint8_t*>(text.data()), text.size()))
                  .ok());
  EXPECT_EQ(InspectBlockFile(path, out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InspectBlockFile(testing::TempDir(), out).code(),
            absl::StatusCode::kInvalidArgument);  // a directory
}

// A file of 1 GiB (sparse: it costs no disk) is refused from its header alone: the size its
// header declares is not the file's, or it is no block at all.
TEST(InspectTest, ALargeFileIsRefusedFromItsHeader) {
  const AlignedBuffer b = SmallBlock();
  const uint64_t large = uint64_t{1} << 30;
  const std::string path = absl::StrCat(testing::TempDir(), "/inspect_large.blk");
  ASSERT_TRUE(WriteFileAtomic(path, b.span()).ok());
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(large)), 0);
  std::ostringstream out;
  absl::Status s = InspectBlockFile(path, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("is ", large, " bytes but its header declares ", b.size())));
  EXPECT_EQ(out.str(), "");

  // Its header's size says more than the file holds: refused the same way.
  AlignedBuffer big_header = SmallBlock();
  const uint32_t claims = (1u << 30) - 4096;
  std::memcpy(big_header.data() + 12, &claims, 4);  // little-endian hosts (as the format)
  ASSERT_TRUE(WriteFileAtomic(path, big_header.span()).ok());
  s = InspectBlockFile(path, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("(truncated)"));

  // Not a block (no magic) and 1 GiB: refused by the header's first bytes.
  const std::string text = std::string(64, 'x');
  ASSERT_TRUE(WriteFileAtomic(path, absl::MakeConstSpan(
                                        reinterpret_cast<const uint8_t*>(text.data()), text.size()))
                  .ok());
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(large)), 0);
  s = InspectBlockFile(path, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not a Strata block"));
  std::remove(path.c_str());
}

// A block cut short, or followed by more bytes, is refused naming both sizes; the whole block
// still prints.
TEST(InspectTest, TruncatedAndPaddedBlocksNameBothSizes) {
  const AlignedBuffer b = SmallBlock();
  const std::string path = absl::StrCat(testing::TempDir(), "/inspect_cut.blk");
  ASSERT_TRUE(WriteFileAtomic(path, b.span().subspan(0, b.size() - 100)).ok());
  std::ostringstream out;
  absl::Status s = InspectBlockFile(path, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("is ", b.size() - 100, " bytes but its header declares ",
                                     b.size(), " (truncated)")));
  ASSERT_TRUE(WriteFileAtomic(path, b.span()).ok());
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(b.size() + 1)), 0);
  s = InspectBlockFile(path, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("(bytes after the block)"));
  ASSERT_TRUE(WriteFileAtomic(path, b.span()).ok());
  EXPECT_TRUE(InspectBlockFile(path, out).ok());
}

}  // namespace
}  // namespace strata::tools
