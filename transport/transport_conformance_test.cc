// The transport contract every backend keeps (transport.h): what an endpoint says it runs over,
// one-sided Put, mapping a same-host peer's memory, connecting to nobody. The block protocol over
// the same backends is block_protocol_conformance_test.cc.
#include <cstring>
#include <future>
#include <iostream>
#include <string>
#include <vector>

#include "transport/testing/backend_fixture.h"

namespace strata::transport {
namespace {

using testing::Backend;
using ::testing::HasSubstr;
using testing::RandomBytes;

class TransportConformanceTest : public testing::BackendTest {};

// The endpoint says what it runs over; the UCX variants run over the transports they name.
TEST_P(TransportConformanceTest, DescribesWhatTheConnectionRunsOver) {
  Start();
  const std::string d = peer_->Describe();
  std::cout << GetParam().name << ": " << d << "\n";
  EXPECT_THAT(d, HasSubstr(receiver_transport_->address()));
  if (GetParam().name == "ucx_tcp") {
    EXPECT_THAT(d, HasSubstr("tcp"));
  }
  if (GetParam().name == "ucx_shm") {
    EXPECT_THAT(d, ::testing::ContainsRegex("posix|sysv|cma"));
  }
}

// The raw transport: one-sided Put where the backend has it.
TEST_P(TransportConformanceTest, PutWritesIntoThePeersRegisteredRegion) {
  if (!sender_transport_->capabilities().one_sided) GTEST_SKIP() << "backend is not one-sided";
  Start();
  std::vector<uint8_t> target(1 << 20, 0);
  auto region = receiver_transport_->Register(target.data(), target.size(), MemoryKind::kHost);
  ASSERT_TRUE(region.ok()) << region.status();
  auto desc = (*region)->RemoteDescriptor();
  ASSERT_TRUE(desc.ok()) << desc.status();
  const auto data = RandomBytes(300000, 10);
  auto src = sender_transport_->Register(const_cast<uint8_t*>(data.data()), data.size(),
                                         MemoryKind::kHost);
  ASSERT_TRUE(src.ok());
  std::promise<absl::Status> done;
  peer_->Put({.bytes = {data.data(), data.size()}, .region = src->get()}, *desc, 4096,
             absl::Seconds(10), [&](absl::Status s) { done.set_value(s); });
  ASSERT_TRUE(done.get_future().get().ok());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), target.begin() + 4096));
  EXPECT_EQ(target[4095], 0);
  EXPECT_EQ(target[4096 + data.size()], 0);

  std::promise<absl::Status> overrun;
  peer_->Put({.bytes = {data.data(), data.size()}}, *desc, target.size() - 10, absl::Seconds(10),
             [&](absl::Status s) { overrun.set_value(s); });
  EXPECT_EQ(overrun.get_future().get().code(), absl::StatusCode::kOutOfRange);
  std::promise<absl::Status> garbage;
  peer_->Put({.bytes = {data.data(), 10}}, "not a descriptor", 0, absl::Seconds(10),
             [&](absl::Status s) { garbage.set_value(s); });
  EXPECT_EQ(garbage.get_future().get().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(TransportConformanceTest, MapGivesSameHostSharedMemoryOrSaysItCannot) {
  Start();
  auto region = receiver_transport_->Allocate(1 << 20, MemoryKind::kHost);
  ASSERT_TRUE(region.ok()) << region.status();
  auto desc = (*region)->RemoteDescriptor();
  if (!desc.ok()) {
    EXPECT_EQ(desc.status().code(), absl::StatusCode::kUnimplemented) << desc.status();
    EXPECT_EQ(peer_->Map("x").status().code(), absl::StatusCode::kUnimplemented);
    return;
  }
  absl::StatusOr<std::span<uint8_t>> mapped = peer_->Map(*desc);
  if (GetParam().name != "ucx_shm") {  // another transport or no shared memory: refused cleanly
    EXPECT_EQ(mapped.status().code(), absl::StatusCode::kUnimplemented) << mapped.status();
    return;
  }
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  ASSERT_EQ(mapped->size(), size_t{1} << 20);
  const auto data = RandomBytes(mapped->size(), 12);
  std::memcpy(mapped->data(), data.data(), data.size());
  EXPECT_EQ(std::memcmp((*region)->data(), data.data(), data.size()), 0)
      << "stores through the mapping are the peer's memory";
  EXPECT_EQ(peer_->Map("not a descriptor").status().code(), absl::StatusCode::kInvalidArgument);
  // The mapping outlives the peer's region (the memory stays attached while we hold the
  // endpoint): writing after the peer freed it must not fault.
  region->reset();
  (*mapped)[0] = 1;
}

TEST_P(TransportConformanceTest, ConnectToNobodyIsUnavailableAndBadAddressInvalid) {
  Start();
  const std::string nobody =
      GetParam().name == "inproc" ? "inproc://nobody-here" : "ucx://127.0.0.1:1";
  auto ep = sender_transport_->Connect(nobody, absl::Seconds(5));
  EXPECT_EQ(ep.status().code(), absl::StatusCode::kUnavailable) << ep.status();
  auto bad = sender_transport_->Connect("no-scheme-no-port", absl::Seconds(1));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportConformanceTest,
                         ::testing::ValuesIn(testing::AllBackends()), testing::BackendName);

}  // namespace
}  // namespace strata::transport
