// The ring allocator a BlockSender places blocks with (sender_ring.h): lowest fit, 256-byte
// steps with the progress word, coalescing on release, streamed blocks freed when their copy
// stops, and doubtful space counted only when it would make room.
#include "transport/internal/sender_ring.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "transport/block_protocol.h"

namespace strata::transport::internal {
namespace {

TEST(SenderRingTest, BlocksTakeTheLowestFreeSpaceInStepsOf256WithTheirProgressWord) {
  std::vector<uint8_t> mem(4096);
  SenderRing ring;
  ring.Lend(mem);
  EXPECT_EQ(ring.state, SenderRing::State::kReady);
  EXPECT_EQ(SenderRing::Need(1), 256u);
  EXPECT_EQ(SenderRing::Need(256 - kPlacedPrefixBytes), 256u);
  EXPECT_EQ(SenderRing::Need(257 - kPlacedPrefixBytes), 512u);
  EXPECT_EQ(SenderRing::Need(0), 256u);
  EXPECT_EQ(ring.Allocate(100, 1), kPlacedPrefixBytes);
  EXPECT_EQ(ring.Allocate(500, 2), 256 + kPlacedPrefixBytes);
  EXPECT_EQ(ring.Allocate(100, 3), 1024 + kPlacedPrefixBytes);
  EXPECT_EQ(ring.free_bytes(), 4096u - 256 - 768 - 256);
  // Freed space is reused first, lowest first.
  EXPECT_TRUE(ring.Release(kPlacedPrefixBytes));
  EXPECT_EQ(ring.Allocate(10, 4), kPlacedPrefixBytes);
  // Nothing fits a block larger than the largest free extent.
  EXPECT_FALSE(ring.Allocate(4096, 5).has_value());
}

TEST(SenderRingTest, ReleasedNeighboursCoalesceAndUnknownOffsetsAreIgnored) {
  std::vector<uint8_t> mem(1024);
  SenderRing ring;
  ring.Lend(mem);
  const uint64_t a = *ring.Allocate(100, 1), b = *ring.Allocate(100, 2), c = *ring.Allocate(100, 3),
                 d = *ring.Allocate(100, 4);
  EXPECT_FALSE(ring.Allocate(1, 5).has_value());  // full
  EXPECT_FALSE(ring.Release(a + 8));              // not a block's offset
  EXPECT_TRUE(ring.Release(b));
  EXPECT_TRUE(ring.Release(d));
  EXPECT_FALSE(ring.Allocate(600, 6).has_value());  // b and d are not adjacent
  EXPECT_TRUE(ring.Release(c));                     // b, c and d join
  EXPECT_FALSE(ring.Release(c));                    // once only
  EXPECT_EQ(ring.Allocate(700, 7), b);
  EXPECT_TRUE(ring.Release(a));
  EXPECT_EQ(ring.free_bytes(), 256u);
}

TEST(SenderRingTest, AStreamedBlockReleasedWhileCopyingIsFreedWhenItsCopyStops) {
  std::vector<uint8_t> mem(512);
  SenderRing ring;
  ring.Lend(mem);
  const uint64_t a = *ring.Allocate(100, 1);
  ring.CopyStarted(a);
  EXPECT_TRUE(ring.Release(a));  // given back by the receiver while still being written
  EXPECT_EQ(ring.free_bytes(), 256u);
  ring.CopyStopped(a);
  EXPECT_EQ(ring.free_bytes(), 512u);
  // Not released during its copy: the space stays used.
  const uint64_t b = *ring.Allocate(100, 2);
  ring.CopyStarted(b);
  ring.CopyStopped(b);
  EXPECT_EQ(ring.free_bytes(), 256u);
  EXPECT_TRUE(ring.Release(b));
  EXPECT_EQ(ring.free_bytes(), 512u);
}

TEST(SenderRingTest, DoubtfulSpaceMakesRoomOnlyOnceItIsOldEnoughAndOnlyItsOwnTransfers) {
  std::vector<uint8_t> mem(1024);
  SenderRing ring;
  ring.Lend(mem);
  const absl::Time t0 = absl::UnixEpoch() + absl::Hours(1);
  const uint64_t a = *ring.Allocate(400, 1), b = *ring.Allocate(400, 2);
  EXPECT_FALSE(ring.Allocate(400, 3).has_value());
  EXPECT_FALSE(ring.FitsIfReclaimed(400, t0));  // nothing doubtful
  ring.Unanswered(a, /*seq=*/99, t0);           // not a's transfer: ignored
  EXPECT_FALSE(ring.FitsIfReclaimed(400, t0));
  ring.Unanswered(a, 1, t0);
  EXPECT_FALSE(ring.FitsIfReclaimed(400, t0 - absl::Seconds(1)));  // too recent
  EXPECT_TRUE(ring.FitsIfReclaimed(400, t0));
  EXPECT_FALSE(ring.FitsIfReclaimed(900, t0));  // a's space alone is not enough
  ring.Unanswered(b, 2, t0);
  EXPECT_TRUE(ring.FitsIfReclaimed(900, t0));
  // A release after all settles it.
  EXPECT_TRUE(ring.Release(a));
  EXPECT_TRUE(ring.Release(b));
  EXPECT_FALSE(ring.FitsIfReclaimed(400, t0));
  EXPECT_EQ(ring.free_bytes(), 1024u);
}

}  // namespace
}  // namespace strata::transport::internal
