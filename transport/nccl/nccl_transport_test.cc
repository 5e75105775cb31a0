// The NCCL transport, for real: NCCL send/recv on a CUDA device, headers over the in-process host
// transport. On one GPU a transport sends to itself (a one-rank communicator: NCCL's send to
// self); with two GPUs two transports send to each other. Without a GPU the GPU tests skip and
// say why, and the refusal itself is checked.
#include "transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "transport/inproc/inproc_transport.h"

namespace strata::transport {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(60);

int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::shared_ptr<Transport> Inproc() {
  auto t = CreateInprocTransport({});
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::shared_ptr<Transport>(*std::move(t)) : nullptr;
}

// Why there is no GPU, in the words scripts/test.sh collects ("skipped, no GPU: ...").
std::string NoGpu() {
  auto t = CreateNcclTransport({.host = Inproc()});
  return absl::StrCat("skipped, no GPU: ", t.ok() ? "?" : t.status().message());
}

// A completion the test waits for.
struct Done {
  std::promise<absl::Status> p;
  std::future<absl::Status> f = p.get_future();
  Completion fn() {
    return [this](absl::Status s) { p.set_value(std::move(s)); };
  }
  absl::Status Wait() {
    if (f.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      return absl::DeadlineExceededError("the test gave up waiting for a completion");
    }
    return f.get();
  }
};

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> CopyBack(const MemoryRegion& r, size_t n) {
  std::vector<uint8_t> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), r.data(), n, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

TEST(NcclTransportTest, RefusesToStartWithoutAHostTransport) {
  auto t = CreateNcclTransport({});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("host is required"));
}

TEST(NcclTransportTest, WithoutAGpuCreationFailsAndSaysWhy) {
  if (GpuCount() > 0) GTEST_SKIP() << "this machine has a GPU; the GPU tests cover it";
  auto t = CreateNcclTransport({.host = Inproc()});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(t.status().message(), HasSubstr("needs a CUDA device"));
}

TEST(NcclTransportTest, ReportsTheNcclVersionItRunsWith) {
  const std::string v = NcclVersion();
  EXPECT_TRUE(v.starts_with("2.")) << v;  // the API used is NCCL 2's
}

// A transport connected to itself; skips without a GPU.
class NcclSelfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (GpuCount() == 0) GTEST_SKIP() << NoGpu();
    auto t = CreateNcclTransport({.host = Inproc(), .device = 0});
    ASSERT_TRUE(t.ok()) << t.status();
    t_ = *std::move(t);
    auto ep = t_->Connect(t_->address(), absl::Seconds(10));
    ASSERT_TRUE(ep.ok()) << ep.status();
    ep_ = *std::move(ep);
  }

  std::unique_ptr<MemoryRegion> Device(size_t n) {
    auto r = t_->Allocate(n, MemoryKind::kDevice);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  std::unique_ptr<Transport> t_;
  std::shared_ptr<Endpoint> ep_;
};

TEST_F(NcclSelfTest, DevicePayloadsOfEverySizeArriveWithTheirHeader) {
  EXPECT_EQ(t_->capabilities().backend, "nccl");
  EXPECT_TRUE(t_->capabilities().device_memory);
  EXPECT_THAT(ep_->Describe(), HasSubstr("to itself"));
  for (size_t size : {size_t{1}, size_t{4095}, size_t{1} << 20, size_t{64} << 20}) {
    SCOPED_TRACE(size);
    const std::vector<uint8_t> bytes = Pattern(size, static_cast<uint32_t>(size));
    auto src = Device(size);
    auto dst = Device(size);
    ASSERT_TRUE(src && dst);
    ASSERT_EQ(cudaMemcpy(src->data(), bytes.data(), size, cudaMemcpyHostToDevice), cudaSuccess);
    Done sent, received;
    std::string header_seen;
    t_->SetHandler(7, [&](IncomingMessage& m) {
      header_seen.assign(m.header().begin(), m.header().end());
      EXPECT_EQ(m.payload_size(), size);
      m.Accept(Destination{{dst->data(), size}, dst.get()}, received.fn());
    });
    const std::string header = "layer 3";
    ep_->Send(7, {reinterpret_cast<const uint8_t*>(header.data()), header.size()},
              Payload{{src->data(), size}, src.get()}, kWait, sent.fn());
    ASSERT_TRUE(sent.Wait().ok());
    ASSERT_TRUE(received.Wait().ok());
    EXPECT_EQ(header_seen, header);
    EXPECT_TRUE(CopyBack(*dst, size) == bytes);
  }
}

TEST_F(NcclSelfTest, ManyTransfersInFlightKeepTheirBytes) {
  constexpr int kCount = 64;
  constexpr size_t kSize = 256 << 10;
  auto src = Device(kCount * kSize);
  auto dst = Device(kCount * kSize);
  ASSERT_TRUE(src && dst);
  const std::vector<uint8_t> bytes = Pattern(kCount * kSize, 42);
  ASSERT_EQ(cudaMemcpy(src->data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<Done> sent(kCount), received(kCount);
  t_->SetHandler(1, [&](IncomingMessage& m) {
    const uint8_t i = m.header()[0];
    m.Accept(Destination{{dst->data() + i * kSize, kSize}, dst.get()}, received[i].fn());
  });
  for (int i = kCount - 1; i >= 0; --i) {  // the destinations are filled out of order
    const uint8_t h = static_cast<uint8_t>(i);
    ep_->Send(1, {&h, 1}, Payload{{src->data() + i * kSize, kSize}, src.get()}, kWait,
              sent[i].fn());
  }
  for (int i = 0; i < kCount; ++i) {
    ASSERT_TRUE(sent[i].Wait().ok()) << i;
    ASSERT_TRUE(received[i].Wait().ok()) << i;
  }
  EXPECT_TRUE(CopyBack(*dst, bytes.size()) == bytes);
}

TEST_F(NcclSelfTest, HostPayloadsTravelOverTheHostTransport) {
  const std::vector<uint8_t> bytes = Pattern(100000, 5);
  std::vector<uint8_t> got(bytes.size());
  Done sent, received;
  t_->SetHandler(2, [&](IncomingMessage& m) {
    m.Accept(Destination{{got.data(), got.size()}, nullptr}, received.fn());
  });
  ep_->Send(2, {}, Payload{{bytes.data(), bytes.size()}, nullptr}, kWait, sent.fn());
  ASSERT_TRUE(sent.Wait().ok());
  ASSERT_TRUE(received.Wait().ok());
  EXPECT_TRUE(got == bytes);
}

TEST_F(NcclSelfTest, ADevicePayloadNobodyAcceptsCompletesTheSender) {
  auto src = Device(4096);
  ASSERT_TRUE(src);
  Done sent;
  ep_->Send(3, {}, Payload{{src->data(), 4096}, src.get()}, kWait, sent.fn());  // no handler
  EXPECT_TRUE(sent.Wait().ok());
  EXPECT_TRUE(ep_->health().ok());
}

TEST_F(NcclSelfTest, ADevicePayloadIsNotAcceptedIntoHostMemory) {
  auto src = Device(4096);
  ASSERT_TRUE(src);
  std::vector<uint8_t> host(4096);
  Done sent, received;
  t_->SetHandler(4, [&](IncomingMessage& m) {
    m.Accept(Destination{{host.data(), host.size()}, nullptr}, received.fn());
  });
  ep_->Send(4, {}, Payload{{src->data(), 4096}, src.get()}, kWait, sent.fn());
  const absl::Status r = received.Wait();
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.message(), HasSubstr("host memory"));
  EXPECT_TRUE(sent.Wait().ok());  // refused by the handler's Accept: dropped, as elsewhere
  EXPECT_TRUE(ep_->health().ok());
}

TEST_F(NcclSelfTest, ATimeoutAfterTheAnnouncementResetsTheLinkAndFailsBothSides) {
  auto src = Device(4096);
  auto dst = Device(4096);
  ASSERT_TRUE(src && dst);
  Done sent, received;
  t_->SetHandler(5, [&](IncomingMessage& m) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // past the sender's timeout
    m.Accept(Destination{{dst->data(), 4096}, dst.get()}, received.fn());
  });
  ep_->Send(5, {}, Payload{{src->data(), 4096}, src.get()}, absl::Milliseconds(100), sent.fn());
  EXPECT_EQ(sent.Wait().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(received.Wait().code(), absl::StatusCode::kUnavailable);  // never handed on
  EXPECT_EQ(ep_->health().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(ep_->health().message(), HasSubstr("reset"));
  // A new connection works.
  auto again = t_->Connect(t_->address(), absl::Seconds(10));
  ASSERT_TRUE(again.ok()) << again.status();
  Done sent2, received2;
  t_->SetHandler(5, [&](IncomingMessage& m) {
    m.Accept(Destination{{dst->data(), 4096}, dst.get()}, received2.fn());
  });
  (*again)->Send(5, {}, Payload{{src->data(), 4096}, src.get()}, kWait, sent2.fn());
  EXPECT_TRUE(sent2.Wait().ok());
  EXPECT_TRUE(received2.Wait().ok());
}

TEST_F(NcclSelfTest, ShuttingDownFailsTransfersInFlight) {
  auto src = Device(4096);
  auto dst = Device(4096);
  ASSERT_TRUE(src && dst);
  Done sent, received;
  std::promise<void> in_handler;
  t_->SetHandler(6, [&](IncomingMessage& m) {
    in_handler.set_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    m.Accept(Destination{{dst->data(), 4096}, dst.get()}, received.fn());
  });
  ep_->Send(6, {}, Payload{{src->data(), 4096}, src.get()}, kWait, sent.fn());
  ASSERT_EQ(in_handler.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  t_.reset();
  const absl::Status s = sent.Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(received.Wait().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ep_->health().code(), absl::StatusCode::kUnavailable);
}

TEST_F(NcclSelfTest, BadArgumentsAreRefusedWithTheReason) {
  std::vector<uint8_t> host(64);
  auto r = t_->Register(host.data(), host.size(), MemoryKind::kDevice);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("is not memory of CUDA device 0"));
  Done put;
  ep_->Put(Payload{}, "x", 0, kWait, put.fn());
  EXPECT_EQ(put.Wait().code(), absl::StatusCode::kUnimplemented);
  auto bad = t_->Connect("ucx://127.0.0.1:1", absl::Seconds(1));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> big(t_->max_header_size() + 1);
  Done too_big;
  ep_->Send(0, big, Payload{}, kWait, too_big.fn());
  EXPECT_EQ(too_big.Wait().code(), absl::StatusCode::kInvalidArgument);
}

// Two transports on one GPU: NCCL refuses two ranks on one device, and Connect says so.
TEST(NcclTransportTest, TwoTransportsOnOneGpuCannotConnectAndSayWhy) {
  if (GpuCount() == 0) GTEST_SKIP() << NoGpu();
  if (GpuCount() != 1) GTEST_SKIP() << "needs exactly one GPU (this machine has " << GpuCount() << ")";
  auto a = CreateNcclTransport({.host = Inproc(), .setup_timeout = absl::Seconds(20)});
  auto b = CreateNcclTransport({.host = Inproc(), .setup_timeout = absl::Seconds(20)});
  ASSERT_TRUE(a.ok() && b.ok());
  auto ep = (*a)->Connect((*b)->address(), absl::Seconds(5));
  ASSERT_FALSE(ep.ok());
  EXPECT_EQ(ep.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(ep.status().message(), HasSubstr("NCCL"));
  std::cout << "NCCL's answer: " << ep.status().message() << "\n";
}

// Two GPUs: both directions, replies over the endpoint a message came on, and a peer going away.
TEST(NcclTransportTest, TwoGpusSendBothWaysAndAPeerGoingAwayFailsItsTransfers) {
  if (GpuCount() == 0) GTEST_SKIP() << NoGpu();
  if (GpuCount() < 2) GTEST_SKIP() << "needs two GPUs (this machine has " << GpuCount() << ")";
  auto a = CreateNcclTransport({.host = Inproc(), .device = 0});
  auto b = CreateNcclTransport({.host = Inproc(), .device = 1});
  ASSERT_TRUE(a.ok() && b.ok());
  constexpr size_t kSize = 8 << 20;
  auto a_buf = (*a)->Allocate(kSize, MemoryKind::kDevice);
  auto b_buf = (*b)->Allocate(kSize, MemoryKind::kDevice);
  ASSERT_TRUE(a_buf.ok() && b_buf.ok());
  const std::vector<uint8_t> bytes = Pattern(kSize, 9);
  ASSERT_EQ(cudaMemcpy((*a_buf)->data(), bytes.data(), kSize, cudaMemcpyHostToDevice),
            cudaSuccess);
  auto ep = (*a)->Connect((*b)->address(), absl::Seconds(10));
  ASSERT_TRUE(ep.ok()) << ep.status();

  Done sent, received, echoed, echo_received;
  (*b)->SetHandler(1, [&](IncomingMessage& m) {
    std::shared_ptr<Endpoint> back = m.endpoint();
    m.Accept(Destination{{(*b_buf)->data(), kSize}, b_buf->get()},
             [&, back](absl::Status s) {
               received.p.set_value(s);
               if (!s.ok()) return;
               back->Send(2, {}, Payload{{(*b_buf)->data(), kSize}, b_buf->get()}, kWait,
                          echoed.fn());
             });
  });
  auto a_back = (*a)->Allocate(kSize, MemoryKind::kDevice);
  ASSERT_TRUE(a_back.ok());
  (*a)->SetHandler(2, [&](IncomingMessage& m) {
    m.Accept(Destination{{(*a_back)->data(), kSize}, a_back->get()}, echo_received.fn());
  });
  (*ep)->Send(1, {}, Payload{{(*a_buf)->data(), kSize}, a_buf->get()}, kWait, sent.fn());
  ASSERT_TRUE(sent.Wait().ok());
  ASSERT_TRUE(received.Wait().ok());
  ASSERT_TRUE(echoed.Wait().ok());
  ASSERT_TRUE(echo_received.Wait().ok());
  EXPECT_TRUE(CopyBack(**a_back, kSize) == bytes);

  // b goes away while a's next transfer waits for its answer.
  Done lost;
  std::promise<void> in_handler;
  (*b)->SetHandler(3, [&](IncomingMessage&) {
    in_handler.set_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  (*ep)->Send(3, {}, Payload{{(*a_buf)->data(), kSize}, a_buf->get()}, kWait, lost.fn());
  ASSERT_EQ(in_handler.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  b_buf->reset();
  b->reset();
  EXPECT_EQ(lost.Wait().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*ep)->health().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace strata::transport
