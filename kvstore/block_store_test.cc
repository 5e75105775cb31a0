#include "kvstore/block_store.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/block_reader.h"
#include "common/shared_bytes.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"
#include "kvstore/block_source.h"
#include "kvstore/test_blocks.h"
#include "rocksdb/db.h"

namespace strata::kvstore {
namespace {

using testing::HasSubstr;

constexpr uint64_t kModel = 0x1234;

// A real block (fp16 codec) of `tokens` tokens whose values depend on `seed`.
AlignedBuffer MakeBlock(uint32_t layer, uint32_t chunk, uint32_t seed, uint32_t tokens = 64) {
  return test_blocks::MakeBlock(kModel, layer, chunk, seed, tokens);
}
BlockHash Key(uint32_t i) { return test_blocks::Key(i, 0x5a); }
using test_blocks::Name;

std::string TempDir(const std::string& name) {
  const std::string d = absl::StrCat(testing::TempDir(), "/", name, "-", getpid());
  std::filesystem::remove_all(d);
  return d;
}

// Puts a chain of `n` chunks (keys first..first+n-1), `layers` layers each.
void PutChain(BlockStore& s, uint32_t first, uint32_t n, uint32_t layers = 1) {
  for (uint32_t c = 0; c < n; ++c) {
    for (uint32_t l = 0; l < layers; ++l) {
      AlignedBuffer b = MakeBlock(l, c, first + c * 31 + l);
      const BlockHash parent = Key(first + c - 1);
      ASSERT_TRUE(s.Put(Name(b, Key(first + c)), c == 0 ? nullptr : &parent, b.span()).ok());
    }
  }
}

std::vector<BlockHash> Chain(uint32_t first, uint32_t n) {
  std::vector<BlockHash> c;
  for (uint32_t i = 0; i < n; ++i) c.push_back(Key(first + i));
  return c;
}

TEST(BlockStoreTest, PutGetLookupDeleteAndRefusals) {
  auto s = *BlockStore::Open({.ram_bytes = 1 << 20});
  AlignedBuffer b0 = MakeBlock(0, 0, 1), b1 = MakeBlock(0, 1, 2);
  const BlockName n0 = Name(b0, Key(0)), n1 = Name(b1, Key(1));
  const BlockHash k0 = Key(0);
  ASSERT_TRUE(s->Put(n0, nullptr, b0.span()).ok());
  ASSERT_TRUE(s->Put(n0, nullptr, b0.span()).ok());  // idempotent
  ASSERT_TRUE(s->Put(n1, &k0, b1.span()).ok());
  absl::StatusOr<Lease> got = s->Get(n1);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->served_from(), Tier::kRam);
  EXPECT_TRUE(std::equal(got->bytes().begin(), got->bytes().end(), b1.data()));
  BlockName prefix = n0;
  EXPECT_EQ(s->Lookup(prefix, Chain(0, 3), 1).chunks, 2u);
  EXPECT_EQ(s->Lookup(prefix, Chain(0, 3), 2).chunks, 0u);  // layer 1 was never stored
  // A corrupt block, a block under another name, an orphan: refused, with reasons.
  std::vector<uint8_t> bad(b1.data(), b1.data() + b1.size());
  bad[200] ^= 1;
  absl::Status st = s->Put(Name(b1, Key(7)), &k0, bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()), HasSubstr("checksum"));
  BlockName wrong = n1;
  wrong.layer = 3;
  EXPECT_EQ(s->Put(wrong, &k0, b1.span()).code(), absl::StatusCode::kInvalidArgument);
  const BlockHash missing = Key(99);
  EXPECT_EQ(s->Put(Name(b1, Key(8)), &missing, b1.span()).code(),
            absl::StatusCode::kFailedPrecondition);
  // Deleting the first chunk takes the second with it; the lease keeps its bytes.
  EXPECT_TRUE(s->Delete(n0));
  EXPECT_EQ(s->Get(n1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(std::equal(got->bytes().begin(), got->bytes().end(), b1.data()));
  const StoreStats stats = s->Stats();
  EXPECT_EQ(stats.duplicate_puts, 1u);
  EXPECT_EQ(stats.refused_puts, 3u);
  EXPECT_EQ(stats.orphans_dropped, 1u);
  EXPECT_EQ(stats.ram_blocks, 0u);
  EXPECT_EQ(stats.ram_bytes, 0u);
}

// RAM only: eviction takes leaves first (a prefix stays while its descendants do), so no chunk
// is ever left without its prefix; RAM never holds more bytes than its capacity.
TEST(BlockStoreTest, EvictionNeverLeavesOrphansAndCapacityIsExact) {
  const size_t block = MakeBlock(0, 0, 0).size();
  auto s = *BlockStore::Open({.ram_bytes = 6 * block, .ram_policy = PolicyKind::kLru});
  PutChain(*s, 100, 3);  // A -> B -> C
  PutChain(*s, 200, 3);  // D -> E -> F: RAM is full
  EXPECT_EQ(s->Stats().ram_bytes, 6 * block);
  // Touch chain 2 so chain 1's head is the LRU victim, then add one more block.
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(s->Get(Name(MakeBlock(0, i, 0), Key(200 + i))).ok());
  PutChain(*s, 300, 1);
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  // The LRU chunk is A, but it has descendants: C, the oldest leaf, goes.
  EXPECT_EQ(s->Lookup(prefix, Chain(100, 3), 1).chunks, 2u);
  EXPECT_EQ(s->Lookup(prefix, Chain(200, 3), 1).chunks, 3u);
  StoreStats st = s->Stats();
  EXPECT_EQ(st.ram_evictions, 1u);
  EXPECT_EQ(st.orphans_dropped, 0u);
  EXPECT_EQ(st.ram_bytes, 6 * block);
  EXPECT_EQ(st.ram_blocks, 6u);
  EXPECT_GE(st.pool_reuses, 0u);
  // More single-chunk prompts: whatever goes, every resident block is reachable through its
  // prefix (the lookups account for every block in RAM).
  for (uint32_t k = 400; k < 1000; k += 100) {
    PutChain(*s, k, 1);
    uint32_t reachable = s->Lookup(prefix, Chain(100, 3), 1).chunks +
                         s->Lookup(prefix, Chain(200, 3), 1).chunks;
    for (uint32_t j = 300; j <= k; j += 100) reachable += s->Lookup(prefix, Chain(j, 1), 1).chunks;
    st = s->Stats();
    EXPECT_EQ(reachable, st.ram_blocks) << k;
    EXPECT_EQ(st.orphans_dropped, 0u);
    EXPECT_LE(st.ram_bytes, 6 * block);
  }
  EXPECT_GT(st.pool_reuses, 0u) << "evicted buffers are handed out again";
}

TEST(BlockStoreTest, LeasedBlocksAreNotEvicted) {
  const size_t block = MakeBlock(0, 0, 0).size();
  auto s = *BlockStore::Open({.ram_bytes = 2 * block, .ram_policy = PolicyKind::kLru});
  PutChain(*s, 10, 1);
  PutChain(*s, 20, 1);
  Lease lease = *s->Get(Name(MakeBlock(0, 0, 0), Key(10)));
  ASSERT_TRUE(s->Get(Name(MakeBlock(0, 0, 0), Key(20))).ok());  // 10 is the LRU victim...
  PutChain(*s, 30, 1);  // ...but leased: 20 goes instead
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  EXPECT_EQ(s->Lookup(prefix, Chain(10, 1), 1).chunks, 1u);
  EXPECT_EQ(s->Lookup(prefix, Chain(20, 1), 1).chunks, 0u);
  lease = Lease();
  PutChain(*s, 40, 1);  // now 10 can go
  EXPECT_EQ(s->Lookup(prefix, Chain(10, 1), 1).chunks, 0u);
}

// With a disk tier: RAM evictions spill (write-back mode), disk hits are promoted, restarts find
// the disk tier again, and the disk evicts for good (descendants with it).
TEST(BlockStoreTest, SpillPromoteRestartAndDiskEviction) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("spill");
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  {
    auto s = *BlockStore::Open({.ram_bytes = 2 * block,
                                .disk_path = dir,
                                .disk_bytes = 100 * block,
                                .durable_puts = false});
    PutChain(*s, 500, 6, 2);  // 12 blocks through a 2-block RAM
    s->Flush();
    StoreStats st = s->Stats();
    EXPECT_EQ(st.spills, 10u);
    EXPECT_EQ(st.ram_blocks, 2u);
    EXPECT_EQ(s->Lookup(prefix, Chain(500, 6), 2).chunks, 6u);
    const BlockName first = Name(MakeBlock(1, 0, 0), Key(500));
    Lease l = *s->Get(first);
    EXPECT_EQ(l.served_from(), Tier::kDisk);
    EXPECT_EQ(s->Get(first)->served_from(), Tier::kRam);  // promoted
    EXPECT_EQ(s->Stats().promotions, 1u);
    s->Flush();
  }
  {
    auto s = *BlockStore::Open(
        {.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 100 * block});
    EXPECT_EQ(s->Lookup(prefix, Chain(500, 6), 2).chunks, 6u) << "the disk tier came back";
    EXPECT_EQ(s->Stats().disk_blocks, 12u);
    ASSERT_TRUE(s->Get(Name(MakeBlock(0, 5, 0), Key(505))).ok());
  }
  {  // Reopened with room for 4 blocks: leaves go first, the first two chunks stay whole.
    auto s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 4 * block});
    const StoreStats st = s->Stats();
    EXPECT_EQ(st.disk_bytes, 4 * block);
    EXPECT_EQ(st.orphans_dropped, 0u);
    EXPECT_EQ(s->Lookup(prefix, Chain(500, 6), 2).chunks, 2u);
    // Deleting the first chunk of one layer takes that layer's second chunk along.
    EXPECT_TRUE(s->Delete(Name(MakeBlock(0, 0, 0), Key(500))));
    EXPECT_EQ(s->Stats().orphans_dropped, 1u);
    EXPECT_EQ(s->Lookup(prefix, Chain(500, 6), 2).chunks, 0u);
  }
}

// A block corrupted on disk is caught by its checksum, counted, dropped and never served.
TEST(BlockStoreTest, CorruptionOnDiskIsAMissNeverData) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("corrupt");
  AlignedBuffer b = MakeBlock(0, 0, 77);
  const BlockName name = Name(b, Key(1));
  {
    auto s = *BlockStore::Open({.ram_bytes = 4 * block, .disk_path = dir, .disk_bytes = 1 << 30});
    ASSERT_TRUE(s->Put(name, nullptr, b.span()).ok());
  }
  // Flip a byte of the block's payload wherever it is on disk (the block log; RocksDB holds only
  // the index).
  int flipped = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir)) {
    if (!f.is_regular_file()) continue;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(io)), std::istreambuf_iterator<char>());
    const std::string needle(reinterpret_cast<const char*>(b.data()) + 1000, 64);
    for (size_t pos = data.find(needle); pos != std::string::npos; pos = data.find(needle, pos + 1)) {
      io.seekp(static_cast<std::streamoff>(pos + 10));
      io.put(static_cast<char>(data[pos + 10] ^ 0x40));
      ++flipped;
    }
  }
  ASSERT_GT(flipped, 0);
  auto s = *BlockStore::Open({.ram_bytes = 4 * block, .disk_path = dir, .disk_bytes = 1 << 30});
  absl::StatusOr<Lease> got = s->Get(name);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_EQ(s->Stats().corruptions, 1u);
  EXPECT_EQ(s->Get(name).status().code(), absl::StatusCode::kNotFound);  // dropped
  EXPECT_EQ(s->Stats().disk_blocks, 0u);
}

// Disk space the block log's files take (holes not counted).
uint64_t LogAllocatedBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(dir) / "blocks")) {
    struct stat st {};
    if (f.is_regular_file() && stat(f.path().c_str(), &st) == 0) n += uint64_t(st.st_blocks) * 512;
  }
  return n;
}

// Blocks the disk tier evicts give their disk space back (the log punches them out, or deletes
// a file with nothing left): the files stay within the tier's capacity however much goes through.
TEST(BlockStoreTest, DiskEvictionGivesTheSpaceBack) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("space");
  auto s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 8 * block});
  for (uint32_t i = 0; i < 200; ++i) PutChain(*s, 1000 + i * 3, 1);  // unrelated chunk-0 blocks
  s->Flush();
  const StoreStats st = s->Stats();
  EXPECT_EQ(st.disk_blocks, 8u);
  EXPECT_GE(st.disk_evictions, 190u);
  const uint32_t kept = 1000 + 193 * 3;  // on disk, not in RAM (RAM holds the last two)
  absl::StatusOr<Lease> l = s->Get(Name(MakeBlock(0, 0, kept), Key(kept)));
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->served_from(), Tier::kDisk);
  l = Lease();
  s.reset();  // (closed files: no file system's preallocation past the end is counted)
  EXPECT_LE(LogAllocatedBytes(dir), 8 * (block + 8192)) << "evicted blocks kept their space";
}

// Index records naming a log file that is gone (wiped, restored without it) are dropped at open
// and counted; the file's number is never used again, so no record can name a new file's bytes.
TEST(BlockStoreTest, ALostLogFileDropsItsBlocksAndItsNumberIsNotReused) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("lostfile");
  {
    auto s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 1 << 30});
    PutChain(*s, 60, 3);
  }
  std::vector<std::string> lost;
  for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(dir) / "blocks")) {
    lost.push_back(f.path().filename().string());
    std::filesystem::remove(f.path());
  }
  ASSERT_EQ(lost.size(), 1u);
  auto s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 1 << 30});
  EXPECT_EQ(s->Stats().disk_blocks, 0u);
  EXPECT_EQ(s->Stats().corruptions, 3u);
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  EXPECT_EQ(s->Lookup(prefix, Chain(60, 3), 1).chunks, 0u);
  PutChain(*s, 60, 3);
  s->Flush();
  for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(dir) / "blocks")) {
    EXPECT_NE(f.path().filename().string(), lost[0]) << "a lost file's number was used again";
  }
  s.reset();
  s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 1 << 30});
  EXPECT_EQ(s->Lookup(prefix, Chain(60, 3), 1).chunks, 3u);
  ASSERT_TRUE(s->Get(Name(MakeBlock(0, 1, 60 + 31), Key(61))).ok());
}

// A crash between a block's append and its index entry leaves log space that nothing names: the
// next open gives it back, and the indexed blocks still read intact.
TEST(BlockStoreTest, LogSpaceACrashLeftIsGivenBackOnOpen) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("leftover");
  {
    auto s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 1 << 30});
    PutChain(*s, 50, 4);
  }
  const uint64_t indexed = LogAllocatedBytes(dir);
  {  // what a writer killed after its appends left: bytes no index entry names
    auto log = *BlockLog::Open((std::filesystem::path(dir) / "blocks").string());
    const std::vector<uint8_t> junk(3 << 20, 0x5a);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(log->Append(junk).ok());
  }
  EXPECT_GE(LogAllocatedBytes(dir), indexed + (12 << 20));
  auto s = *BlockStore::Open({.ram_bytes = 2 * block, .disk_path = dir, .disk_bytes = 1 << 30});
  EXPECT_LE(LogAllocatedBytes(dir), indexed + 8192) << "the leftover space was kept";
  for (uint32_t c = 0; c < 4; ++c) {
    absl::StatusOr<Lease> l = s->Get(Name(MakeBlock(0, c, 50 + c * 31), Key(50 + c)));
    ASSERT_TRUE(l.ok()) << l.status();
    const AlignedBuffer want = MakeBlock(0, c, 50 + c * 31);
    EXPECT_EQ(std::memcmp(l->bytes().data(), want.data(), want.size()), 0);
  }
  EXPECT_EQ(s->Stats().corruptions, 0u);
}

// A store written before the block log kept its blocks in RocksDB (an "SKV1" index record and
// the bytes under 'B' + name): they are still served, and deleted like the others.
TEST(BlockStoreTest, BlocksOfAStoreFromBeforeTheBlockLogAreStillRead) {
  const std::string dir = TempDir("v1");
  const AlignedBuffer b = MakeBlock(0, 0, 5);
  const BlockName name = Name(b, Key(77));
  {
    rocksdb::Options o;
    o.create_if_missing = true;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(o, dir, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::string meta = "SKV1";
    meta.push_back('\0');  // no parent
    for (int i = 0; i < 8; ++i) meta.push_back(static_cast<char>((b.size() >> (8 * i)) & 0xff));
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "M" + name.Encode(), meta).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "B" + name.Encode(),
                        rocksdb::Slice(reinterpret_cast<const char*>(b.data()), b.size()))
                    .ok());
  }
  auto s = *BlockStore::Open({.ram_bytes = 1 << 20, .disk_path = dir, .disk_bytes = 1 << 30});
  EXPECT_EQ(s->Stats().disk_blocks, 1u);
  absl::StatusOr<Lease> l = s->Get(name);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->served_from(), Tier::kDisk);
  EXPECT_EQ(std::memcmp(l->bytes().data(), b.data(), b.size()), 0);
  EXPECT_TRUE(s->Delete(name));
  s.reset();
  s = *BlockStore::Open({.ram_bytes = 1 << 20, .disk_path = dir, .disk_bytes = 1 << 30});
  EXPECT_EQ(s->Stats().disk_blocks, 0u);
  EXPECT_EQ(s->Get(name).status().code(), absl::StatusCode::kNotFound);
}

// The writer of KillDuringWrites, run as a fresh child process (exec of this binary): a long
// chain, writing after each Put that returned how many have.
TEST(BlockStoreChild, DISABLED_Writer) {  // not a test of its own: see below
  const char* dir = std::getenv("STRATA_STORE_CHILD_DIR");
  if (dir == nullptr) GTEST_SKIP() << "runs only as the child of KillDuringWritesLosesOnlyUnreturnedPuts";
  auto s = BlockStore::Open({.ram_bytes = 1 << 20, .disk_path = dir, .disk_bytes = 1ull << 32});
  if (!s.ok()) _exit(2);
  const std::string progress = std::string(dir) + ".progress";
  for (uint32_t c = 0;; ++c) {
    AlignedBuffer b = MakeBlock(0, c, c);
    const BlockHash parent = Key(c - 1);
    if (!(*s)->Put(Name(b, Key(c)), c == 0 ? nullptr : &parent, b.span()).ok()) _exit(3);
    // Written aside and renamed over: a kill between truncating and writing the file would
    // otherwise leave it empty, and the parent would read 0 puts returned.
    std::ofstream(progress + ".tmp", std::ios::trunc) << c + 1 << std::flush;
    std::filesystem::rename(progress + ".tmp", progress);
  }
}

// Runs BlockStoreChild.DISABLED_Writer on `dir` in a fresh child process (exec of this binary)
// until it reports `blocks` Puts returned (or `limit` passed), then kill -9s it: its exit status
// and how many Puts it saw return.
struct WriterKilled {
  int status = 0;
  uint32_t returned = 0;
};
WriterKilled KillWriterAfter(const std::string& dir, uint32_t blocks, absl::Duration limit) {
  const std::string progress = dir + ".progress";
  std::filesystem::remove(progress);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("STRATA_STORE_CHILD_DIR", dir.c_str(), 1);
    execl(self.c_str(), self.c_str(), "--gtest_filter=BlockStoreChild.DISABLED_Writer",
          "--gtest_also_run_disabled_tests", nullptr);
    _exit(4);
  }
  WriterKilled w;
  if (pid < 0) {
    ADD_FAILURE() << "fork failed";
    return w;
  }
  for (const absl::Time until = absl::Now() + limit; absl::Now() < until;) {
    usleep(10000);
    std::ifstream f(progress);
    uint32_t n = 0;
    if (f >> n && n >= blocks) break;
  }
  kill(pid, SIGKILL);
  waitpid(pid, &w.status, 0);
  std::ifstream(progress) >> w.returned;
  return w;
}

// kill -9 while a child process writes: every Put the child saw return is there after reopen.
TEST(BlockStoreTest, KillDuringWritesLosesOnlyUnreturnedPuts) {
  const std::string dir = TempDir("kill");
  const WriterKilled w = KillWriterAfter(dir, 20, absl::Seconds(10));
  ASSERT_TRUE(WIFSIGNALED(w.status)) << "the writer stopped by itself: " << w.status;
  const uint32_t returned = w.returned;
  ASSERT_GT(returned, 0u);
  auto s = *BlockStore::Open({.ram_bytes = 1 << 20, .disk_path = dir, .disk_bytes = 1ull << 32});
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  const LookupResult r = s->Lookup(prefix, Chain(0, returned + 5), 1);
  EXPECT_GE(r.chunks, returned);
  for (uint32_t c = 0; c < r.chunks; ++c) {
    absl::StatusOr<Lease> l = s->Get(Name(MakeBlock(0, c, c), Key(c)));
    ASSERT_TRUE(l.ok()) << c;
    AlignedBuffer want = MakeBlock(0, c, c);
    EXPECT_TRUE(std::equal(l->bytes().begin(), l->bytes().end(), want.data())) << c;
  }
}

// What the API used to leave open: a later chunk's block without its parent key and a first
// chunk's block with one are refused; another block under a name already stored is
// ALREADY_EXISTS and counted, the first writer's bytes staying; the same bytes again are a
// duplicate (OK).
TEST(BlockStoreTest, PutRefusesChainMistakesAndKeepsTheFirstWritersBlock) {
  auto s = *BlockStore::Open({.ram_bytes = 1 << 20});
  const AlignedBuffer b0 = MakeBlock(0, 0, 1), b1 = MakeBlock(0, 1, 2);
  const BlockHash k0 = Key(0);
  absl::Status st = s->Put(Name(b1, Key(1)), nullptr, b1.span());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("without its parent"));
  st = s->Put(Name(b0, Key(0)), &k0, b0.span());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("comes with a parent key"));
  ASSERT_TRUE(s->Put(Name(b0, Key(0)), nullptr, b0.span()).ok());
  ASSERT_TRUE(s->Put(Name(b1, Key(1)), &k0, b1.span()).ok());
  ASSERT_TRUE(s->Put(Name(b1, Key(1)), &k0, b1.span()).ok());  // the same bytes: a duplicate
  const AlignedBuffer other = MakeBlock(0, 1, 3);  // a valid block of the same chunk, other KV
  st = s->Put(Name(other, Key(1)), &k0, other.span());
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists) << st;
  absl::StatusOr<Lease> kept = s->Get(Name(b1, Key(1)));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(std::memcmp(kept->bytes().data(), b1.data(), b1.size()), 0);
  const StoreStats stats = s->Stats();
  EXPECT_EQ(stats.put_conflicts, 1u);
  EXPECT_EQ(stats.duplicate_puts, 1u);
  EXPECT_EQ(stats.refused_puts, 2u);
}

// A damaged byte in RocksDB's write-ahead log (after kill -9, before any flush) used to make
// blocks vanish silently: replay stops at the bad record and the block log's space for what it
// named was punched out as a crash's leftover. Now the block log's records name their blocks:
// what the WAL lost is indexed again from them, and what cannot be is counted, never silent.
TEST(BlockStoreTest, ADamagedWriteAheadLogLosesNoBlockTheLogCanName) {
  const std::string dir = TempDir("wal");
  const uint32_t returned = KillWriterAfter(dir, 300, absl::Seconds(30)).returned;
  ASSERT_GE(returned, 300u);
  // The WAL (RocksDB's *.log in the store's folder; the block log is in blocks/): one byte in
  // its middle flipped.
  std::string wal;
  uint64_t wal_size = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".log" && e.file_size() > wal_size) {
      wal = e.path().string();
      wal_size = e.file_size();
    }
  }
  ASSERT_FALSE(wal.empty()) << "no write-ahead log in " << dir;
  {
    std::fstream f(wal, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(wal_size / 2));
    char c = 0;
    f.get(c);
    f.seekp(static_cast<std::streamoff>(wal_size / 2));
    f.put(static_cast<char>(c ^ 0x20));
  }
  auto s = *BlockStore::Open({.ram_bytes = 1 << 20, .disk_path = dir, .disk_bytes = 1ull << 32});
  const StoreStats st = s->Stats();
  EXPECT_GT(st.index_recovered_blocks, 0u) << "the damaged WAL lost no record?";
  EXPECT_LE(st.index_lost_blocks, 1u);  // at most the block being written when killed
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  EXPECT_GE(s->Lookup(prefix, Chain(0, returned + 5), 1).chunks, returned);
  for (uint32_t c = 0; c < returned; c += 37) {
    absl::StatusOr<Lease> l = s->Get(Name(MakeBlock(0, c, c), Key(c)));
    ASSERT_TRUE(l.ok()) << c << ": " << l.status();
    const AlignedBuffer want = MakeBlock(0, c, c);
    EXPECT_EQ(std::memcmp(l->bytes().data(), want.data(), want.size()), 0) << c;
  }
  s.reset();  // what was indexed again is in the index now: the next open finds it there
  auto again = *BlockStore::Open({.ram_bytes = 1 << 20, .disk_path = dir, .disk_bytes = 1ull << 32});
  EXPECT_EQ(again->Stats().index_recovered_blocks, 0u);
  EXPECT_GE(again->Lookup(prefix, Chain(0, returned + 5), 1).chunks, returned);
}

// An index that will not open (a damaged MANIFEST) stops the store with a message offering
// --repair; with `repair`, the index is set aside and rebuilt from the block log: every block
// comes back, bytes and chains intact.
TEST(BlockStoreTest, AnIndexThatWillNotOpenIsRebuiltFromTheBlockLog) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("repair");
  {
    auto s = *BlockStore::Open({.ram_bytes = 4 * block, .disk_path = dir, .disk_bytes = 1 << 30});
    PutChain(*s, 500, 12, 2);
  }
  std::string manifest;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("MANIFEST-", 0) == 0) manifest = e.path().string();
  }
  ASSERT_FALSE(manifest.empty());
  {
    std::fstream f(manifest, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(std::filesystem::file_size(manifest));
    for (std::streamoff at = 8; at < size; at += 16) {  // damage it well
      f.seekp(at);
      f.put('\x5a');
    }
  }
  absl::StatusOr<std::unique_ptr<BlockStore>> refused =
      BlockStore::Open({.ram_bytes = 4 * block, .disk_path = dir, .disk_bytes = 1 << 30});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--repair"));
  auto s = *BlockStore::Open(
      {.ram_bytes = 4 * block, .disk_path = dir, .disk_bytes = 1 << 30, .repair = true});
  EXPECT_EQ(s->Stats().index_recovered_blocks, 24u);
  EXPECT_EQ(s->Stats().index_lost_blocks, 0u);
  const BlockName prefix = Name(MakeBlock(0, 0, 500), Key(500));
  EXPECT_EQ(s->Lookup(prefix, Chain(500, 12), 2).chunks, 12u);
  for (uint32_t c = 0; c < 12; ++c) {
    for (uint32_t l = 0; l < 2; ++l) {
      const AlignedBuffer want = MakeBlock(l, c, 500 + c * 31 + l);
      absl::StatusOr<Lease> got = s->Get(Name(want, Key(500 + c)));
      ASSERT_TRUE(got.ok()) << c << "/" << l << ": " << got.status();
      EXPECT_EQ(std::memcmp(got->bytes().data(), want.data(), want.size()), 0);
    }
  }
}

// Many clients at once (run under TSan by scripts/test.sh): puts, gets, lookups, deletes over
// shared chains with a small RAM and a disk tier; capacity and consistency hold.
TEST(BlockStoreTest, ConcurrentClients) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("concurrent");
  auto s = *BlockStore::Open({.ram_bytes = 8 * block,
                              .disk_path = dir,
                              .disk_bytes = 40 * block,
                              .spill_queue_bytes = 2 * block,
                              .durable_puts = false});
  std::vector<AlignedBuffer> blocks;
  for (uint32_t c = 0; c < 16; ++c) blocks.push_back(MakeBlock(0, c % 4, c));  // 4 chains of 4
  std::atomic<int> unexpected{0};
  // A reader follows the event feed meanwhile: ids consecutive, every block in once before out.
  std::atomic<bool> done{false};
  absl::flat_hash_set<std::string> present;  // by the events
  uint64_t after = 0;
  auto follow = [&] {
    const EventRead r = s->ReadEvents(after, 64, absl::Milliseconds(20));
    EXPECT_FALSE(r.gap);
    for (const BlockEvent& e : r.events) {
      EXPECT_EQ(e.id, after + 1);
      after = e.id;
      const bool in = present.contains(e.name.Encode());
      EXPECT_EQ(in, e.kind == BlockEventKind::kRemoved) << e.id;
      if (in) {
        present.erase(e.name.Encode());
      } else {
        present.insert(e.name.Encode());
      }
    }
    return r.events.size();
  };
  std::thread reader([&] {
    while (!done.load()) follow();
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 300; ++i) {
        const uint32_t chain = rng() % 4, c = rng() % 4;  // 4 chains of 4 chunks
        const uint32_t id = chain * 1000 + c;
        const BlockName name = Name(blocks[chain * 4 + c], Key(id));
        const BlockHash parent = Key(id - 1);
        switch (rng() % 4) {
          case 0: {
            const absl::Status st =
                s->Put(name, c == 0 ? nullptr : &parent, blocks[chain * 4 + c].span());
            if (!st.ok() && st.code() != absl::StatusCode::kFailedPrecondition) {
              ++unexpected;
              ADD_FAILURE() << st;
            }
            break;
          }
          case 1: {
            absl::StatusOr<Lease> l = s->Get(name);
            if (l.ok() && !std::equal(l->bytes().begin(), l->bytes().end(),
                                      blocks[chain * 4 + c].data())) {
              ++unexpected;
            } else if (!l.ok() && l.status().code() != absl::StatusCode::kNotFound) {
              ++unexpected;
              ADD_FAILURE() << l.status();
            }
            break;
          }
          case 2:
            s->Lookup(name, Chain(chain * 1000, 4), 1);
            break;
          default:
            if (rng() % 8 == 0) s->Delete(name);
            break;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  s->Flush();
  done = true;
  reader.join();
  while (follow() > 0) {
  }
  // What the events say is present is exactly what the store holds.
  const StoreSnapshot snap = s->Snapshot();
  EXPECT_EQ(snap.event_id, after);
  absl::flat_hash_set<std::string> held;
  for (const StoredBlock& b : snap.blocks) held.insert(b.name.Encode());
  EXPECT_EQ(held, present);
  EXPECT_GT(after, 0u);
  EXPECT_EQ(unexpected.load(), 0);
  const StoreStats st = s->Stats();
  EXPECT_LE(st.ram_bytes, 8 * block);
  EXPECT_LE(st.disk_bytes, 40 * block);
  EXPECT_EQ(st.corruptions, 0u);
}

// Per-layer codecs (the Strata mix): each layer's blocks carry that layer's own codec
// fingerprint in their header, so they are stored under it, and a lookup must name each layer's.
TEST(BlockStoreTest, LookupWithPerLayerCodecFingerprintsFindsAMixedCodecPrefix) {
  auto cal = std::make_shared<kernels::Calibration>();
  cal->codec = "strata:b3";
  cal->model_fingerprint = kModel;
  cal->kv_heads = 2;
  cal->head_dim = 64;
  cal->layers.resize(2);
  cal->layers[0].spec = "kivi:k2v2:g32";
  cal->layers[1].spec = "fp16";
  absl::StatusOr<std::unique_ptr<kernels::Codec>> codec = kernels::Codec::Create("strata:b3", cal);
  ASSERT_TRUE(codec.ok()) << codec.status();
  auto s = *BlockStore::Open({.ram_bytes = 1 << 22});
  std::vector<float> k(size_t{64} * 2 * 64, 0.5f), v(k.size(), -0.25f);
  std::vector<uint64_t> layer_codecs(2);
  BlockName prefix;
  for (uint32_t c = 0; c < 3; ++c) {
    for (uint32_t l = 0; l < 2; ++l) {
      absl::StatusOr<AlignedBuffer> b = (*codec)->Encode(
          {k.data(), v.data(), SourceDType::kFloat32, 64, 2, 64},
          {.layer = l, .chunk_index = c, .model_fingerprint = kModel});
      ASSERT_TRUE(b.ok()) << b.status();
      const BlockName name = Name(*b, Key(700 + c));
      layer_codecs[l] = name.codec_fingerprint;
      if (c == 0 && l == 0) prefix = name;
      const BlockHash parent = Key(700 + c - 1);
      ASSERT_TRUE(s->Put(name, c == 0 ? nullptr : &parent, b->span()).ok());
    }
  }
  ASSERT_NE(layer_codecs[0], layer_codecs[1]) << "the layers were to use different codecs";
  EXPECT_EQ(layer_codecs[1], Fingerprint64("fp16"));
  const LookupResult hit = s->Lookup(prefix, Chain(700, 4), layer_codecs);
  EXPECT_EQ(hit.chunks, 3u);
  EXPECT_EQ(hit.tiers, std::vector<Tier>(3, Tier::kRam));
  // One codec fingerprint for every layer (all the old Lookup could say) finds nothing.
  EXPECT_EQ(s->Lookup(prefix, Chain(700, 3), 2).chunks, 0u);
  // A layer missing from a chunk ends the hit there; a wrong fingerprint for one layer: no hit.
  BlockName last = prefix;
  last.key = Key(702);
  last.layer = 1;
  last.codec_fingerprint = layer_codecs[1];
  EXPECT_TRUE(s->Delete(last));
  EXPECT_EQ(s->Lookup(prefix, Chain(700, 3), layer_codecs).chunks, 2u);
  const std::vector<uint64_t> swapped = {layer_codecs[1], layer_codecs[0]};
  EXPECT_EQ(s->Lookup(prefix, Chain(700, 3), swapped).chunks, 0u);
  EXPECT_EQ(s->Lookup(prefix, Chain(700, 3), absl::Span<const uint64_t>()).chunks, 0u);
}

// Put(SharedBytes) keeps the caller's buffer as the RAM copy: a lease's bytes are the caller's.
// The caller's own copies do not pin the block; a lease's SharedBytes do.
TEST(BlockStoreTest, PutSharedBytesKeepsTheCallersBufferWithoutACopy) {
  const size_t block = MakeBlock(0, 0, 0).size();
  auto s = *BlockStore::Open({.ram_bytes = 2 * block, .ram_policy = PolicyKind::kLru});
  const SharedBytes a = SharedBytes::FromBuffer(MakeBlock(0, 0, 1));
  const BlockName na = Name(MakeBlock(0, 0, 1), Key(1));
  ASSERT_TRUE(s->Put(na, nullptr, a).ok());
  {
    absl::StatusOr<Lease> l = s->Get(na);
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(l->bytes().data(), a.data()) << "the store copied the block";
    EXPECT_EQ(l->shared().data(), a.data());
    EXPECT_EQ(l->shared().size(), a.size());
  }
  StoreStats st = s->Stats();
  EXPECT_EQ(st.ram_bytes, block);
  EXPECT_EQ(st.pool_idle_bytes, 0u);
  // LRU: a goes first although the caller still holds it.
  PutChain(*s, 2, 1);
  PutChain(*s, 3, 1);
  const BlockName prefix = Name(MakeBlock(0, 0, 0), Key(0));
  EXPECT_EQ(s->Lookup(prefix, Chain(1, 1), 1).chunks, 0u);
  EXPECT_EQ(s->Stats().ram_bytes, 2 * block);
  EXPECT_TRUE(BlockView::Parse(a.span()).ok()) << "the caller's bytes are the caller's";
  // SharedBytes taken from a lease pin the block after the lease is gone: 3 goes, not 2.
  const SharedBytes kept = s->Get(Name(MakeBlock(0, 0, 0), Key(2)))->shared();
  PutChain(*s, 4, 1);
  EXPECT_EQ(s->Lookup(prefix, Chain(2, 1), 1).chunks, 1u);
  EXPECT_EQ(s->Lookup(prefix, Chain(3, 1), 1).chunks, 0u);
  EXPECT_EQ(s->Stats().ram_bytes, 2 * block);
  // Bytes not on a 64-byte boundary are copied, so every lease stays aligned.
  auto backing = std::make_shared<AlignedBuffer>(block + 8);
  const AlignedBuffer b5 = MakeBlock(0, 0, 5);
  std::memcpy(backing->data() + 8, b5.data(), block);
  const SharedBytes unaligned({backing->data() + 8, block}, backing);
  const BlockName n5 = Name(b5, Key(5));
  ASSERT_TRUE(s->Put(n5, nullptr, unaligned).ok());
  absl::StatusOr<Lease> l5 = s->Get(n5);
  ASSERT_TRUE(l5.ok());
  EXPECT_NE(l5->bytes().data(), unaligned.data());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(l5->bytes().data()) % AlignedBuffer::kAlignment, 0u);
  EXPECT_TRUE(std::equal(l5->bytes().begin(), l5->bytes().end(), b5.data()));
  EXPECT_EQ(s->Stats().ram_bytes, 2 * block);
}

std::vector<std::pair<BlockEventKind, BlockHash>> KindsAndKeys(const std::vector<BlockEvent>& es) {
  std::vector<std::pair<BlockEventKind, BlockHash>> out;
  for (const BlockEvent& e : es) out.emplace_back(e.kind, e.name.key);
  return out;
}

// Every block entering the store is one kStored event, every block leaving every tier (Delete,
// its descendants, eviction without a disk) one kRemoved; ids are consecutive from 1.
TEST(BlockStoreTest, EventsNumberEveryBlockInAndOutInOrder) {
  const size_t block = MakeBlock(0, 0, 0).size();
  auto s = *BlockStore::Open({.ram_bytes = 2 * block, .ram_policy = PolicyKind::kLru});
  EXPECT_NE(s->store_id(), 0u);
  EXPECT_NE(s->store_id(), (*BlockStore::Open({}))->store_id());
  PutChain(*s, 100, 2);
  AlignedBuffer b0 = MakeBlock(0, 0, 100);
  ASSERT_TRUE(s->Put(Name(b0, Key(100)), nullptr, b0.span()).ok());  // a duplicate: no event
  const BlockHash missing = Key(99);
  const AlignedBuffer orphan = MakeBlock(0, 1, 150);
  ASSERT_EQ(s->Put(Name(orphan, Key(150)), &missing, orphan.span()).code(),
            absl::StatusCode::kFailedPrecondition);  // refused: no event
  EXPECT_TRUE(s->Delete(Name(b0, Key(100))));  // and chunk 1 with it
  PutChain(*s, 200, 1);
  PutChain(*s, 300, 1);
  PutChain(*s, 400, 1);  // evicts 200 (RAM only: gone)
  const EventRead all = s->ReadEvents(0, 100, absl::ZeroDuration());
  EXPECT_FALSE(all.gap);
  EXPECT_EQ(all.first_available_id, 1u);
  EXPECT_EQ(all.last_id, 8u);
  using K = BlockEventKind;
  const std::vector<std::pair<BlockEventKind, BlockHash>> want = {
      {K::kStored, Key(100)},  {K::kStored, Key(101)}, {K::kRemoved, Key(100)},
      {K::kRemoved, Key(101)}, {K::kStored, Key(200)}, {K::kStored, Key(300)},
      {K::kRemoved, Key(200)}, {K::kStored, Key(400)}};
  EXPECT_EQ(KindsAndKeys(all.events), want);
  for (size_t i = 0; i < all.events.size(); ++i) {
    const BlockEvent& e = all.events[i];
    EXPECT_EQ(e.id, i + 1);
    EXPECT_EQ(e.tier, e.kind == K::kStored ? Tier::kRam : Tier::kNone) << e.id;
    EXPECT_EQ(e.name.model_fingerprint, kModel);
  }
  const EventRead some = s->ReadEvents(5, 2, absl::ZeroDuration());
  ASSERT_EQ(some.events.size(), 2u);
  EXPECT_EQ(some.events[0].id, 6u);
  EXPECT_EQ(some.events[1].id, 7u);
  const EventRead none = s->ReadEvents(8, 10, absl::Milliseconds(1));  // times out
  EXPECT_TRUE(none.events.empty());
  EXPECT_FALSE(none.gap);
  EXPECT_TRUE(s->ReadEvents(9, 10, absl::Hours(1)).gap) << "an id from the future";
}

// A reader that fell behind the ring is told (gap) and resumes from a snapshot.
TEST(BlockStoreTest, AReaderBehindTheRingSeesAGapAndResumesFromASnapshot) {
  auto s = *BlockStore::Open({.ram_bytes = 1 << 22, .event_ring = 4});
  for (uint32_t i = 0; i < 6; ++i) PutChain(*s, 10 * i + 10, 1);  // events 1..6; the ring: 3..6
  const EventRead behind = s->ReadEvents(1, 100, absl::Hours(1));  // (a gap answers at once)
  EXPECT_TRUE(behind.gap);
  EXPECT_TRUE(behind.events.empty());
  EXPECT_EQ(behind.first_available_id, 3u);
  const EventRead in_ring = s->ReadEvents(2, 100, absl::ZeroDuration());
  EXPECT_FALSE(in_ring.gap);
  ASSERT_EQ(in_ring.events.size(), 4u);
  EXPECT_EQ(in_ring.events.front().id, 3u);
  const StoreSnapshot snap = s->Snapshot();
  EXPECT_EQ(snap.event_id, 6u);
  std::vector<BlockHash> keys;
  for (const StoredBlock& b : snap.blocks) {
    keys.push_back(b.name.key);
    EXPECT_EQ(b.tier, Tier::kRam);
  }
  EXPECT_THAT(keys, testing::UnorderedElementsAreArray(
                        {Key(10), Key(20), Key(30), Key(40), Key(50), Key(60)}));
  EXPECT_TRUE(s->Delete(Name(MakeBlock(0, 0, 0), Key(30))));
  const EventRead next = s->ReadEvents(snap.event_id, 100, absl::ZeroDuration());
  ASSERT_EQ(next.events.size(), 1u);
  EXPECT_EQ(next.events[0].id, 7u);
  EXPECT_EQ(next.events[0].kind, BlockEventKind::kRemoved);
  EXPECT_EQ(next.events[0].name.key, Key(30));
}

TEST(BlockStoreTest, ReadEventsWaitsForTheNextEvent) {
  auto s = *BlockStore::Open({.ram_bytes = 1 << 22});
  EventRead got;
  std::thread reader([&] { got = s->ReadEvents(0, 10, absl::Seconds(60)); });
  const absl::Time t0 = absl::Now();
  PutChain(*s, 1, 1);
  reader.join();  // woken by the Put (or it saw the event at once)
  EXPECT_LT(absl::Now() - t0, absl::Seconds(30));
  ASSERT_EQ(got.events.size(), 1u);
  EXPECT_EQ(got.events[0].kind, BlockEventKind::kStored);
}

// With a disk tier: blocks found at Open are in the snapshot, not in events; leaving RAM for
// disk is no event; leaving the disk for good is.
TEST(BlockStoreTest, EventsWithADiskTier) {
  const size_t block = MakeBlock(0, 0, 0).size();
  const std::string dir = TempDir("events");
  uint64_t first_id = 0;
  {
    auto s = *BlockStore::Open({.ram_bytes = block, .disk_path = dir, .disk_bytes = 2 * block});
    first_id = s->store_id();
    PutChain(*s, 10, 1);
    PutChain(*s, 20, 1);  // 10 leaves RAM (its disk copy stays): no event
    EXPECT_EQ(s->ReadEvents(0, 10, absl::ZeroDuration()).events.size(), 2u);
    PutChain(*s, 30, 1);  // the disk evicts 10, which is in no tier then
    const EventRead r = s->ReadEvents(2, 10, absl::ZeroDuration());
    ASSERT_EQ(r.events.size(), 2u);
    EXPECT_EQ(r.events[0].kind, BlockEventKind::kRemoved);
    EXPECT_EQ(r.events[0].name.key, Key(10));
    EXPECT_EQ(r.events[1].kind, BlockEventKind::kStored);
    EXPECT_EQ(r.events[1].name.key, Key(30));
    const StoreSnapshot snap = s->Snapshot();
    ASSERT_EQ(snap.blocks.size(), 2u);
    for (const StoredBlock& b : snap.blocks) {
      EXPECT_EQ(b.tier, b.name.key == Key(30) ? Tier::kRam : Tier::kDisk);
    }
  }
  auto s = *BlockStore::Open({.ram_bytes = block, .disk_path = dir, .disk_bytes = 2 * block});
  EXPECT_NE(s->store_id(), first_id);
  const EventRead r = s->ReadEvents(0, 10, absl::ZeroDuration());
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(r.last_id, 0u);
  const StoreSnapshot snap = s->Snapshot();
  EXPECT_EQ(snap.event_id, 0u);
  EXPECT_EQ(snap.blocks.size(), 2u);
}

}  // namespace
}  // namespace strata::kvstore

namespace strata::kvstore {
namespace {

// A node's RAM tier in front of the shared store: Lookup is the longer prefix of the two, Get
// reads the local tier first, Puts reach both (the shared store's answers count), and with the
// shared store gone the node still finds what it holds.
TEST(TieredBlockSourceTest, LocalTierFirstSharedStoreBehindIt) {
  auto local = *BlockStore::Open({.ram_bytes = 64 << 20});
  auto shared = *BlockStore::Open({.ram_bytes = 64 << 20});
  EmbeddedBlockSource remote(shared.get());
  TieredBlockSource tiered(local.get(), &remote);
  std::vector<AlignedBuffer> blocks;
  std::vector<BlockHash> chain;
  for (uint32_t c = 0; c < 4; ++c) {
    blocks.push_back(MakeBlock(0, c, 70 + c));
    chain.push_back(Key(700 + c));
  }
  const BlockName prefix = Name(blocks[0], chain[0]);
  const uint64_t fp[] = {prefix.codec_fingerprint};
  // Chunks 0-2 in the shared store only (another node computed them).
  for (uint32_t c = 0; c < 3; ++c) {
    ASSERT_TRUE(shared->Put(Name(blocks[c], chain[c]), c > 0 ? &chain[c - 1] : nullptr,
                            blocks[c].span()).ok());
  }
  EXPECT_EQ(*tiered.Lookup(prefix, chain, fp), 3u);
  ASSERT_TRUE(tiered.Get(Name(blocks[1], chain[1])).ok());
  EXPECT_EQ(tiered.stats().remote_hits, 1u);
  // This node computes all 4: both tiers get them (the shared store's answers returned).
  std::vector<PutItem> items;
  for (uint32_t c = 0; c < 4; ++c) {
    items.push_back({.name = Name(blocks[c], chain[c]),
                     .parent = c > 0 ? std::optional<BlockHash>(chain[c - 1]) : std::nullopt,
                     .block = SharedBytes::FromBuffer(MakeBlock(0, c, 70 + c))});
  }
  absl::StatusOr<std::vector<absl::Status>> put = tiered.PutMany(items);
  ASSERT_TRUE(put.ok()) << put.status();
  for (const absl::Status& st : *put) EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(local->Lookup(prefix, chain, fp).chunks, 4u);
  EXPECT_EQ(shared->Lookup(prefix, chain, fp).chunks, 4u);
  absl::StatusOr<SharedBytes> got = tiered.Get(Name(blocks[3], chain[3]));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(tiered.stats().local_hits, 1u);
  EXPECT_EQ(std::memcmp(got->data(), blocks[3].data(), blocks[3].size()), 0);
  EXPECT_FALSE(tiered.verified_on_get());  // the shared store's bytes are verified on use
  // A block the shared store refuses (its parent is only in this node's tier) is still stored
  // for the node: it reads it back; the store's refusal is counted.
  const AlignedBuffer n0 = MakeBlock(0, 0, 90), n1 = MakeBlock(0, 1, 91);
  const BlockHash k90 = Key(790);
  ASSERT_TRUE(local->Put(Name(n0, k90), nullptr, n0.span()).ok());
  EXPECT_TRUE(tiered.Put(Name(n1, Key(791)), &k90, SharedBytes::FromBuffer(MakeBlock(0, 1, 91))).ok());
  EXPECT_EQ(tiered.stats().remote_put_errors, 1u);
  EXPECT_TRUE(tiered.Get(Name(n1, Key(791))).ok());
  // Without a shared store (or with it gone), the local tier answers alone.
  TieredBlockSource alone(local.get(), nullptr);
  EXPECT_EQ(*alone.Lookup(prefix, chain, fp), 4u);
  EXPECT_TRUE(alone.verified_on_get());
  EXPECT_EQ(alone.Get(Name(MakeBlock(0, 9, 1), Key(799))).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::kvstore
