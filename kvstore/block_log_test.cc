#include "kvstore/block_log.h"

#include <unistd.h>

#include <filesystem>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::kvstore {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const std::string d = absl::StrCat(testing::TempDir(), "/blocklog-", name, "-", getpid());
  std::filesystem::remove_all(d);
  return d;
}

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> ReadBack(const BlockLog& log, const Extent& e) {
  std::vector<uint8_t> out(e.size);
  const absl::Status s = log.Read(e, absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(BlockLogTest, AppendsReadBackAndFreedSpaceGoesBack) {
  const std::string dir = TempDir("basic");
  auto log = *BlockLog::Open(dir);
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<Extent> at;
  for (uint32_t i = 0; i < 8; ++i) {
    blocks.push_back(Bytes(100000 + 1000 * i, i));
    absl::StatusOr<Extent> e = log->Append(blocks.back());
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->offset % BlockLog::kAlign, 0u);
    EXPECT_EQ(e->size, blocks.back().size());
    at.push_back(*e);
  }
  for (size_t i = 0; i < blocks.size(); ++i) EXPECT_EQ(ReadBack(*log, at[i]), blocks[i]);
  const BlockLog::Stats before = log->stats();
  EXPECT_EQ(before.files, 1u);
  EXPECT_GE(before.allocated_bytes, 8 * 100000u);
  for (size_t i = 0; i < 6; ++i) log->Free(at[i]);
  const BlockLog::Stats after = log->stats();
  EXPECT_EQ(after.live_bytes, at[6].size + at[7].size);
  // The freed extents' pages are punched out of the file (ext4, xfs, tmpfs all can).
  EXPECT_LT(after.allocated_bytes, before.allocated_bytes - 5 * 100000u) << "no hole punched";
  EXPECT_EQ(ReadBack(*log, at[7]), blocks[7]);  // neighbours untouched
}

TEST(BlockLogTest, FilesRollOverAndAFileWithNothingLiveIsDeleted) {
  const std::string dir = TempDir("roll");
  auto log = *BlockLog::Open(dir, 64 << 10);
  std::vector<Extent> at;
  for (uint32_t i = 0; i < 6; ++i) at.push_back(*log->Append(Bytes(20000, i)));  // 3 per file
  EXPECT_EQ(at[0].file, at[2].file);
  EXPECT_NE(at[2].file, at[3].file);
  EXPECT_EQ(log->stats().files, 2u);
  const std::string first = (std::filesystem::path(dir) / absl::StrCat(at[0].file, ".log")).string();
  ASSERT_TRUE(std::filesystem::exists(first));
  for (int i = 0; i < 3; ++i) log->Free(at[i]);
  EXPECT_FALSE(std::filesystem::exists(first)) << "a dead file stays";
  EXPECT_EQ(log->stats().files, 1u);
  // The file being appended to stays even when empty; a block larger than a file gets its own.
  for (int i = 3; i < 6; ++i) log->Free(at[i]);
  EXPECT_EQ(log->stats().files, 1u);
  const std::vector<uint8_t> big = Bytes(200000, 9);
  absl::StatusOr<Extent> e = log->Append(big);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->offset, 0u);
  EXPECT_EQ(ReadBack(*log, *e), big);
  EXPECT_EQ(log->stats().files, 1u);  // the empty one went when it stopped being appended to
}

TEST(BlockLogTest, ReadsOfExtentsThatAreNotThereFailWithReasons) {
  const std::string dir = TempDir("bad");
  auto log = *BlockLog::Open(dir);
  const Extent e = *log->Append(Bytes(5000, 1));
  std::vector<uint8_t> out(e.size);
  absl::Status s =
      log->Read({.file = e.file, .offset = e.offset + 4096, .size = e.size}, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("ends at"));
  s = log->Read({.file = e.file + 7, .offset = 0, .size = e.size}, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("is gone"));
  s = log->Read({.file = e.file, .offset = uint64_t{1} << 63, .size = e.size}, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  std::vector<uint8_t> small(10);
  EXPECT_EQ(log->Read(e, absl::MakeSpan(small)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockLog::Open(dir, 100).status().code(), absl::StatusCode::kInvalidArgument);
}

// After a crash, the index names some extents: files with none are deleted, the space around
// the named ones is punched out, and they read back intact; new blocks go to a new file.
TEST(BlockLogTest, RecoverKeepsWhatTheIndexNamesAndGivesTheRestBack) {
  const std::string dir = TempDir("recover");
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<Extent> at;
  {
    auto log = *BlockLog::Open(dir, 1 << 20);
    for (uint32_t i = 0; i < 12; ++i) {  // 3 files of 4
      blocks.push_back(Bytes(250000, 20 + i));
      at.push_back(*log->Append(blocks.back()));
    }
    EXPECT_EQ(log->stats().files, 3u);
  }  // "crash": nothing freed
  auto log = *BlockLog::Open(dir, 1 << 20);
  EXPECT_EQ(log->stats().files, 3u);
  const std::vector<Extent> live = {at[1], at[9], at[10]};  // nothing in the middle file
  log->Recover(live);
  const BlockLog::Stats st = log->stats();
  EXPECT_EQ(st.files, 2u);
  EXPECT_EQ(st.live_bytes, 3 * 250000u);
  EXPECT_LT(st.allocated_bytes, 4 * 256000u) << "space nothing names was kept";
  for (size_t i : {1, 9, 10}) EXPECT_EQ(ReadBack(*log, at[i]), blocks[i]);
  const Extent fresh = *log->Append(blocks[0]);
  EXPECT_GT(fresh.file, at[11].file);
  EXPECT_EQ(ReadBack(*log, fresh), blocks[0]);
}

}  // namespace
}  // namespace strata::kvstore
