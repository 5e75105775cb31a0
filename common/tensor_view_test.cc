#include "common/tensor_view.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace strata {
namespace {

TEST(TensorViewTest, ContiguousViewIsRowMajor) {
  std::vector<int> buf(2 * 3 * 4);
  std::iota(buf.begin(), buf.end(), 0);
  TensorView<int, 3> t(buf.data(), {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(1), 4);
  EXPECT_EQ(t.stride(2), 1);
  EXPECT_EQ(t(1, 2, 3), 23);
  EXPECT_EQ(t(0, 1, 2), 6);
  t(1, 0, 0) = -1;
  EXPECT_EQ(buf[12], -1);
}

TEST(TensorViewTest, SelectSliceAndTransposeAddressTheRightElements) {
  std::vector<int> buf(5 * 3 * 4);  // [tokens=5, heads=3, dim=4]
  std::iota(buf.begin(), buf.end(), 0);
  TensorView<const int, 3> t(buf.data(), {5, 3, 4});
  TensorView<const int, 2> head1 = t.Select(1, 1);  // [tokens, dim]
  EXPECT_EQ(head1.size(0), 5);
  EXPECT_EQ(head1.size(1), 4);
  EXPECT_FALSE(head1.is_contiguous());
  for (int tok = 0; tok < 5; ++tok) {
    for (int d = 0; d < 4; ++d) EXPECT_EQ(head1(tok, d), tok * 12 + 4 + d);
  }
  TensorView<const int, 3> mid = t.Slice(0, 2, 4);
  EXPECT_EQ(mid.size(0), 2);
  EXPECT_EQ(mid(0, 0, 0), 24);
  EXPECT_TRUE(mid.is_contiguous());
  TensorView<const int, 2> tr = head1.Transpose(0, 1);  // [dim, tokens]
  EXPECT_EQ(tr.size(0), 4);
  EXPECT_EQ(tr(3, 2), head1(2, 3));
  TensorView<const int, 3> empty = t.Slice(0, 3, 3);
  EXPECT_TRUE(empty.empty());
}

TEST(TensorViewTest, ZeroStrideBroadcastsAndMutableConvertsToConst) {
  std::vector<float> row = {1, 2, 3};
  TensorView<float, 2> b(row.data(), {4, 3}, {0, 1});
  EXPECT_EQ(b(3, 2), 3.0f);
  EXPECT_FALSE(b.is_contiguous());
  TensorView<const float, 2> c = b;
  EXPECT_EQ(c(0, 1), 2.0f);
  EXPECT_EQ(c.data(), row.data());
}

TEST(TensorViewTest, SizeOneDimensionsDoNotBreakContiguity) {
  std::vector<int> buf(8);
  TensorView<int, 3> t(buf.data(), {1, 2, 4}, {999, 4, 1});
  EXPECT_TRUE(t.is_contiguous());
}

#ifndef NDEBUG
TEST(TensorViewDeathTest, OutOfBoundsIndexIsCaughtInDebugBuilds) {
  std::vector<int> buf(6);
  TensorView<int, 2> t(buf.data(), {2, 3});
  EXPECT_DEATH(t(2, 0), "index out of bounds");
}
#endif

}  // namespace
}  // namespace strata
