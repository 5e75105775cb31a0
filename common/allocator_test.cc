#include "common/allocator.h"

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "gtest/gtest.h"

namespace strata {
namespace {

// This test is linked as the service's programs are (strata_use_allocator): where CMake chose
// jemalloc, it must be the malloc the process resolves (a link that dropped it, as --as-needed
// would, leaves glibc's).
TEST(AllocatorTest, TheProgramsMallocIsTheOneTheBuildChose) {
#if defined(STRATA_LINKS_JEMALLOC)
  EXPECT_EQ(AllocatorName().rfind("jemalloc ", 0), 0u) << AllocatorName();
#else
  EXPECT_EQ(AllocatorName(), "system malloc");
#endif
}

// What a shared-tier Get does: a batch of 8 blocks of 1 MiB allocated, written whole and freed,
// on a thread other than main, 16 times over. After the first batch jemalloc hands back memory
// already faulted in, which is what the programs link it for. glibc, in a thread's arena,
// returns the freed batch to the system and faults every 4 KiB page in again: 30,081 of 30,720
// pages, measured with this same loop.
#if defined(STRATA_LINKS_JEMALLOC)
long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}
#endif

TEST(AllocatorTest, FreedLargeBlocksComeBackWithoutPageFaults) {
#if defined(STRATA_LINKS_JEMALLOC)
  constexpr size_t kBlock = size_t{1} << 20;
  long faults = -1;
  std::thread([&] {
    auto batch = [] {
      void* blocks[8];
      for (void*& p : blocks) {
        p = std::aligned_alloc(64, kBlock);
        std::memset(p, 1, kBlock);
      }
      for (void* p : blocks) std::free(p);
    };
    batch();
    const long before = MinorFaults();
    for (int i = 0; i < 15; ++i) batch();
    faults = MinorFaults() - before;
  }).join();
  EXPECT_GE(faults, 0);
  EXPECT_LT(faults, 256) << "15 batches of 8 blocks of 256 pages";
#else
  GTEST_SKIP() << "this build links the system's malloc (STRATA_ALLOCATOR, or a sanitizer)";
#endif
}

}  // namespace
}  // namespace strata
