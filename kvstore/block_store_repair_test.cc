// The store's index (RocksDB in disk_path) damaged the ways a disk damages it: bytes flipped in a
// table file's data blocks, its index block or its footer, in the MANIFEST; table file, MANIFEST
// or CURRENT gone. Each time: the store refuses to start and its message names --repair, and
// with `repair` it rebuilds the index from the block log and every block whose bytes verify
// comes back, bytes and chains intact. An index error met after Open is a miss, never a crash.
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvstore/block_store.h"
#include "kvstore/test_blocks.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"

namespace strata::kvstore {
namespace {

namespace fs = std::filesystem;
using testing::HasSubstr;

constexpr uint64_t kModel = 0x4321;
// 16 chains of 10 chunks, 2 layers: 320 blocks, whose index records fill a table file of about
// a dozen data blocks.
constexpr uint32_t kChains = 16, kChunks = 10, kLayers = 2;
constexpr uint32_t kBlocks = kChains * kChunks * kLayers;

uint32_t First(uint32_t chain) { return 10000 + chain * 100; }
uint32_t Seed(uint32_t chain, uint32_t chunk, uint32_t layer) {
  return First(chain) + chunk * 31 + layer;
}

// A real block (fp16 codec) whose values depend on `seed`.
AlignedBuffer MakeBlock(uint32_t layer, uint32_t chunk, uint32_t seed) {
  return test_blocks::MakeBlock(kModel, layer, chunk, seed);
}
BlockHash Key(uint32_t i) { return test_blocks::Key(i, 0xa5); }
using test_blocks::Name;

StoreOptions Options(const std::string& dir, bool repair = false) {
  return {.ram_bytes = size_t{4} << 20,
          .disk_path = dir,
          .disk_bytes = size_t{1} << 30,
          .repair = repair};
}

std::string PristineDir() {
  return absl::StrCat(testing::TempDir(), "/repair-pristine-", getpid());
}

// Files of the index (in the store's folder, not in blocks/) whose names satisfy `match`.
std::vector<std::string> IndexFiles(const std::string& dir, bool (*match)(const std::string&)) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && match(e.path().filename().string())) out.push_back(e.path());
  }
  return out;
}
bool IsTable(const std::string& n) { return n.ends_with(".sst"); }
bool IsManifest(const std::string& n) { return n.starts_with("MANIFEST-"); }
bool IsCurrent(const std::string& n) { return n == "CURRENT"; }

std::string TheTable(const std::string& dir) {
  const std::vector<std::string> tables = IndexFiles(dir, IsTable);
  EXPECT_EQ(tables.size(), 1u) << "the index is not in one table file";
  return tables.empty() ? "" : tables[0];
}

void Flip(const std::string& path, uint64_t at, int bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.is_open()) << path;
  for (int i = 0; i < bytes; ++i) {
    f.seekg(static_cast<std::streamoff>(at + i));
    char c = 0;
    f.get(c);
    f.seekp(static_cast<std::streamoff>(at + i));
    f.put(static_cast<char>(c ^ 0x5a));
  }
  ASSERT_TRUE(f.good()) << path;
}

// Where a block-based table's index block lies, from its footer (format_version 2..5: checksum
// type, then the metaindex and index block handles as varints, padding, version, magic).
struct Handle {
  uint64_t offset = 0, size = 0;
};
Handle IndexBlockOf(const std::string& table) {
  constexpr size_t kFooter = 53;
  std::ifstream f(table, std::ios::binary);
  const uint64_t size = fs::file_size(table);
  std::string footer(kFooter, '\0');
  f.seekg(static_cast<std::streamoff>(size - kFooter));
  f.read(footer.data(), kFooter);
  uint64_t magic = 0;
  std::memcpy(&magic, footer.data() + kFooter - 8, 8);
  EXPECT_EQ(magic, 0x88e241b785f4cff7ull) << "not a block-based table's footer";
  const auto* p = reinterpret_cast<const uint8_t*>(footer.data()) + 1;
  auto varint = [&p] {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      v |= uint64_t{*p & 0x7fu} << shift;
      if ((*p++ & 0x80) == 0) return v;
    }
  };
  varint();  // the metaindex block
  varint();
  Handle index;
  index.offset = varint();
  index.size = varint();
  EXPECT_GT(index.offset, 0u);
  EXPECT_LT(index.offset + index.size, size - kFooter);
  return index;
}

// The store of every test, made once: written, closed (so its index lives in one table file,
// the memtable flushed), and copied for each test to damage its own.
class RepairTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    fs::remove_all(PristineDir());
    {
      auto s = *BlockStore::Open(Options(PristineDir()));
      for (uint32_t chain = 0; chain < kChains; ++chain) {
        for (uint32_t c = 0; c < kChunks; ++c) {
          for (uint32_t l = 0; l < kLayers; ++l) {
            const AlignedBuffer b = MakeBlock(l, c, Seed(chain, c, l));
            const BlockHash parent = Key(First(chain) + c - 1);
            ASSERT_TRUE(
                s->Put(Name(b, Key(First(chain) + c)), c == 0 ? nullptr : &parent, b.span()).ok());
          }
        }
      }
      ASSERT_EQ(s->Stats().disk_blocks, kBlocks);
    }
    ASSERT_EQ(IndexFiles(PristineDir(), IsTable).size(), 1u);
  }
  static void TearDownTestSuite() { fs::remove_all(PristineDir()); }

  void SetUp() override {
    dir_ =
        absl::StrCat(testing::TempDir(), "/repair-",
                     testing::UnitTest::GetInstance()->current_test_info()->name(), "-", getpid());
    fs::remove_all(dir_);
    fs::copy(PristineDir(), dir_, fs::copy_options::recursive);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Every block is there with its exact bytes, and every chain whole; `except(chain, chunk,
  // layer)` names blocks expected gone instead.
  template <typename Except>
  void ExpectEveryBlock(BlockStore& s, Except except) {
    for (uint32_t chain = 0; chain < kChains; ++chain) {
      uint32_t whole = 0;  // leading chunks present in every layer
      while (whole < kChunks && !except(chain, whole, 0) && !except(chain, whole, 1)) ++whole;
      const BlockName prefix = Name(MakeBlock(0, 0, Seed(chain, 0, 0)), Key(First(chain)));
      std::vector<BlockHash> keys;
      for (uint32_t c = 0; c < kChunks; ++c) keys.push_back(Key(First(chain) + c));
      EXPECT_EQ(s.Lookup(prefix, keys, kLayers).chunks, whole) << "chain " << chain;
      for (uint32_t c = 0; c < kChunks; ++c) {
        for (uint32_t l = 0; l < kLayers; ++l) {
          const AlignedBuffer want = MakeBlock(l, c, Seed(chain, c, l));
          absl::StatusOr<Lease> got = s.Get(Name(want, Key(First(chain) + c)));
          if (except(chain, c, l)) {
            EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << chain << "/" << c;
            continue;
          }
          ASSERT_TRUE(got.ok()) << chain << "/" << c << "/" << l << ": " << got.status();
          ASSERT_EQ(got->bytes().size(), want.size());
          EXPECT_EQ(std::memcmp(got->bytes().data(), want.data(), want.size()), 0)
              << chain << "/" << c << "/" << l;
        }
      }
    }
  }
  void ExpectEveryBlock(BlockStore& s) {
    ExpectEveryBlock(s, [](uint32_t, uint32_t, uint32_t) { return false; });
  }

  // Without repair the store refuses to start, twice (a refused open mends nothing and breaks
  // nothing), naming --repair; with it, the index is set aside and rebuilt, every block comes
  // back; the next plain start finds the rebuilt index whole. The refusal is kept in refusal_.
  void ExpectRefusedThenRepaired() {
    absl::StatusOr<std::unique_ptr<BlockStore>> refused = BlockStore::Open(Options(dir_));
    EXPECT_FALSE(refused.ok()) << "a damaged index was opened without --repair";
    if (refused.ok()) return;
    const absl::Status why = refused_ = refused.status();
    EXPECT_THAT(std::string(why.message()), HasSubstr("--repair")) << why;
    EXPECT_THAT(std::string(why.message()), HasSubstr(dir_)) << why;
    EXPECT_TRUE(absl::IsDataLoss(why) || absl::IsUnavailable(why)) << why;
    EXPECT_FALSE(BlockStore::Open(Options(dir_)).ok()) << "a refused open mended the index";
    {
      absl::StatusOr<std::unique_ptr<BlockStore>> s = BlockStore::Open(Options(dir_, true));
      EXPECT_TRUE(s.ok()) << s.status();
      if (!s.ok()) return;
      const StoreStats st = (*s)->Stats();
      EXPECT_EQ(st.index_recovered_blocks, kBlocks);
      EXPECT_EQ(st.index_lost_blocks, 0u);
      EXPECT_EQ(st.corruptions, 0u);
      EXPECT_EQ(st.disk_blocks, kBlocks);
      ExpectEveryBlock(**s);
    }
    int aside = 0;
    for (const auto& e : fs::directory_iterator(dir_)) {
      aside += e.path().filename().string().starts_with("damaged-index-");
    }
    EXPECT_EQ(aside, 1) << "the damaged index's files are not set aside";
    absl::StatusOr<std::unique_ptr<BlockStore>> again = BlockStore::Open(Options(dir_));
    EXPECT_TRUE(again.ok()) << again.status();
    if (again.ok()) {
      EXPECT_EQ((*again)->Stats().index_recovered_blocks, 0u) << "the rebuilt index is partial";
      EXPECT_EQ((*again)->Stats().disk_blocks, kBlocks);
      ExpectEveryBlock(**again);
    }
  }

  std::string dir_;
  absl::Status refused_;  // what the last ExpectRefusedThenRepaired met
};

TEST_F(RepairTest, TheUndamagedStoreOpensWithEveryBlockAndRepairLeavesItAlone) {
  {
    auto s = *BlockStore::Open(Options(dir_));
    EXPECT_EQ(s->Stats().index_recovered_blocks, 0u);
    ExpectEveryBlock(*s);
  }
  auto s = *BlockStore::Open(Options(dir_, true));
  EXPECT_EQ(s->Stats().index_recovered_blocks, 0u);
  EXPECT_EQ(s->Stats().disk_blocks, kBlocks);
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_FALSE(e.path().filename().string().starts_with("damaged-index-"));
  }
}

// The case of issue 40: RocksDB opens the index, and reading it meets a data block that fails
// its checksum.
TEST_F(RepairTest, ADamagedDataBlockOfTheIndexTable) {
  const std::string table = TheTable(dir_);
  const Handle index = IndexBlockOf(table);
  ASSERT_GT(index.offset, 8u * 4096) << "fewer data blocks than meant";
  Flip(table, index.offset / 2, 4);
  ExpectRefusedThenRepaired();
  EXPECT_THAT(std::string(refused_.message()), HasSubstr("reading the index")) << refused_;
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
}

TEST_F(RepairTest, DamagedDataBlocksAtEitherEndOfTheTable) {
  const std::string table = TheTable(dir_);
  const Handle index = IndexBlockOf(table);
  Flip(table, 10, 1);                 // the first data block
  Flip(table, index.offset - 12, 3);  // the last one's payload (its 5-byte trailer follows)
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
  EXPECT_THAT(std::string(refused_.message()), HasSubstr("reading the index")) << refused_;
}

TEST_F(RepairTest, ADamagedIndexBlockOfTheTable) {
  const std::string table = TheTable(dir_);
  const Handle index = IndexBlockOf(table);
  Flip(table, index.offset + index.size / 2, 2);
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
}

TEST_F(RepairTest, ADamagedTableFooter) {
  const std::string table = TheTable(dir_);
  Flip(table, fs::file_size(table) - 4, 1);  // in its magic number
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
}

TEST_F(RepairTest, ADamagedManifest) {
  const std::vector<std::string> manifests = IndexFiles(dir_, IsManifest);
  ASSERT_EQ(manifests.size(), 1u);
  Flip(manifests[0], fs::file_size(manifests[0]) / 2, 3);
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
}

TEST_F(RepairTest, AMissingTableFile) {
  fs::remove(TheTable(dir_));
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
}

TEST_F(RepairTest, AMissingManifest) {
  const std::vector<std::string> manifests = IndexFiles(dir_, IsManifest);
  ASSERT_EQ(manifests.size(), 1u);
  fs::remove(manifests[0]);
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsUnavailable(refused_)) << refused_;  // RocksDB: an I/O error
}

// Without CURRENT, RocksDB would take the folder for a new, empty index (and its failed attempt
// leaves a new CURRENT behind): the store refuses it as an index that will not open.
TEST_F(RepairTest, AMissingCurrentFile) {
  ASSERT_EQ(IndexFiles(dir_, IsCurrent).size(), 1u);
  fs::remove(fs::path(dir_) / "CURRENT");
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
  EXPECT_THAT(std::string(refused_.message()), HasSubstr("CURRENT is missing")) << refused_;
}

TEST_F(RepairTest, MissingCurrentAndManifest) {
  fs::remove(fs::path(dir_) / "CURRENT");
  for (const std::string& m : IndexFiles(dir_, IsManifest)) fs::remove(m);
  ExpectRefusedThenRepaired();
  EXPECT_TRUE(absl::IsDataLoss(refused_)) << refused_;
}

// The whole index gone (only blocks/ left): the same.
TEST_F(RepairTest, AnIndexWipedIsIndexedAgainFromTheLog) {
  for (const auto& e : fs::directory_iterator(dir_)) {
    if (e.path().filename() != "blocks") fs::remove_all(e.path());
  }
  auto s = *BlockStore::Open(Options(dir_));
  EXPECT_EQ(s->Stats().index_recovered_blocks, kBlocks);
  ExpectEveryBlock(*s);
}

// The index damaged and some blocks in the log too: repair brings back every block whose bytes
// verify; a block that does not is dropped and counted, and so are the chunks after it in its
// chain (their prefix is gone).
TEST_F(RepairTest, RepairBringsBackEveryBlockWhoseBytesVerify) {
  struct Bad {
    uint32_t chain, chunk, layer;
  };
  const Bad bad[] = {{3, kChunks - 1, 1}, {5, 7, 0}};  // a leaf; a chunk with two after it
  for (const Bad& b : bad) {
    const AlignedBuffer block = MakeBlock(b.layer, b.chunk, Seed(b.chain, b.chunk, b.layer));
    const std::string needle(reinterpret_cast<const char*>(block.data()) + 1000, 64);
    int found = 0;
    for (const auto& f : fs::directory_iterator(fs::path(dir_) / "blocks")) {
      std::ifstream in(f.path(), std::ios::binary);
      const std::string data((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      for (size_t at = data.find(needle); at != std::string::npos; at = data.find(needle, at + 1)) {
        Flip(f.path(), at + 10, 1);
        ++found;
      }
    }
    ASSERT_EQ(found, 1);
  }
  const std::string table = TheTable(dir_);
  Flip(table, IndexBlockOf(table).offset / 2, 4);
  auto gone = [&](uint32_t chain, uint32_t chunk, uint32_t layer) {
    for (const Bad& b : bad) {
      if (chain == b.chain && layer == b.layer && chunk >= b.chunk) return true;
    }
    return false;
  };
  uint32_t lost = 0;
  for (uint32_t chain = 0; chain < kChains; ++chain) {
    for (uint32_t c = 0; c < kChunks; ++c) {
      for (uint32_t l = 0; l < kLayers; ++l) lost += gone(chain, c, l);
    }
  }
  ASSERT_EQ(lost, 4u);
  EXPECT_FALSE(BlockStore::Open(Options(dir_)).ok());
  auto s = *BlockStore::Open(Options(dir_, true));
  EXPECT_EQ(s->Stats().index_recovered_blocks, kBlocks - lost);
  EXPECT_EQ(s->Stats().index_lost_blocks, lost);
  EXPECT_EQ(s->Stats().disk_blocks, kBlocks - lost);
  ExpectEveryBlock(*s, gone);
}

// As an operator found it (issue 40): one to fourteen bytes flipped anywhere in the table file,
// a few times over. Either the store refuses to start, naming --repair, or the bytes fell where
// nothing reads them and it starts with every block; with --repair, every block comes back.
TEST_F(RepairTest, BytesFlippedAnywhereInTheTable) {
  std::mt19937 rng(40);
  for (int trial = 0; trial < 6; ++trial) {
    SCOPED_TRACE(trial);
    TearDown();
    SetUp();
    const std::string table = TheTable(dir_);
    const uint64_t size = fs::file_size(table);
    const int flips = 1 + static_cast<int>(rng() % 14);
    for (int i = 0; i < flips; ++i) Flip(table, rng() % size, 1);
    {
      absl::StatusOr<std::unique_ptr<BlockStore>> plain = BlockStore::Open(Options(dir_));
      if (plain.ok()) {
        ExpectEveryBlock(**plain);
        continue;
      }
      EXPECT_THAT(std::string(plain.status().message()), HasSubstr("--repair"));
    }
    auto s = *BlockStore::Open(Options(dir_, true));
    EXPECT_EQ(s->Stats().disk_blocks, kBlocks);
    ExpectEveryBlock(*s);
  }
}

// A store's folder is held by one store: a second (with --repair or not) is refused and leaves
// the running store's index alone.
TEST_F(RepairTest, ARunningStoreIsNeverRepairedUnderItself) {
  auto running = *BlockStore::Open(Options(dir_));
  for (bool repair : {false, true}) {
    absl::StatusOr<std::unique_ptr<BlockStore>> second = BlockStore::Open(Options(dir_, repair));
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
    EXPECT_THAT(std::string(second.status().message()), HasSubstr("in use"));
  }
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_FALSE(e.path().filename().string().starts_with("damaged-index-"));
  }
  ExpectEveryBlock(*running);
  running.reset();
  auto s = *BlockStore::Open(Options(dir_));  // the lock went with it
  EXPECT_EQ(s->Stats().index_recovered_blocks, 0u);
}

// An index error met after Open: a store from before the block log keeps its blocks in
// RocksDB's blob files, which Open does not read. A damaged one is met by Get: a miss, counted,
// whose message names --repair; the store goes on.
TEST(RepairRunTimeTest, ADamagedRecordMetByGetIsAMissNamingRepair) {
  const std::string dir = absl::StrCat(testing::TempDir(), "/repair-runtime-", getpid());
  fs::remove_all(dir);
  const AlignedBuffer b = MakeBlock(0, 0, 9), other = MakeBlock(0, 0, 10);
  const BlockName name = Name(b, Key(1)), other_name = Name(other, Key(2));
  {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.enable_blob_files = true;  // as the store kept them
    o.min_blob_size = 4096;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(o, dir, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    for (const auto& [n, bytes] : {std::pair{&name, &b}, std::pair{&other_name, &other}}) {
      std::string meta = "SKV1";
      meta.push_back('\0');  // no parent
      for (int i = 0; i < 8; ++i)
        meta.push_back(static_cast<char>((bytes->size() >> (8 * i)) & 0xff));
      ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "M" + n->Encode(), meta).ok());
      ASSERT_TRUE(
          db->Put(rocksdb::WriteOptions(), "B" + n->Encode(),
                  rocksdb::Slice(reinterpret_cast<const char*>(bytes->data()), bytes->size()))
              .ok());
    }
    ASSERT_TRUE(db->Flush(rocksdb::FlushOptions()).ok());
  }
  // The first block's bytes, in the blob file: one flipped.
  const std::string needle(reinterpret_cast<const char*>(b.data()) + 1000, 64);
  int found = 0;
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".blob") continue;
    std::ifstream in(f.path(), std::ios::binary);
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (size_t at = data.find(needle); at != std::string::npos; at = data.find(needle, at + 1)) {
      Flip(f.path(), at + 10, 1);
      ++found;
    }
  }
  ASSERT_EQ(found, 1) << "the block is not in a blob file";
  auto s = *BlockStore::Open(Options(dir));
  EXPECT_EQ(s->Stats().disk_blocks, 2u);
  absl::StatusOr<Lease> got = s->Get(name);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("--repair"));
  EXPECT_EQ(s->Stats().index_errors, 1u);
  EXPECT_EQ(s->Stats().corruptions, 1u);
  EXPECT_EQ(s->Get(name).status().code(), absl::StatusCode::kNotFound);  // dropped
  absl::StatusOr<Lease> intact = s->Get(other_name);                     // the store goes on
  ASSERT_TRUE(intact.ok()) << intact.status();
  EXPECT_EQ(std::memcmp(intact->bytes().data(), other.data(), other.size()), 0);
  s.reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata::kvstore
