// What the transport's conformance suites share: every transport backend this build has, for real
// (UCX over loopback TCP and over shared memory, the in-process backend in memory), a fixture with
// a receiver and a sender over two transports of one backend, and small helpers. For tests only.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/block_protocol.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/testing/fault_injecting_transport.h"
#include "transport/ucx/ucx_transport.h"

namespace strata::transport::testing {

struct Backend {
  std::string name;
  std::string tls;  // UCX only
};

inline void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

inline absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const Backend& b) {
  if (b.name == "inproc") return CreateInprocTransport({});
  return CreateUcxTransport({.tls = b.tls});
}

inline std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

inline Payload View(const std::vector<uint8_t>& v) { return {.bytes = {v.data(), v.size()}}; }

// A latch the tests use to hold a consumer.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Blocks the consumer received, by id (copies, checked against what was sent).
class Sink {
 public:
  absl::Status Take(const ReceivedBlock& b) {
    std::lock_guard<std::mutex> lock(mu_);
    got_[b.id] = std::vector<uint8_t>(b.bytes.begin(), b.bytes.end());
    order_.push_back(b.id);
    cv_.notify_all();
    return absl::OkStatus();
  }
  bool WaitFor(const std::string& id, absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [&] { return got_.contains(id); });
  }
  std::vector<uint8_t> Get(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = got_.find(id);
    return it == got_.end() ? std::vector<uint8_t>{} : it->second;
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mu_);
    return got_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> got_;
  std::vector<std::string> order_;
};

// Two transports of the backend under test, a receiver and a sender between them (Start).
class BackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    auto a = MakeTransport(GetParam());
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = MakeTransport(GetParam());
    ASSERT_TRUE(b.ok()) << b.status();
    sender_transport_ = std::move(*a);
    receiver_transport_ = std::move(*b);
  }

  // A receiver whose consumer is `consumer` (default: the sink), and a sender connected to it.
  // The receiver listens on the receiving transport, or through faulty_ when a test set it.
  void Start(BlockReceiverOptions ro = {}, BlockSenderOptions so = {},
             BlockConsumer consumer = nullptr) {
    if (!consumer) consumer = [this](ReceivedBlock b) { return sink_.Take(b); };
    sender_.reset();  // one sender and one receiver per transport at a time
    receiver_.reset();
    Transport* receiving =
        faulty_ != nullptr ? static_cast<Transport*>(faulty_.get()) : receiver_transport_.get();
    auto r = BlockReceiver::Create(receiving, ro, std::move(consumer));
    ASSERT_TRUE(r.ok()) << r.status();
    receiver_ = std::move(*r);
    auto s = BlockSender::Create(sender_transport_.get(), so);
    ASSERT_TRUE(s.ok()) << s.status();
    sender_ = std::move(*s);
    auto ep = sender_transport_->Connect(receiving->address(), absl::Seconds(10));
    ASSERT_TRUE(ep.ok()) << ep.status();
    peer_ = std::move(*ep);
  }

  // A receiver whose first block arrives damaged and a sender that waits 5 s before sending a
  // block again; sends block "x" (100 KB of `seed`) and returns once the sender has its DATA_LOSS
  // answer, the transfer waiting for its next attempt.
  void SendOneDamagedOnce(uint32_t seed, std::shared_ptr<Transfer>* t) {
    faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
    faulty_->corrupt = [](int n) { return n == 1; };
    ASSERT_NO_FATAL_FAILURE(Start({}, {.max_attempts = 3, .retry_backoff = absl::Seconds(5)}));
    sent_ = RandomBytes(100000, seed);
    *t = sender_->Send(peer_, "x", View(sent_));
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (receiver_->stats().checksum_failures == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    absl::SleepFor(absl::Milliseconds(500));  // (the DATA_LOSS ack reaches the sender)
    ASSERT_FALSE((*t)->done()) << (*t)->status();
  }

  void TearDown() override {
    hold_.Open();  // a failed test may have left a consumer waiting
    sender_.reset();
    receiver_.reset();
    faulty_.reset();
    peer_.reset();
    sender_transport_.reset();
    receiver_transport_.reset();
  }

  // Gates and the sink outlive the receiver (whose consumers use them): members, not locals.
  Gate hold_;
  Sink sink_;
  std::unique_ptr<Transport> sender_transport_;
  std::unique_ptr<Transport> receiver_transport_;
  std::unique_ptr<FaultInjectingTransport> faulty_;  // wraps receiver_transport_ when set
  std::unique_ptr<BlockReceiver> receiver_;
  std::unique_ptr<BlockSender> sender_;
  std::shared_ptr<Endpoint> peer_;
  std::vector<uint8_t> sent_;  // SendOneDamagedOnce's block (alive while it is sent)
};

// Every backend of this build, named for the test names.
inline std::vector<Backend> AllBackends() {
  return {Backend{"inproc", ""}, Backend{"ucx_tcp", "tcp"},
          Backend{"ucx_shm", "posix,sysv,cma,tcp"}};
}
inline std::string BackendName(const ::testing::TestParamInfo<Backend>& info) {
  return info.param.name;
}

}  // namespace strata::transport::testing
