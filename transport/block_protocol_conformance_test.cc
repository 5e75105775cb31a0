// The block shipping protocol (block_protocol.h) over every transport backend this build has, for
// real: blocks of every size intact and verified, windows, retries, cancels and timeouts, damage
// caught, same-host placement in the receiver's ring, pieced and streamed blocks, and a peer
// process killed with SIGKILL (for backends that reach other processes).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "transport/testing/backend_fixture.h"

extern char** environ;

namespace strata::transport {
namespace {

using testing::Gate;
using ::testing::HasSubstr;
using testing::RandomBytes;
using testing::Sink;
using testing::View;

class BlockProtocolTest : public testing::BackendTest {};

TEST_P(BlockProtocolTest, BlocksOfEverySizeArriveIntactAndVerified) {
  Start();
  const size_t sizes[] = {0, 1, 7, 4096, 65537, 1 << 20, 64 << 20};
  uint32_t seed = 1;
  for (size_t n : sizes) {
    const std::vector<uint8_t> data = RandomBytes(n, seed++);
    const std::string id = absl::StrCat("block-", n);
    absl::Status s = sender_->Send(peer_, id, View(data))->Wait();
    ASSERT_TRUE(s.ok()) << n << ": " << s;
    ASSERT_EQ(sink_.Get(id), data) << n;
  }
  EXPECT_EQ(receiver_->stats().blocks, std::size(sizes));
  EXPECT_EQ(sender_->stats().sent, std::size(sizes));
  EXPECT_EQ(receiver_->stats().checksum_failures, 0u);
}

TEST_P(BlockProtocolTest, ManyConcurrentTransfersAllComplete) {
  Start({}, {.max_bytes_in_flight = 4 << 20});
  constexpr int kBlocks = 300;
  std::vector<std::vector<uint8_t>> data;
  std::mt19937 rng(5);
  for (int i = 0; i < kBlocks; ++i) data.push_back(RandomBytes(1 + rng() % (256 << 10), i));
  std::vector<std::shared_ptr<Transfer>> transfers;
  std::vector<std::thread> threads;
  std::mutex mu;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kBlocks; i += 4) {
        auto tr = sender_->Send(peer_, absl::StrCat("c", i), View(data[i]));
        std::lock_guard<std::mutex> lock(mu);
        transfers.push_back(tr);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& t : transfers) ASSERT_TRUE(t->Wait().ok()) << t->status();
  for (int i = 0; i < kBlocks; ++i) ASSERT_EQ(sink_.Get(absl::StrCat("c", i)), data[i]) << i;
  EXPECT_LE(sender_->stats().max_bytes_in_flight, uint64_t{4} << 20);
}

// Several prefill nodes ship to one decode node at once: every block arrives, each sender's
// window holds, and the acknowledgements find their way back to the right sender.
TEST_P(BlockProtocolTest, SeveralSendersToOneReceiver) {
  Start();
  constexpr int kSenders = 3, kBlocks = 40;
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::unique_ptr<BlockSender>> senders;
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (int i = 0; i < kSenders; ++i) {
    auto t = MakeTransport(GetParam());
    ASSERT_TRUE(t.ok()) << t.status();
    auto s = BlockSender::Create(t->get(), {.max_bytes_in_flight = 512 << 10});
    ASSERT_TRUE(s.ok());
    auto ep = (*t)->Connect(receiver_transport_->address(), absl::Seconds(10));
    ASSERT_TRUE(ep.ok()) << ep.status();
    transports.push_back(std::move(*t));
    senders.push_back(std::move(*s));
    eps.push_back(std::move(*ep));
  }
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < kSenders * kBlocks; ++i) data.push_back(RandomBytes(1000 + 997 * i, 300 + i));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int s = 0; s < kSenders; ++s) {
    threads.emplace_back([&, s] {
      std::vector<std::shared_ptr<Transfer>> ts;
      for (int b = 0; b < kBlocks; ++b) {
        const int i = s * kBlocks + b;
        ts.push_back(senders[s]->Send(eps[s], absl::StrCat("s", s, "b", b), View(data[i])));
      }
      for (auto& t : ts) failures += t->Wait().ok() ? 0 : 1;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (int s = 0; s < kSenders; ++s) {
    EXPECT_EQ(senders[s]->stats().sent, static_cast<uint64_t>(kBlocks));
    EXPECT_LE(senders[s]->stats().max_bytes_in_flight, uint64_t{512} << 10);
    for (int b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(sink_.Get(absl::StrCat("s", s, "b", b)), data[s * kBlocks + b]) << s << " " << b;
    }
  }
  senders.clear();
  eps.clear();
}

TEST_P(BlockProtocolTest, TransfersCompleteOutOfOrder) {
  Start({.verify_threads = 2}, {}, [&](ReceivedBlock b) {
    if (b.id == "a") hold_.Wait();
    return sink_.Take(b);
  });
  const auto a_data = RandomBytes(1000, 1), b_data = RandomBytes(2000, 2);
  auto a = sender_->Send(peer_, "a", View(a_data));
  auto b = sender_->Send(peer_, "b", View(b_data));
  EXPECT_TRUE(b->Wait().ok());
  EXPECT_FALSE(a->done()) << "a completed though its consumer has not returned";
  hold_.Open();
  EXPECT_TRUE(a->Wait().ok());
  EXPECT_EQ(sink_.Get("a"), a_data);
}

TEST_P(BlockProtocolTest, ChecksumMismatchIsDataLossAndNeverHandedOn) {
  Start();
  const auto data = RandomBytes(300000, 3);
  const uint32_t wrong = Crc32c(data.data(), data.size()) ^ 1;
  absl::Status s = sender_->Send(peer_, "bad", View(data), {.crc32c = wrong})->Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
  // The receiver's DATA_LOSS allows another attempt, but the sender's own bytes do not match the
  // CRC-32C either: sending them again could not help.
  EXPECT_THAT(s.message(), HasSubstr("not sent again"));
  EXPECT_EQ(sender_->stats().retries, 0u);
  EXPECT_EQ(sink_.count(), 0u);
  EXPECT_EQ(receiver_->stats().checksum_failures, 1u);
  // The connection is still good.
  EXPECT_TRUE(sender_->Send(peer_, "good", View(data))->Wait().ok());
}

// Blocks verified on the transport's thread (BlockReceiverOptions::inline_max_bytes) behave the
// same: intact ones delivered, corrupt ones refused with DATA_LOSS; larger ones still go through
// the verify threads.
TEST_P(BlockProtocolTest, InlineVerificationDeliversAndRefusesAlike) {
  Start({.inline_max_bytes = 100000});
  const auto small = RandomBytes(50000, 20), large = RandomBytes(300000, 21);
  EXPECT_TRUE(sender_->Send(peer_, "small", View(small))->Wait().ok());
  EXPECT_TRUE(sender_->Send(peer_, "large", View(large))->Wait().ok());
  const uint32_t wrong = Crc32c(small.data(), small.size()) ^ 4;
  EXPECT_EQ(sender_->Send(peer_, "bad", View(small), {.crc32c = wrong})->Wait().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(sink_.Get("small"), small);
  EXPECT_EQ(sink_.Get("large"), large);
  EXPECT_TRUE(sink_.Get("bad").empty());
  EXPECT_EQ(receiver_->stats().checksum_failures, 1u);
}

// What a node's /metrics shows: the counters and the transfer-time histogram follow the traffic.
TEST_P(BlockProtocolTest, MetricsCountWhatHappened) {
  Start();
  const auto data = RandomBytes(70000, 70);
  EXPECT_TRUE(sender_->Send(peer_, "m1", View(data))->Wait().ok());
  EXPECT_TRUE(sender_->Send(peer_, "m2", View(data))->Wait().ok());
  EXPECT_EQ(sender_->Send(peer_, "m3", View(data), {.crc32c = 1})->Wait().code(),
            absl::StatusCode::kDataLoss);
  const std::string sent = sender_->RenderMetrics();
  EXPECT_THAT(sent, HasSubstr("\nstrata_transport_sent_blocks_total 2\n"));
  EXPECT_THAT(sent, HasSubstr("\nstrata_transport_sent_bytes_total 140000\n"));
  EXPECT_THAT(sent, HasSubstr("\nstrata_transport_sent_failures_total 1\n"));
  EXPECT_THAT(sent, HasSubstr("\nstrata_transport_block_transfer_seconds_count 2\n"));
  const std::string received = receiver_->RenderMetrics();
  EXPECT_THAT(received, HasSubstr("\nstrata_transport_received_blocks_total 2\n"));
  EXPECT_THAT(received, HasSubstr("\nstrata_transport_received_checksum_failures_total 1\n"));
  EXPECT_THAT(received, HasSubstr("\nstrata_transport_received_pending_bytes 0\n"));
}

TEST_P(BlockProtocolTest, ConsumerRefusalAndSizeLimitComeBackToTheSender) {
  Start({.max_block_bytes = 1 << 20}, {}, [&](ReceivedBlock b) -> absl::Status {
    if (b.id == "dup") return absl::AlreadyExistsError("have it");
    return sink_.Take(b);
  });
  const auto small = RandomBytes(100, 4), big = RandomBytes((1 << 20) + 1, 5);
  absl::Status dup = sender_->Send(peer_, "dup", View(small))->Wait();
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists) << dup;
  EXPECT_THAT(dup.message(), HasSubstr("have it"));
  absl::Status large = sender_->Send(peer_, "big", View(big))->Wait();
  EXPECT_EQ(large.code(), absl::StatusCode::kResourceExhausted) << large;
  EXPECT_EQ(receiver_->stats().too_large, 1u);
  EXPECT_EQ(receiver_->stats().refused, 1u);
}

TEST_P(BlockProtocolTest, CancelCompletesPromptlyWithCancelled) {
  Start({}, {}, [&](ReceivedBlock b) {
    hold_.Wait();
    return sink_.Take(b);
  });
  const auto data = RandomBytes(5000, 6);
  auto t = sender_->Send(peer_, "x", View(data));
  EXPECT_FALSE(t->WaitFor(absl::Milliseconds(100)));
  t->Cancel();
  ASSERT_TRUE(t->WaitFor(absl::Seconds(5)));
  EXPECT_EQ(t->status().code(), absl::StatusCode::kCancelled) << t->status();
  hold_.Open();
  // A cancel after completion changes nothing; the sender still works.
  t->Cancel();
  EXPECT_EQ(t->status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(sender_->Send(peer_, "y", View(data))->Wait().ok());
}

TEST_P(BlockProtocolTest, UnacknowledgedTransferTimesOut) {
  Start({}, {}, [&](ReceivedBlock b) {
    hold_.Wait();
    return sink_.Take(b);
  });
  const auto data = RandomBytes(5000, 7);
  const absl::Time start = absl::Now();
  absl::Status s =
      sender_->Send(peer_, "slow", View(data), {.timeout = absl::Milliseconds(300)})->Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  hold_.Open();
  // The late acknowledgement is counted, not delivered to anybody.
  for (int i = 0; i < 500 && sender_->stats().late_acks == 0; ++i)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(sender_->stats().late_acks, 1u);
}

TEST_P(BlockProtocolTest, SlowConsumerSlowsTheSenderWithinItsWindow) {
  constexpr uint64_t kWindow = 256 << 10;
  Start({}, {.max_bytes_in_flight = kWindow}, [&](ReceivedBlock b) {
    absl::SleepFor(absl::Milliseconds(3));
    return sink_.Take(b);
  });
  const auto data = RandomBytes(64 << 10, 8);
  std::vector<std::shared_ptr<Transfer>> ts;
  for (int i = 0; i < 40; ++i) ts.push_back(sender_->Send(peer_, absl::StrCat("w", i), View(data)));
  for (auto& t : ts) ASSERT_TRUE(t->Wait().ok()) << t->status();
  EXPECT_LE(sender_->stats().max_bytes_in_flight, kWindow);
  EXPECT_GE(sender_->stats().max_bytes_in_flight, kWindow / 2) << "the window was never used";
  EXPECT_LE(receiver_->stats().max_pending_bytes, kWindow);
  EXPECT_EQ(sink_.count(), 40u);
}

TEST_P(BlockProtocolTest, WindowThatNeverOpensTimesOutWithoutSending) {
  Start({}, {.max_bytes_in_flight = 1000}, [&](ReceivedBlock b) {
    hold_.Wait();
    return sink_.Take(b);
  });
  const auto data = RandomBytes(800, 9);
  auto first = sender_->Send(peer_, "first", View(data));
  absl::Status second =
      sender_->Send(peer_, "second", View(data), {.timeout = absl::Milliseconds(200)})->Wait();
  EXPECT_EQ(second.code(), absl::StatusCode::kDeadlineExceeded) << second;
  EXPECT_THAT(second.message(), HasSubstr("window"));
  hold_.Open();
  EXPECT_TRUE(first->Wait().ok());
  EXPECT_TRUE(sink_.Get("second").empty());
}

// Corruption after the backend placed the payload (the header's CRC is right): the receiver's
// check catches it, the sender gets DATA_LOSS, the consumer never sees those bytes.
TEST_P(BlockProtocolTest, PayloadCorruptedInFlightIsCaughtAndNeverHandedOn) {
  faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
  faulty_->corrupt = [](int n) { return n % 3 == 0; };
  // (On ucx_shm the later blocks are placed in the receiver's ring; from 256 KiB on, streamed.
  // One attempt each: DamagedBlockIsSentAgain… covers the next.)
  ASSERT_NO_FATAL_FAILURE(
      Start({}, {.placement_min_bytes = 1, .stream_min_bytes = 256 << 10, .max_attempts = 1}));
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < 9; ++i) data.push_back(RandomBytes(1000 + 70000 * i, 50 + i));
  for (int i = 0; i < 9; ++i) {
    absl::Status st = sender_->Send(peer_, absl::StrCat("c", i), View(data[i]))->Wait();
    if ((i + 1) % 3 == 0) {
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << i << ": " << st;
      EXPECT_TRUE(sink_.Get(absl::StrCat("c", i)).empty()) << i;
    } else {
      EXPECT_TRUE(st.ok()) << i << ": " << st;
      EXPECT_EQ(sink_.Get(absl::StrCat("c", i)), data[i]) << i;
    }
  }
  EXPECT_EQ(receiver_->stats().checksum_failures, 3u);
  if (GetParam().name == "ucx_shm") {  // the later ones were placed (and streamed) in the ring
    EXPECT_GE(receiver_->stats().placed, 4u);
  }
}

// A block damaged on the way is sent again (the receiver's DATA_LOSS is a passing refusal): it
// arrives intact and the damaged copy is never handed on. One damaged on every attempt fails
// with DATA_LOSS saying which attempt was the last.
TEST_P(BlockProtocolTest, DamagedBlockIsSentAgainAndArrivesIntact) {
  faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
  faulty_->corrupt = [](int n) { return n == 1 || (n >= 3 && n <= 5); };
  ASSERT_NO_FATAL_FAILURE(Start({}, {.max_attempts = 3, .retry_backoff = absl::Milliseconds(1)}));
  const auto a = RandomBytes(200000, 61), b = RandomBytes(200000, 62), c = RandomBytes(5000, 63);
  absl::Status st = sender_->Send(peer_, "a", View(a))->Wait();  // messages 1 (damaged) and 2
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(sink_.Get("a"), a);
  st = sender_->Send(peer_, "b", View(b))->Wait();  // 3, 4, 5: all damaged
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(st.message(), HasSubstr("(attempt 3)"));
  EXPECT_TRUE(sink_.Get("b").empty());
  st = sender_->Send(peer_, "c", View(c))->Wait();
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(sink_.Get("c"), c);
  EXPECT_EQ(sender_->stats().retries, 3u);
  EXPECT_EQ(sender_->stats().sent, 2u);
  EXPECT_EQ(sender_->stats().failed, 1u);
  EXPECT_EQ(receiver_->stats().checksum_failures, 4u);
  EXPECT_EQ(receiver_->stats().blocks, 2u);
  EXPECT_THAT(sender_->RenderMetrics(), HasSubstr("strata_transport_sent_retries_total 3"));
}

// A receiver that holds its limit of pending bytes refuses a block for now (RESOURCE_EXHAUSTED,
// retryable): the sender sends it again after its backoff, and it goes through once there is
// room. A consumer's own refusal is never retried.
TEST_P(BlockProtocolTest, RefusedForNowIsSentAgainOnceThereIsRoom) {
  ASSERT_NO_FATAL_FAILURE(
      Start({.max_block_bytes = 256 << 10, .max_pending_bytes = 256 << 10},
            {.placement_min_bytes = 0, .max_attempts = 5, .retry_backoff = absl::Milliseconds(200)},
            [this](ReceivedBlock b) -> absl::Status {
              if (b.id == "first") hold_.Wait();
              if (b.id == "dup") return absl::AlreadyExistsError("have it");
              return sink_.Take(b);
            }));
  const auto data = RandomBytes(200000, 64);
  auto first = sender_->Send(peer_, "first", View(data));
  auto second = sender_->Send(peer_, "second", View(data));
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (receiver_->stats().overloaded == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_GE(receiver_->stats().overloaded, 1u);
  EXPECT_FALSE(second->done()) << second->status();  // waiting to be sent again
  hold_.Open();
  EXPECT_TRUE(first->Wait().ok()) << first->status();
  EXPECT_TRUE(second->Wait().ok()) << second->status();
  EXPECT_EQ(sink_.Get("second"), data);
  EXPECT_GE(sender_->stats().retries, 1u);
  const uint64_t retries = sender_->stats().retries;
  EXPECT_EQ(sender_->Send(peer_, "dup", View(data))->Wait().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(sender_->stats().retries, retries);
}

// Cancel reaches a transfer waiting for its next attempt.
TEST_P(BlockProtocolTest, CancelBetweenAttemptsCompletesWithCancelled) {
  std::shared_ptr<Transfer> t;
  ASSERT_NO_FATAL_FAILURE(SendOneDamagedOnce(65, &t));
  const absl::Time cancelled = absl::Now();
  t->Cancel();
  EXPECT_TRUE(t->WaitFor(absl::Seconds(1))) << "the cancel waited for the next attempt";
  EXPECT_EQ(t->status().code(), absl::StatusCode::kCancelled) << t->status();
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(1));
  EXPECT_EQ(sender_->stats().retries, 0u);
  EXPECT_TRUE(sender_->Send(peer_, "y", View(sent_))->Wait().ok());
  EXPECT_TRUE(sink_.Get("x").empty());
}

// A transfer waiting to be sent again keeps its room in the peer's window. Its next attempt
// therefore never waits for room, and the one retry thread never waits behind one peer's full
// window while another peer's retry is due. Here peer A's window is full (a block its consumer
// holds, a damaged block waiting for its retry, a third block waiting for room that the consumer
// will hold too) while peer B's damaged block is sent again and arrives. (When a retry gave its
// room up, the third block took it, and the retry thread waited for A's consumer.)
TEST_P(BlockProtocolTest, ARetryKeepsItsWindowRoomAndNeverWaitsBehindAnotherPeer) {
  faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
  faulty_->corrupt = [](int n) { return n == 2; };  // A's second block, first attempt
  constexpr size_t kSize = 100000;
  ASSERT_NO_FATAL_FAILURE(Start({.verify_threads = 2},
                                {.max_bytes_in_flight = 2 * kSize,
                                 .placement_min_bytes = 0,
                                 .max_attempts = 3,
                                 .retry_backoff = absl::Milliseconds(200)},
                                [this](ReceivedBlock b) -> absl::Status {
                                  if (b.id == "a1" || b.id == "a3")
                                    hold_.Wait();  // each holds one of A's two threads
                                  return sink_.Take(b);
                                }));
  // Peer B: its own transport and receiver; its first block arrives damaged.
  auto b_transport = MakeTransport(GetParam());
  ASSERT_TRUE(b_transport.ok()) << b_transport.status();
  FaultInjectingTransport b_faulty(b_transport->get());
  b_faulty.corrupt = [](int n) { return n == 1; };
  Sink b_sink;
  auto b_receiver =
      BlockReceiver::Create(&b_faulty, {}, [&](ReceivedBlock b) { return b_sink.Take(b); });
  ASSERT_TRUE(b_receiver.ok()) << b_receiver.status();
  auto b_peer = sender_transport_->Connect(b_faulty.address(), absl::Seconds(10));
  ASSERT_TRUE(b_peer.ok()) << b_peer.status();

  const auto a1 = RandomBytes(kSize, 71), a2 = RandomBytes(kSize, 72), a3 = RandomBytes(kSize, 73);
  const auto b1 = RandomBytes(kSize, 74);
  auto t1 = sender_->Send(peer_, "a1", View(a1));  // held by A's consumer
  auto t2 = sender_->Send(peer_, "a2", View(a2));  // damaged: waits 200 ms to be sent again
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (receiver_->stats().checksum_failures == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(receiver_->stats().checksum_failures, 1u);
  std::shared_ptr<Transfer> t3;
  std::thread third([&] { t3 = sender_->Send(peer_, "a3", View(a3)); });  // waits for room
  // B's damaged block is due for its retry after A's: it must not wait for A's window.
  auto u1 = sender_->Send(*b_peer, "b1", View(b1));
  EXPECT_TRUE(u1->WaitFor(absl::Seconds(5))) << "B's retry waited behind A's full window";
  EXPECT_TRUE(u1->status().ok()) << u1->status();
  EXPECT_EQ(b_sink.Get("b1"), b1);
  EXPECT_FALSE(t1->done()) << t1->status();
  EXPECT_TRUE(t2->WaitFor(absl::Seconds(5))) << "a2's retry waited for room";
  EXPECT_TRUE(t2->status().ok()) << t2->status();  // its consumer ran: A took it in its turn
  EXPECT_LE(sender_->stats().max_bytes_in_flight, 2 * kSize);
  hold_.Open();
  third.join();
  EXPECT_TRUE(t1->Wait().ok()) << t1->status();
  EXPECT_TRUE(t3->Wait().ok()) << t3->status();
  EXPECT_EQ(sink_.Get("a2"), a2);
  EXPECT_EQ(sink_.Get("a3"), a3);
  EXPECT_EQ(sender_->stats().retries, 2u);
  EXPECT_EQ(sender_->stats().sent, 4u);
  sender_.reset();  // before B's receiver and transport go
  b_receiver->reset();
}

// A peer that fails while a block waits to be sent to it again fails that block at once, with
// UNAVAILABLE, rather than at its next attempt.
TEST_P(BlockProtocolTest, PeerFailingWhileABlockWaitsToBeSentAgainFailsItAtOnce) {
  std::shared_ptr<Transfer> t;
  ASSERT_NO_FATAL_FAILURE(SendOneDamagedOnce(66, &t));
  const absl::Time gone = absl::Now();
  receiver_.reset();
  faulty_.reset();
  receiver_transport_.reset();  // the peer goes away
  EXPECT_TRUE(t->WaitFor(absl::Seconds(3))) << "the failure waited for the next attempt";
  EXPECT_EQ(t->status().code(), absl::StatusCode::kUnavailable) << t->status();
  EXPECT_THAT(t->status().message(), HasSubstr("waited to be sent again"));
  EXPECT_LT(absl::Now() - gone, absl::Seconds(3));
  EXPECT_EQ(sender_->stats().retries, 0u);
  EXPECT_EQ(sender_->stats().failed, 1u);
}

// A lost message: that transfer times out, the next one on the same connection goes through.
TEST_P(BlockProtocolTest, LostMessageTimesOutAndTheNextGoesThrough) {
  faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
  faulty_->drop = [](int n) { return n == 1; };
  ASSERT_NO_FATAL_FAILURE(Start());
  const auto data = RandomBytes(200000, 60);
  absl::Status lost =
      sender_->Send(peer_, "lost", View(data), {.timeout = absl::Milliseconds(300)})->Wait();
  EXPECT_EQ(lost.code(), absl::StatusCode::kDeadlineExceeded) << lost;
  EXPECT_TRUE(sender_->Send(peer_, "next", View(data))->Wait().ok());
  EXPECT_EQ(sink_.Get("next"), data);
  EXPECT_TRUE(sink_.Get("lost").empty());
}

// A prefill node sends layer by layer: the consumer has layer 0 before layer 1 is even sent.
TEST_P(BlockProtocolTest, LayersStreamOneByOne) {
  Start();
  constexpr int kLayers = 4;
  std::vector<std::vector<uint8_t>> layers;
  for (int l = 0; l < kLayers; ++l) layers.push_back(RandomBytes(200000, 100 + l));
  std::vector<std::shared_ptr<Transfer>> ts;
  for (int l = 0; l < kLayers; ++l) {
    ts.push_back(sender_->Send(peer_, absl::StrCat("layer", l), View(layers[l])));
    // The receiver sees this layer while the sender has not produced the next.
    ASSERT_TRUE(sink_.WaitFor(absl::StrCat("layer", l), absl::Seconds(10))) << l;
    EXPECT_EQ(sink_.count(), static_cast<size_t>(l + 1));
  }
  for (auto& t : ts) EXPECT_TRUE(t->Wait().ok());
}

// Sends a small block and waits for the sender to map the receiver's ring (true), or gives up
// after `wait` (false: this backend or peer has none).
bool WaitForRing(BlockSender& sender, const std::shared_ptr<Endpoint>& peer, absl::Duration wait) {
  const auto data = RandomBytes(100, 70);
  if (!sender.Send(peer, "warm-up", View(data))->Wait().ok()) return false;
  const absl::Time until = absl::Now() + wait;
  while (sender.stats().rings == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  return sender.stats().rings > 0;
}

// Same-host UCX peers: blocks go straight into the receiver's lent ring (one copy), up to the
// ring's size; larger ones, and every block on other backends, travel as payload. All intact.
TEST_P(BlockProtocolTest, SameHostBlocksArePlacedInTheReceiversRing) {
  Start({.ring_bytes = 4 << 20}, {.placement_min_bytes = 1});
  const bool shm = GetParam().name == "ucx_shm";
  ASSERT_EQ(WaitForRing(*sender_, peer_, shm ? absl::Seconds(10) : absl::Milliseconds(300)), shm);
  // (A block takes its size and a 64-byte progress word: 4 MiB exactly does not fit.)
  const size_t sizes[] = {1, 4096, 300000, 1 << 20, (4 << 20) - 4096, 4 << 20};
  uint32_t seed = 80;
  for (size_t n : sizes) {
    const auto data = RandomBytes(n, seed++);
    const std::string id = absl::StrCat("p", n);
    ASSERT_TRUE(sender_->Send(peer_, id, View(data))->Wait().ok()) << n;
    EXPECT_EQ(sink_.Get(id), data) << n;
  }
  const uint64_t placed = shm ? std::size(sizes) - 1 : 0;
  EXPECT_EQ(sender_->stats().placed, placed);
  EXPECT_EQ(receiver_->stats().placed, placed);
  EXPECT_EQ(receiver_->stats().rings, shm ? 1u : 0u);
  EXPECT_THAT(receiver_->RenderMetrics(),
              HasSubstr(absl::StrCat("strata_transport_received_placed_blocks_total ", placed)));
}

// A consumer that keeps blocks keeps their ring space: later blocks never overwrite them (they
// travel as payload while the ring is full) and are placed again once the space comes back.
TEST_P(BlockProtocolTest, HeldBlocksKeepTheirRingSpaceUntilLetGo) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  std::mutex mu;
  std::vector<ReceivedBlock> kept;
  Start({.ring_bytes = 1 << 20}, {.placement_min_bytes = 1}, [&](ReceivedBlock b) {
    std::lock_guard<std::mutex> lock(mu);
    kept.push_back(std::move(b));
    return absl::OkStatus();
  });
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < 6; ++i) {  // four fill the ring, with their progress words
    data.push_back(RandomBytes((256 << 10) - 4096, 90 + i));
    ASSERT_TRUE(sender_->Send(peer_, absl::StrCat("k", i), View(data[i]))->Wait().ok()) << i;
  }
  EXPECT_EQ(receiver_->stats().placed, 4u);  // four fill the 1 MiB ring; two went as payload
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(kept.size(), 7u);  // with the warm-up
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(kept[i + 1].id, absl::StrCat("k", i));
      EXPECT_TRUE(std::equal(kept[i + 1].bytes.begin(), kept[i + 1].bytes.end(), data[i].begin(),
                             data[i].end()))
          << "block " << i << " changed while held";
    }
    kept.clear();  // the space goes back (release messages)
  }
  bool placed_again = false;
  for (int i = 0; i < 200 && !placed_again; ++i) {
    ASSERT_TRUE(sender_->Send(peer_, absl::StrCat("again", i), View(data[0]))->Wait().ok());
    placed_again = receiver_->stats().placed > 4;
    if (!placed_again) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(placed_again);
}

// A receiver replaced on the same transport takes its rings back; the sender asks the new one.
TEST_P(BlockProtocolTest, ANewReceiverLendsANewRing) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  Start({}, {.placement_min_bytes = 1});
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  receiver_.reset();  // tells the sender its ring is gone
  for (int i = 0; i < 500 && sender_->stats().rings > 0; ++i) absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(sender_->stats().rings, 0u);
  auto r = BlockReceiver::Create(receiver_transport_.get(), {},
                                 [this](ReceivedBlock b) { return sink_.Take(b); });
  ASSERT_TRUE(r.ok());
  receiver_ = std::move(*r);
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  const auto data = RandomBytes(100000, 99);
  ASSERT_TRUE(sender_->Send(peer_, "new", View(data))->Wait().ok());
  EXPECT_EQ(sink_.Get("new"), data);
  EXPECT_EQ(receiver_->stats().placed, 1u);
}

// A placed block whose header never reaches the receiver (lost here; the sender times out) holds
// ring space that no answer will give back. When, after reclaim_after, that is what keeps a block
// out of the ring, the sender gives the ring back and asks for a new one: later blocks are placed
// again.
TEST_P(BlockProtocolTest, SpaceOfLostPlacedBlocksComesBackWithANewRing) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
  faulty_->drop = [](int n) { return n >= 2 && n <= 5; };  // (1 is the warm-up)
  const absl::Duration reclaim_after = absl::Seconds(1);
  Start({.ring_bytes = 1 << 20}, {.placement_min_bytes = 1, .reclaim_after = reclaim_after});
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  const auto data = RandomBytes((256 << 10) - 4096, 31);
  std::vector<std::shared_ptr<Transfer>> lost;  // four fill the ring; their headers are lost
  for (int i = 0; i < 4; ++i) {
    lost.push_back(sender_->Send(peer_, absl::StrCat("lost", i), View(data),
                                 {.timeout = absl::Milliseconds(200)}));
  }
  for (const auto& t : lost) {
    EXPECT_EQ(t->Wait().code(), absl::StatusCode::kDeadlineExceeded) << t->status();
  }
  // No room: this one goes as payload; the space is not yet presumed lost.
  ASSERT_TRUE(sender_->Send(peer_, "early", View(data))->Wait().ok());
  EXPECT_EQ(sender_->stats().rings_renewed, 0u);
  // Later it is: this one goes as payload too, and the ring is given back for a new one.
  absl::SleepFor(reclaim_after);
  ASSERT_TRUE(sender_->Send(peer_, "payload", View(data))->Wait().ok());
  EXPECT_EQ(sink_.Get("payload"), data);
  EXPECT_EQ(sender_->stats().rings_renewed, 1u);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (sender_->stats().rings == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_EQ(sender_->stats().rings, 1u) << "no new ring";
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(sender_->Send(peer_, absl::StrCat("placed", i), View(data))->Wait().ok()) << i;
    EXPECT_EQ(sink_.Get(absl::StrCat("placed", i)), data) << i;
  }
  EXPECT_EQ(receiver_->stats().placed, 4u);
  EXPECT_EQ(receiver_->stats().rings, 1u);  // the old one taken back
  EXPECT_EQ(receiver_->stats().retired_rings, 0u);
  EXPECT_THAT(sender_->RenderMetrics(), HasSubstr("strata_transport_sent_rings_renewed_total 1"));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(sink_.Get(absl::StrCat("lost", i)).empty()) << i;
}

// A ring taken back while a block in it is held still counts toward max_rings (lent memory stays
// within ring_bytes * max_rings): a sender asking meanwhile is refused, and asks again, and gets
// one, once that memory is free.
TEST_P(BlockProtocolTest, HeldRingsCountTowardTheLimitAndARefusedSenderAsksAgain) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  std::mutex mu;
  std::vector<ReceivedBlock> kept;
  Start({.ring_bytes = 1 << 20, .max_rings = 1}, {.placement_min_bytes = 1}, [&](ReceivedBlock b) {
    std::lock_guard<std::mutex> lock(mu);
    kept.push_back(std::move(b));
    return absl::OkStatus();
  });
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  const auto data = RandomBytes(100000, 32);
  ASSERT_TRUE(sender_->Send(peer_, "held", View(data))->Wait().ok());
  EXPECT_EQ(receiver_->stats().placed, 1u);
  sender_.reset();  // gives its ring back; the held block keeps the ring's memory
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (receiver_->stats().rings > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_EQ(receiver_->stats().rings, 0u);
  EXPECT_EQ(receiver_->stats().retired_rings, 1u);
  EXPECT_THAT(receiver_->RenderMetrics(), HasSubstr("strata_transport_retired_rings 1"));
  auto s = BlockSender::Create(sender_transport_.get(), {.placement_min_bytes = 1});
  ASSERT_TRUE(s.ok());
  sender_ = std::move(*s);
  EXPECT_FALSE(WaitForRing(*sender_, peer_, absl::Milliseconds(300))) << "lent past max_rings";
  {
    std::lock_guard<std::mutex> lock(mu);
    kept.clear();  // the old ring's memory is freed
  }
  EXPECT_EQ(receiver_->stats().retired_rings, 0u);
  bool placed = false;
  for (int i = 0; !placed && absl::Now() < until; ++i) {
    ASSERT_TRUE(sender_->Send(peer_, absl::StrCat("b", i), View(data))->Wait().ok()) << i;
    placed = receiver_->stats().placed > 1;
    if (!placed) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(placed) << "the refused sender never got a ring";
  EXPECT_EQ(receiver_->stats().rings, 1u);
}

// Placed blocks lie in the ring lent for them, not in the receiver's own buffers: they do not
// count toward max_pending_bytes. With the consumer held, placed blocks far past the limit queue
// and complete; payload blocks past it are refused.
TEST_P(BlockProtocolTest, PlacedBlocksDoNotCountTowardThePendingLimit) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  Start({.max_block_bytes = 256 << 10, .max_pending_bytes = 256 << 10, .ring_bytes = 1 << 20},
        {.placement_min_bytes = 1, .max_attempts = 1}, [this](ReceivedBlock b) {
          if (b.id != "warm-up") hold_.Wait();
          return sink_.Take(b);
        });
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  const auto data = RandomBytes(240 << 10, 33);
  std::vector<std::shared_ptr<Transfer>> t;
  for (int i = 0; i < 6; ++i) {  // four fill the ring; the fifth and sixth go as payload
    t.push_back(
        sender_->Send(peer_, absl::StrCat("q", i), View(data), {.timeout = absl::Seconds(20)}));
  }
  EXPECT_EQ(t[5]->Wait().code(), absl::StatusCode::kResourceExhausted) << t[5]->status();
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(t[i]->done()) << i;  // all held or queued
  hold_.Open();
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(t[i]->Wait().ok()) << i << ": " << t[i]->status();
    EXPECT_EQ(sink_.Get(absl::StrCat("q", i)), data) << i;
  }
  const BlockReceiver::Stats st = receiver_->stats();
  EXPECT_EQ(st.placed, 4u);
  EXPECT_EQ(st.overloaded, 1u);
  EXPECT_GE(st.max_pending_bytes, uint64_t{5} * data.size());  // (counted, not limited)
}

// A sender written by hand from the wire format (block_protocol.h), to do what BlockSender
// never does: announce a streamed block and then stop writing it, or lie in its progress word.
class HandMadeSender {
 public:
  HandMadeSender(Transport* transport, std::shared_ptr<Endpoint> peer)
      : transport_(transport), peer_(std::move(peer)), state_(std::make_shared<State>()) {
    // The handlers share the state (a handler already running when the destructor uninstalls
    // them may still use it).
    transport_->SetHandler(kBlockRingGrantMessage, [st = state_](IncomingMessage& m) {
      auto g = DecodeRingGrant(m.header());
      std::lock_guard<std::mutex> lock(st->mu);
      if (g.ok()) st->grant = *g;
      st->cv.notify_all();
    });
    transport_->SetHandler(kBlockAckMessage, [st = state_](IncomingMessage& m) {
      auto a = DecodeBlockAckHeader(m.header());
      std::lock_guard<std::mutex> lock(st->mu);
      if (a.ok()) st->acks[a->seq] = a->status;
      st->cv.notify_all();
    });
  }
  ~HandMadeSender() {
    transport_->SetHandler(kBlockRingGrantMessage, nullptr);
    transport_->SetHandler(kBlockAckMessage, nullptr);
  }

  // Asks for a ring and maps it.
  absl::StatusOr<std::span<uint8_t>> MapRing(uint64_t token) {
    Send(kBlockRingRequestMessage, EncodeRingRequest({.token = token}));
    RingGrant grant;
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      if (!state_->cv.wait_for(lock, std::chrono::seconds(10),
                               [&] { return state_->grant.has_value(); })) {
        return absl::DeadlineExceededError("no ring grant");
      }
      grant = *state_->grant;
    }
    if (grant.code != absl::StatusCode::kOk) return absl::Status(grant.code, "refused");
    return peer_->Map(grant.descriptor);  // (not under the lock: Map waits for the transport)
  }

  // Announces a streamed block of `size` bytes at `offset` in ring `token`.
  void Announce(uint64_t seq, uint64_t size, uint32_t crc, uint64_t token, uint64_t offset) {
    const std::string h = EncodeBlockDataHeader({.seq = seq,
                                                 .size = size,
                                                 .crc32c = crc,
                                                 .block_id = absl::StrCat("hand", seq),
                                                 .placed = RingPlace{token, offset},
                                                 .streamed = true});
    Send(kBlockDataMessage, h);
  }

  // Any protocol message, as this sender wrote it.
  void Send(uint16_t id, const std::string& header, std::span<const uint8_t> payload = {}) {
    peer_->Send(id, AsBytes(header), {.bytes = payload}, absl::Seconds(10), [](absl::Status) {});
  }

  // The receiver's answer for `seq`, waiting up to `wait`.
  std::optional<absl::Status> Ack(uint64_t seq, absl::Duration wait) {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait_for(lock, absl::ToChronoNanoseconds(wait),
                        [&] { return state_->acks.contains(seq); });
    if (!state_->acks.contains(seq)) return std::nullopt;
    return state_->acks[seq];
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<RingGrant> grant;
    std::map<uint64_t, absl::Status> acks;
  };
  static std::span<const uint8_t> AsBytes(const std::string& s) {
    return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
  }
  Transport* transport_;
  std::shared_ptr<Endpoint> peer_;
  std::shared_ptr<State> state_;
};

// Blocks that travel as payload and are larger than a piece come in pieces, each checked as it
// lands: intact, counted as pieced; a corrupted piece is DATA_LOSS for its block alone, a lost
// one fails its block as soon as the next piece shows the gap.
TEST_P(BlockProtocolTest, PiecedBlocksArriveIntactAndAFaultyPieceFailsOnlyItsBlock) {
  faulty_ = std::make_unique<FaultInjectingTransport>(receiver_transport_.get());
  // Messages: 3 blocks of 4 pieces (1-12), then one of 4 whose 3rd is corrupted (15), then one
  // of 4 whose 2nd is lost (18), then whole and pieced blocks that go through.
  faulty_->corrupt = [](int n) { return n == 15; };
  faulty_->drop = [](int n) { return n == 18; };
  ASSERT_NO_FATAL_FAILURE(
      Start({}, {.placement_min_bytes = 0, .piece_bytes = 64 << 10, .max_attempts = 1}));
  std::vector<std::vector<uint8_t>> data;
  for (size_t n :
       {(3 << 16) + 1, 4 << 16, (3 << 16) + 100, 4 << 16, 4 << 16, 64 << 10, (1 << 20) + 3}) {
    data.push_back(RandomBytes(n, 90 + static_cast<uint32_t>(data.size())));
  }
  std::vector<absl::Status> got;
  for (size_t i = 0; i < data.size(); ++i) {
    got.push_back(
        sender_->Send(peer_, absl::StrCat("p", i), View(data[i]), {.timeout = absl::Seconds(10)})
            ->Wait());
  }
  for (size_t i : {0, 1, 2, 5, 6}) {
    EXPECT_TRUE(got[i].ok()) << i << ": " << got[i];
    EXPECT_EQ(sink_.Get(absl::StrCat("p", i)), data[i]) << i;
  }
  EXPECT_EQ(got[3].code(), absl::StatusCode::kDataLoss) << got[3];
  EXPECT_EQ(got[4].code(), absl::StatusCode::kInvalidArgument) << got[4];
  EXPECT_THAT(got[4].message(), HasSubstr("where the next piece"));
  EXPECT_TRUE(sink_.Get("p3").empty());
  EXPECT_TRUE(sink_.Get("p4").empty());
  const BlockReceiver::Stats st = receiver_->stats();
  EXPECT_EQ(st.blocks, 5u);
  EXPECT_EQ(st.pieced, 4u);  // all but the one of exactly a piece
  EXPECT_EQ(st.checksum_failures, 1u);
  EXPECT_EQ(st.malformed, 1u);
  EXPECT_THAT(receiver_->RenderMetrics(), HasSubstr("strata_transport_received_pending_bytes 0"));
}

// A sender writing pieced blocks by hand: pieces past the block's end and a first piece that is
// the whole block are refused with a reason; pieces of a block already failed are dropped; a
// block that a new one under the same sequence number supersedes, one the sender abandons and
// one whose sender's connection goes before its last piece are freed (aborted), never handed on.
TEST_P(BlockProtocolTest, HandMadePiecesAreCheckedAndAnUnfinishedBlockIsFreed) {
  Start();
  sender_.reset();  // this transport's handlers are the hand-made sender's now
  auto hand = std::make_unique<HandMadeSender>(sender_transport_.get(), peer_);
  const std::vector<uint8_t> data = RandomBytes(3 * 4096 + 8, 99);
  const std::span<const uint8_t> all(data);
  const uint64_t size = 3 * 4096;
  const uint32_t crc = Crc32c(data.data(), size);
  auto header = [&](uint64_t seq) {
    return EncodeBlockDataHeader({.seq = seq,
                                  .size = size,
                                  .crc32c = crc,
                                  .block_id = absl::StrCat("h", seq),
                                  .pieced = true});
  };
  auto piece = [](uint64_t seq, uint64_t at) {
    return EncodeBlockPieceHeader({.seq = seq, .offset = at});
  };
  // In order: intact.
  hand->Send(kBlockDataMessage, header(1), all.subspan(0, 4096));
  hand->Send(kBlockPieceMessage, piece(1, 4096), all.subspan(4096, 4096));
  hand->Send(kBlockPieceMessage, piece(1, 8192), all.subspan(8192, 4096));
  std::optional<absl::Status> a = hand->Ack(1, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ok()) << *a;
  EXPECT_EQ(sink_.Get("h1"), std::vector<uint8_t>(data.begin(), data.begin() + size));
  // A last piece 8 bytes too long.
  hand->Send(kBlockDataMessage, header(2), all.subspan(0, 4096));
  hand->Send(kBlockPieceMessage, piece(2, 4096), all.subspan(4096, 4096));
  hand->Send(kBlockPieceMessage, piece(2, 8192), all.subspan(8192, 4096 + 8));
  a = hand->Ack(2, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->code(), absl::StatusCode::kInvalidArgument) << *a;
  hand->Send(kBlockPieceMessage, piece(2, 8192), all.subspan(8192, 4096));  // dropped
  // A "pieced" block whose first piece is all of it.
  hand->Send(kBlockDataMessage, header(3), all.subspan(0, size));
  a = hand->Ack(3, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_THAT(a->message(), HasSubstr("in pieces"));
  // A block under a sequence number still arriving (a sender that started again): the old one is
  // freed without an answer, the new one completes.
  hand->Send(kBlockDataMessage, header(4), all.subspan(0, 4096));
  hand->Send(kBlockDataMessage, header(4), all.subspan(0, 4096));
  hand->Send(kBlockPieceMessage, piece(4, 4096), all.subspan(4096, 4096));
  hand->Send(kBlockPieceMessage, piece(4, 8192), all.subspan(8192, 4096));
  a = hand->Ack(4, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ok()) << *a;
  // A block the sender abandons after its first piece (a cancel or timeout on its side).
  hand->Send(kBlockDataMessage, header(6), all.subspan(0, 4096));
  hand->Send(kBlockPieceMessage,
             EncodeBlockPieceHeader({.seq = 6, .offset = 4096, .abandoned = true}));
  a = hand->Ack(6, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->code(), absl::StatusCode::kCancelled) << *a;
  EXPECT_THAT(a->message(), HasSubstr("gave it up"));
  // A block whose sender stops after its first piece, then goes away.
  hand->Send(kBlockDataMessage, header(5), all.subspan(0, 4096));
  EXPECT_FALSE(hand->Ack(5, absl::Milliseconds(300)).has_value());
  EXPECT_EQ(receiver_->stats().aborted, 2u);  // 4's first, 6
  hand.reset();
  peer_.reset();
  sender_transport_.reset();
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (receiver_->stats().aborted < 3 && absl::Now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const BlockReceiver::Stats st = receiver_->stats();
  EXPECT_EQ(st.aborted, 3u);  // 4's first, 6, and 5 when its connection went
  EXPECT_EQ(st.blocks, 2u);
  EXPECT_EQ(st.malformed, 2u);
  EXPECT_EQ(sink_.Get("h4"), sink_.Get("h1"));
  EXPECT_TRUE(sink_.Get("h5").empty());
  EXPECT_TRUE(sink_.Get("h6").empty());
  EXPECT_THAT(receiver_->RenderMetrics(), HasSubstr("strata_transport_received_pending_bytes 0"));
}

// A pieced block whose sender stops sending pieces while its connection stays up is given up
// after the receiver's piece_timeout (DEADLINE_EXCEEDED, its buffer freed, nothing handed on);
// its late pieces are dropped and the next block goes through.
TEST_P(BlockProtocolTest, StalledPiecedBlockIsGivenUpAfterThePieceTimeout) {
  Start({.piece_timeout = absl::Seconds(1)});
  sender_.reset();  // this transport's handlers are the hand-made sender's now
  HandMadeSender hand(sender_transport_.get(), peer_);
  const std::vector<uint8_t> data = RandomBytes(3 * 4096, 7);
  const std::span<const uint8_t> all(data);
  const uint32_t crc = Crc32c(data.data(), data.size());
  auto header = [&](uint64_t seq) {
    return EncodeBlockDataHeader({.seq = seq,
                                  .size = data.size(),
                                  .crc32c = crc,
                                  .block_id = absl::StrCat("s", seq),
                                  .pieced = true});
  };
  const absl::Time start = absl::Now();
  hand.Send(kBlockDataMessage, header(1), all.subspan(0, 4096));
  hand.Send(kBlockPieceMessage, EncodeBlockPieceHeader({.seq = 1, .offset = 4096}),
            all.subspan(4096, 4096));  // ...and not the last piece
  std::optional<absl::Status> a = hand.Ack(1, absl::Seconds(10));
  ASSERT_TRUE(a.has_value()) << "no answer for a stalled pieced block";
  EXPECT_EQ(a->code(), absl::StatusCode::kDeadlineExceeded) << *a;
  EXPECT_THAT(a->message(), HasSubstr("8192 of its 12288 bytes sent"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
  EXPECT_EQ(receiver_->stats().aborted, 1u);
  EXPECT_THAT(receiver_->RenderMetrics(), HasSubstr("strata_transport_received_pending_bytes 0"));
  // The late piece is dropped; block 2 goes through.
  hand.Send(kBlockPieceMessage, EncodeBlockPieceHeader({.seq = 1, .offset = 8192}),
            all.subspan(8192, 4096));
  hand.Send(kBlockDataMessage, header(2), all.subspan(0, 8192));
  hand.Send(kBlockPieceMessage, EncodeBlockPieceHeader({.seq = 2, .offset = 8192}),
            all.subspan(8192, 4096));
  a = hand.Ack(2, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ok()) << *a;
  EXPECT_EQ(sink_.Get("s2"), data);
  EXPECT_TRUE(sink_.Get("s1").empty()) << "a stalled block was handed on";
  const BlockReceiver::Stats st = receiver_->stats();
  EXPECT_EQ(st.blocks, 1u);
  EXPECT_EQ(st.aborted, 1u);
  EXPECT_EQ(st.malformed, 0u);
}

// Blocks sent as payload are refused with RESOURCE_EXHAUSTED, before any byte moves, while they
// would take the bytes the receiver holds past max_pending_bytes; once the held block is done,
// the next one is taken.
TEST_P(BlockProtocolTest, ReceiverHoldingItsLimitRefusesMoreUntilItHasRoom) {
  Start({.max_block_bytes = 64 << 10, .max_pending_bytes = 64 << 10});
  sender_.reset();
  HandMadeSender hand(sender_transport_.get(), peer_);
  const std::vector<uint8_t> data = RandomBytes(48 << 10, 8);
  const std::span<const uint8_t> all(data);
  auto header = [&](uint64_t seq, uint64_t size, bool pieced) {
    return EncodeBlockDataHeader({.seq = seq,
                                  .size = size,
                                  .crc32c = Crc32c(data.data(), size),
                                  .block_id = absl::StrCat("o", seq),
                                  .pieced = pieced});
  };
  // Block 1 (48 KiB) starts and holds its buffer while its pieces come.
  hand.Send(kBlockDataMessage, header(1, 48 << 10, true), all.subspan(0, 16 << 10));
  // Block 2 (32 KiB, whole) would pass the limit.
  hand.Send(kBlockDataMessage, header(2, 32 << 10, false), all.subspan(0, 32 << 10));
  std::optional<absl::Status> a = hand.Ack(2, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->code(), absl::StatusCode::kResourceExhausted) << *a;
  EXPECT_THAT(a->message(), HasSubstr("limit is 65536"));
  // A 16 KiB block fits beside block 1.
  hand.Send(kBlockDataMessage, header(3, 16 << 10, false), all.subspan(0, 16 << 10));
  a = hand.Ack(3, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ok()) << *a;
  hand.Send(kBlockPieceMessage, EncodeBlockPieceHeader({.seq = 1, .offset = 16 << 10}),
            all.subspan(16 << 10, 32 << 10));
  a = hand.Ack(1, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ok()) << *a;
  // Room again: block 2 goes through when sent again.
  hand.Send(kBlockDataMessage, header(4, 32 << 10, false), all.subspan(0, 32 << 10));
  a = hand.Ack(4, absl::Seconds(10));
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ok()) << *a;
  const BlockReceiver::Stats st = receiver_->stats();
  EXPECT_EQ(st.overloaded, 1u);
  EXPECT_EQ(st.blocks, 3u);
  EXPECT_LE(st.max_pending_bytes, uint64_t{64} << 10);
  EXPECT_EQ(sink_.Get("o1"), data);
  EXPECT_TRUE(sink_.Get("o2").empty());
  EXPECT_THAT(receiver_->RenderMetrics(),
              HasSubstr("strata_transport_received_overloaded_total 1"));
}

// A same-host sender that announces a streamed block and stops writing it halfway: the receiver
// gives up after its stall limit (2 s) with DEADLINE_EXCEEDED, never hands the block on, and
// then serves other senders again. One that claims more bytes than the block has is DATA_LOSS.
TEST_P(BlockProtocolTest, StalledOrLyingStreamedSenderFailsItsBlockOnly) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  Start({.inline_max_bytes = 4 << 20}, {});
  sender_.reset();  // this transport's handlers are the hand-made sender's now
  HandMadeSender hand(sender_transport_.get(), peer_);
  const uint64_t token = 0x5eed5eed5eed5eedULL;
  absl::StatusOr<std::span<uint8_t>> ring = hand.MapRing(token);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const size_t n = 1 << 20;
  const auto data = RandomBytes(n, 123);
  const uint64_t offset = kPlacedPrefixBytes;
  auto progress = [&](uint64_t at) -> std::atomic_ref<uint64_t> {
    return std::atomic_ref<uint64_t>(
        *reinterpret_cast<uint64_t*>(ring->data() + at - kPlacedPrefixBytes));
  };
  progress(offset).store(0, std::memory_order_release);
  hand.Announce(1, n, Crc32c(data.data(), n), token, offset);
  std::memcpy(ring->data() + offset, data.data(), n / 2);
  progress(offset).store(n / 2, std::memory_order_release);  // ...and nothing more

  const absl::Time start = absl::Now();
  std::optional<absl::Status> ack = hand.Ack(1, absl::Seconds(15));
  ASSERT_TRUE(ack.has_value()) << "no answer for a stalled block";
  EXPECT_EQ(ack->code(), absl::StatusCode::kDeadlineExceeded) << *ack;
  EXPECT_THAT(std::string(ack->message()), HasSubstr("stopped writing"));
  EXPECT_GE(absl::Now() - start, absl::Seconds(1.5));
  EXPECT_TRUE(sink_.Get("hand1").empty()) << "a stalled block was handed on";

  // A progress word beyond the block's size.
  const uint64_t offset2 = offset + n + kPlacedPrefixBytes;
  progress(offset2).store(0, std::memory_order_release);
  hand.Announce(2, 4096, Crc32c(data.data(), 4096), token, offset2);
  std::memcpy(ring->data() + offset2, data.data(), 4096);
  progress(offset2).store(8192, std::memory_order_release);
  ack = hand.Ack(2, absl::Seconds(15));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->code(), absl::StatusCode::kDataLoss) << *ack;
  EXPECT_TRUE(sink_.Get("hand2").empty()) << "a block with a false progress word was handed on";

  // The receiver goes on serving: a real sender on another transport gets its block through.
  auto other = MakeTransport(GetParam());
  ASSERT_TRUE(other.ok()) << other.status();
  auto s = BlockSender::Create(other->get(), {});
  ASSERT_TRUE(s.ok()) << s.status();
  auto ep = (*other)->Connect(receiver_transport_->address(), absl::Seconds(10));
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_TRUE((*s)->Send(*ep, "after", View(data))->Wait().ok());
  EXPECT_EQ(sink_.Get("after"), data);
  s->reset();
  ep->reset();
  EXPECT_EQ(receiver_->stats().blocks, 1u);  // only the last one
}

// A streamed block whose transfer times out while the sender is still copying it (the deadline
// has passed before the copy starts; the sender's watchdog notices during it): the copy stops
// early, the transfer completes with DEADLINE_EXCEEDED, the receiver (left with part of a
// block) never hands on a partial block, and the ring space comes back for later blocks.
TEST_P(BlockProtocolTest, TimeoutDuringAStreamedCopyFreesItsSpaceAndHandsOnNoPart) {
  if (GetParam().name != "ucx_shm") GTEST_SKIP() << "no direct placement on " << GetParam().name;
  Start({.ring_bytes = 80 << 20}, {.placement_min_bytes = 1});
  ASSERT_TRUE(WaitForRing(*sender_, peer_, absl::Seconds(10)));
  const auto big = RandomBytes(64 << 20, 124);
  auto t = sender_->Send(peer_, "cut", View(big), {.timeout = absl::Microseconds(200)});
  EXPECT_EQ(t->Wait().code(), absl::StatusCode::kDeadlineExceeded) << t->status();
  // The ring holds one such block: the next is placed only once the cut one's space is back
  // (the receiver gives up on it after its 2 s stall limit).
  const absl::Time until = absl::Now() + absl::Seconds(20);
  const uint64_t placed_before = receiver_->stats().placed;
  bool placed_again = false;
  for (int i = 0; !placed_again && absl::Now() < until; ++i) {
    const std::string id = absl::StrCat("next", i);
    ASSERT_TRUE(sender_->Send(peer_, id, View(big))->Wait().ok()) << i;
    EXPECT_EQ(sink_.Get(id), big) << i;
    placed_again = receiver_->stats().placed > placed_before;
  }
  EXPECT_TRUE(placed_again) << "the cut block's ring space never came back";
  EXPECT_EQ(sender_->stats().rings_renewed, 0u) << "the ring was replaced, not given back space";
  // Normally the copy was cut and the receiver gave up on the block. Only if the watchdog got no
  // core during the whole copy (a loaded machine) did the block arrive whole: then it is intact.
  const std::vector<uint8_t> cut = sink_.Get("cut");
  if (!cut.empty()) {
    EXPECT_EQ(cut, big) << "a partial block was handed on";
    std::cerr << "note: the copy finished before the watchdog stopped it\n";
  }
}

// A send that is refused before it goes (no endpoint, an id too long) fails with the reason and
// does not read the payload: here bytes that are not there, which a checksum would fault on.
TEST_P(BlockProtocolTest, ASendRefusedAtOnceNeverReadsItsPayload) {
  Start();
  const Payload unreadable{.bytes = {reinterpret_cast<const uint8_t*>(uintptr_t{4096}), 1 << 20}};
  absl::Status s = sender_->Send(nullptr, "x", unreadable)->Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("null endpoint"));
  s = sender_->Send(peer_, std::string(kMaxBlockIdBytes + 1, 'x'), unreadable)->Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("block id of"));
}

// A peer that takes payloads but never answers, then shuts down: pending transfers fail with
// UNAVAILABLE (well before their timeout), the endpoint reports it, a new peer can be reached.
TEST_P(BlockProtocolTest, PeerShutdownFailsPendingTransfersAndReconnectWorks) {
  Start();
  auto hung = MakeTransport(GetParam());
  ASSERT_TRUE(hung.ok());
  std::vector<std::vector<uint8_t>> held;
  held.reserve(8);  // no reallocation under a payload being written
  std::mutex mu;
  std::atomic<int> arrived{0};
  (*hung)->SetHandler(kBlockDataMessage, [&](IncomingMessage& m) {
    std::lock_guard<std::mutex> lock(mu);
    held.emplace_back(m.payload_size());
    m.Accept({.bytes = {held.back().data(), held.back().size()}},
             [&](absl::Status) { arrived.fetch_add(1); });
  });
  auto ep = sender_transport_->Connect((*hung)->address(), absl::Seconds(10));
  ASSERT_TRUE(ep.ok()) << ep.status();
  const auto data = RandomBytes(2 << 20, 11);
  std::vector<std::shared_ptr<Transfer>> ts;
  for (int i = 0; i < 3; ++i) {
    ts.push_back(
        sender_->Send(*ep, absl::StrCat("h", i), View(data), {.timeout = absl::Seconds(60)}));
  }
  for (int i = 0; i < 1000 && arrived.load() < 3; ++i) absl::SleepFor(absl::Milliseconds(5));
  const absl::Time start = absl::Now();
  hung->reset();
  for (auto& t : ts) {
    ASSERT_TRUE(t->WaitFor(absl::Seconds(30)));
    EXPECT_EQ(t->status().code(), absl::StatusCode::kUnavailable) << t->status();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  for (int i = 0; i < 500 && (*ep)->health().ok(); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ((*ep)->health().code(), absl::StatusCode::kUnavailable);
  // The sender refuses at once on a failed endpoint.
  EXPECT_EQ(sender_->Send(*ep, "after", View(data))->Wait().code(), absl::StatusCode::kUnavailable);
  // And the healthy peer is unaffected.
  EXPECT_TRUE(sender_->Send(peer_, "still", View(data))->Wait().ok());
}

// A sender that restarts under the same name (a node coming back) gets its acks: the receiver's
// reply endpoint to the old incarnation is not reused.
TEST(InprocTransportTest, APeerRestartedUnderTheSameNameIsAnsweredAgain) {
  auto receiver_t = CreateInprocTransport({.name = "restart-receiver"});
  ASSERT_TRUE(receiver_t.ok());
  Sink sink;
  auto receiver =
      BlockReceiver::Create(receiver_t->get(), {}, [&](ReceivedBlock b) { return sink.Take(b); });
  ASSERT_TRUE(receiver.ok());
  const auto data = RandomBytes(1000, 40);
  for (int life = 0; life < 2; ++life) {
    auto t = CreateInprocTransport({.name = "restart-sender"});
    ASSERT_TRUE(t.ok()) << t.status();
    auto sender = BlockSender::Create(t->get(), {.timeout = absl::Seconds(5)});
    ASSERT_TRUE(sender.ok());
    auto ep = (*t)->Connect("inproc://restart-receiver", absl::Seconds(1));
    ASSERT_TRUE(ep.ok());
    absl::Status s = (*sender)->Send(*ep, absl::StrCat("life", life), View(data))->Wait();
    EXPECT_TRUE(s.ok()) << "life " << life << ": " << s;
  }
  EXPECT_EQ(sink.count(), 2u);
}

// ---- a peer in another process, killed with SIGKILL --------------------------------------------

// The child: a receiver whose consumer stalls after noting that a block arrived.
TEST(TransportChild, DISABLED_StallingReceiver) {
  const char* dir = std::getenv("STRATA_TRANSPORT_CHILD_DIR");
  const char* tls = std::getenv("STRATA_TRANSPORT_CHILD_TLS");
  if (dir == nullptr || tls == nullptr) GTEST_SKIP() << "run by the peer-killed test";
  auto t = CreateUcxTransport({.tls = tls});
  if (!t.ok()) _exit(2);
  auto r = BlockReceiver::Create(t->get(), {}, [dir](ReceivedBlock) {
    std::ofstream(std::string(dir) + "/got") << "1" << std::flush;
    for (;;) pause();
    return absl::OkStatus();
  });
  if (!r.ok()) _exit(3);
  { std::ofstream(std::string(dir) + "/address.tmp") << (*t)->address() << std::flush; }
  std::filesystem::rename(std::string(dir) + "/address.tmp", std::string(dir) + "/address");
  for (;;) pause();
}

TEST_P(BlockProtocolTest, KilledPeerProcessFailsPendingTransfersWithUnavailable) {
  if (!sender_transport_->capabilities().cross_process) {
    GTEST_SKIP() << GetParam().name << " does not reach other processes";
  }
  auto s = BlockSender::Create(sender_transport_.get(), {});
  ASSERT_TRUE(s.ok());
  sender_ = std::move(*s);
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/transport-child-", getpid(), "-", GetParam().name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  // posix_spawn, not fork: this process has UCX's threads (and UCX's fork handlers).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back("STRATA_TRANSPORT_CHILD_DIR=" + dir);
  env_strings.push_back("STRATA_TRANSPORT_CHILD_TLS=" + GetParam().tls);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string a1 = "--gtest_filter=TransportChild.DISABLED_StallingReceiver";
  std::string a2 = "--gtest_also_run_disabled_tests";
  std::string a0 = self;
  char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  std::string address;
  for (int i = 0; i < 2000 && address.empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    std::ifstream(dir + "/address") >> address;
  }
  ASSERT_FALSE(address.empty()) << "the child did not start";
  auto ep = sender_transport_->Connect(address, absl::Seconds(10));
  ASSERT_TRUE(ep.ok()) << ep.status();
  const auto data = RandomBytes(4 << 20, 12);
  std::vector<std::shared_ptr<Transfer>> ts;
  for (int i = 0; i < 3; ++i) {
    ts.push_back(
        sender_->Send(*ep, absl::StrCat("k", i), View(data), {.timeout = absl::Seconds(60)}));
  }
  for (int i = 0; i < 2000 && !std::filesystem::exists(dir + "/got"); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/got")) << "no block reached the child";
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  const absl::Time killed = absl::Now();
  for (auto& t : ts) {
    ASSERT_TRUE(t->WaitFor(absl::Seconds(45))) << "transfer still pending after the peer died";
    EXPECT_EQ(t->status().code(), absl::StatusCode::kUnavailable) << t->status();
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(45));
  EXPECT_EQ((*ep)->health().code(), absl::StatusCode::kUnavailable);

  // Reconnect: a new receiver in this process is reachable through the same transport.
  Start();
  EXPECT_TRUE(sender_->Send(peer_, "again", View(data))->Wait().ok());
  EXPECT_EQ(sink_.Get("again"), data);
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Backends, BlockProtocolTest, ::testing::ValuesIn(testing::AllBackends()),
                         testing::BackendName);

}  // namespace
}  // namespace strata::transport
