// The protocol's wire format: round trips, and every malformed header refused with a message.
// (Behaviour over real transports: tests/conformance/transport_conformance_test.cc.)
#include "transport/block_protocol.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::transport {
namespace {

using ::testing::HasSubstr;

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(BlockWireTest, DataHeaderRoundTrips) {
  BlockDataHeader h{.seq = 42, .size = 1ull << 33, .crc32c = 0xdeadbeef,
                    .block_id = std::string("key\0with\xffnul", 12)};
  absl::StatusOr<BlockDataHeader> d = DecodeBlockDataHeader(Bytes(EncodeBlockDataHeader(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->seq, 42u);
  EXPECT_EQ(d->size, 1ull << 33);
  EXPECT_EQ(d->crc32c, 0xdeadbeefu);
  EXPECT_EQ(d->block_id, h.block_id);
}

TEST(BlockWireTest, AckHeaderRoundTripsAndTruncatesLongMessages) {
  BlockAckHeader h{.seq = 7, .status = absl::DataLossError(std::string(2000, 'x'))};
  absl::StatusOr<BlockAckHeader> d = DecodeBlockAckHeader(Bytes(EncodeBlockAckHeader(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->seq, 7u);
  EXPECT_EQ(d->status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(d->status.message().size(), kMaxAckMessageBytes);
  BlockAckHeader ok{.seq = 8, .status = absl::OkStatus()};
  EXPECT_TRUE(DecodeBlockAckHeader(Bytes(EncodeBlockAckHeader(ok)))->status.ok());
}

TEST(BlockWireTest, EveryTruncationOfAHeaderIsRefused) {
  const std::string data =
      EncodeBlockDataHeader({.seq = 1, .size = 10, .crc32c = 3, .block_id = "abc"});
  for (size_t n = 0; n < data.size(); ++n) {
    EXPECT_EQ(DecodeBlockDataHeader(Bytes(data.substr(0, n))).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  const std::string ack = EncodeBlockAckHeader({.seq = 1, .status = absl::InternalError("m")});
  for (size_t n = 0; n < ack.size(); ++n) {
    EXPECT_EQ(DecodeBlockAckHeader(Bytes(ack.substr(0, n))).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
}

TEST(BlockWireTest, MalformedFieldsAreNamed) {
  std::string data = EncodeBlockDataHeader({.seq = 1, .size = 10, .crc32c = 3, .block_id = "abc"});
  std::string bad_magic = data;
  bad_magic[0] ^= 1;
  EXPECT_THAT(DecodeBlockDataHeader(Bytes(bad_magic)).status().message(), HasSubstr("magic"));
  std::string bad_version = data;
  bad_version[4] = 9;
  EXPECT_THAT(DecodeBlockDataHeader(Bytes(bad_version)).status().message(),
              HasSubstr("wire version 9"));
  std::string long_id = data;
  long_id[6] = static_cast<char>(0xff);
  long_id[7] = static_cast<char>(0xff);
  EXPECT_THAT(DecodeBlockDataHeader(Bytes(long_id)).status().message(), HasSubstr("block id"));
  EXPECT_THAT(DecodeBlockDataHeader(Bytes(data + "trailing")).status().message(),
              HasSubstr("block id length"));
  std::string ack = EncodeBlockAckHeader({.seq = 1, .status = absl::InternalError("m")});
  ack[16] = 99;  // status code out of range
  EXPECT_THAT(DecodeBlockAckHeader(Bytes(ack)).status().message(), HasSubstr("status code 99"));
}

TEST(BlockWireTest, PlacedAndStreamedHeadersRoundTrip) {
  BlockDataHeader h{.seq = 3, .size = 1 << 20, .crc32c = 9, .block_id = "layer-0",
                    .placed = RingPlace{.token = 0xabcdef0123456789, .offset = 4160},
                    .streamed = true};
  absl::StatusOr<BlockDataHeader> d = DecodeBlockDataHeader(Bytes(EncodeBlockDataHeader(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->placed.has_value());
  EXPECT_EQ(*d->placed, *h.placed);
  EXPECT_TRUE(d->streamed);
  EXPECT_EQ(d->block_id, "layer-0");
  h.streamed = false;
  d = DecodeBlockDataHeader(Bytes(EncodeBlockDataHeader(h)));
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->streamed);
  // "Streamed" without "placed", "pieced" with either, or an unknown flag, is refused.
  std::string bad = EncodeBlockDataHeader({.seq = 1, .size = 1, .crc32c = 0, .block_id = "x"});
  for (char flags : {'\x02', '\x06', '\x08', '\x80'}) {
    bad[5] = flags;
    EXPECT_THAT(DecodeBlockDataHeader(Bytes(bad)).status().message(), HasSubstr("flags"));
  }
  // The placed flag without the place (the header is 16 bytes short).
  bad[5] = 1;
  EXPECT_EQ(DecodeBlockDataHeader(Bytes(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);

  BlockAckHeader a{.seq = 5, .status = absl::OkStatus(), .released = RingPlace{7, 64}};
  absl::StatusOr<BlockAckHeader> da = DecodeBlockAckHeader(Bytes(EncodeBlockAckHeader(a)));
  ASSERT_TRUE(da.ok()) << da.status();
  ASSERT_TRUE(da->released.has_value());
  EXPECT_EQ(*da->released, *a.released);
  EXPECT_FALSE(da->retryable);
  a.retryable = true;
  a.status = absl::DataLossError("damaged");
  da = DecodeBlockAckHeader(Bytes(EncodeBlockAckHeader(a)));
  ASSERT_TRUE(da.ok()) << da.status();
  EXPECT_TRUE(da->retryable);
  EXPECT_TRUE(da->released.has_value());
  std::string unknown = EncodeBlockAckHeader({.seq = 1, .status = absl::OkStatus()});
  unknown[5] = 4;
  EXPECT_THAT(DecodeBlockAckHeader(Bytes(unknown)).status().message(), HasSubstr("unknown flags"));
}

TEST(BlockWireTest, PiecedHeadersAndPiecesRoundTrip) {
  BlockDataHeader h{.seq = 4, .size = 3 << 20, .crc32c = 11, .block_id = "layer-1",
                    .pieced = true};
  absl::StatusOr<BlockDataHeader> d = DecodeBlockDataHeader(Bytes(EncodeBlockDataHeader(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->pieced);
  EXPECT_FALSE(d->placed.has_value());
  const std::string whole = EncodeBlockDataHeader({.seq = 1, .block_id = "x"});
  EXPECT_FALSE(DecodeBlockDataHeader(Bytes(whole)).value().pieced);
  // Placed and pieced at once (flags 5, with the place) is refused.
  std::string placed = EncodeBlockDataHeader(
      {.seq = 1, .size = 1, .block_id = "x", .placed = RingPlace{.token = 1, .offset = 64}});
  placed[5] = 5;
  EXPECT_THAT(DecodeBlockDataHeader(Bytes(placed)).status().message(), HasSubstr("flags 5"));

  const std::string piece = EncodeBlockPieceHeader({.seq = 9, .offset = 5ull << 32});
  absl::StatusOr<BlockPieceHeader> p = DecodeBlockPieceHeader(Bytes(piece));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->seq, 9u);
  EXPECT_EQ(p->offset, 5ull << 32);
  for (size_t n = 0; n < piece.size(); ++n) {
    EXPECT_EQ(DecodeBlockPieceHeader(Bytes(piece.substr(0, n))).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  for (size_t at : {0, 4, 5, 6}) {  // magic, version, reserved fields
    std::string bad = piece;
    bad[at] ^= 2;
    EXPECT_THAT(DecodeBlockPieceHeader(Bytes(bad)).status().message(),
                HasSubstr("block piece header"))
        << at;
  }
  EXPECT_FALSE(DecodeBlockPieceHeader(Bytes(piece + "x")).ok());
  EXPECT_FALSE(p->abandoned);
  p = DecodeBlockPieceHeader(
      Bytes(EncodeBlockPieceHeader({.seq = 9, .offset = 4096, .abandoned = true})));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->abandoned);
  EXPECT_EQ(p->offset, 4096u);
}

TEST(BlockWireTest, RingMessagesRoundTripAndRefuseGarbage) {
  absl::StatusOr<RingRequest> rq = DecodeRingRequest(Bytes(EncodeRingRequest({.token = 77})));
  ASSERT_TRUE(rq.ok()) << rq.status();
  EXPECT_EQ(rq->token, 77u);

  const RingGrant lent{.token = 5, .code = absl::StatusCode::kOk, .descriptor = "desc"};
  absl::StatusOr<RingGrant> g = DecodeRingGrant(Bytes(EncodeRingGrant(lent)));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->descriptor, "desc");
  const RingGrant refused{.token = 5, .code = absl::StatusCode::kResourceExhausted};
  g = DecodeRingGrant(Bytes(EncodeRingGrant(refused)));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->code, absl::StatusCode::kResourceExhausted);
  // A grant without a descriptor, or a refusal with one, is malformed.
  EXPECT_THAT(DecodeRingGrant(Bytes(EncodeRingGrant({.token = 5}))).status().message(),
              HasSubstr("descriptor"));
  EXPECT_THAT(DecodeRingGrant(Bytes(EncodeRingGrant({.token = 5,
                                                     .code = absl::StatusCode::kInternal,
                                                     .descriptor = "d"})))
                  .status()
                  .message(),
              HasSubstr("descriptor"));

  const RingRelease rel{.token = 9, .drop = false, .offsets = {64, 1 << 20}};
  absl::StatusOr<RingRelease> r = DecodeRingRelease(Bytes(EncodeRingRelease(rel)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->offsets, rel.offsets);
  EXPECT_FALSE(r->drop);
  std::string bad = EncodeRingRelease(rel);
  bad[6] = 3;  // says three offsets, carries two
  EXPECT_THAT(DecodeRingRelease(Bytes(bad)).status().message(), HasSubstr("3 offsets"));

  for (const std::string& m : {EncodeRingRequest({.token = 1}), EncodeRingGrant(lent),
                               EncodeRingRelease(rel)}) {
    for (size_t n = 0; n < m.size(); ++n) {
      const std::string prefix = m.substr(0, n);
      const auto b = Bytes(prefix);
      EXPECT_FALSE(DecodeRingRequest(b).ok() || DecodeRingGrant(b).ok() ||
                   DecodeRingRelease(b).ok())
          << n;
    }
  }
}

TEST(BlockWireTest, OptionsValidate) {
  EXPECT_FALSE(BlockReceiverOptions{.verify_threads = 0}.Validate().ok());
  EXPECT_FALSE(BlockReceiverOptions{.max_block_bytes = 0}.Validate().ok());
  EXPECT_FALSE(BlockReceiverOptions{.max_rings = -1}.Validate().ok());
  const BlockReceiverOptions small_limit{.max_block_bytes = 2 << 20,
                                         .max_pending_bytes = 1 << 20};
  EXPECT_FALSE(small_limit.Validate().ok());
  EXPECT_FALSE(BlockReceiverOptions{.stall_timeout = absl::ZeroDuration()}.Validate().ok());
  EXPECT_FALSE(BlockReceiverOptions{.piece_timeout = -absl::Seconds(1)}.Validate().ok());
  EXPECT_TRUE(BlockReceiverOptions{}.Validate().ok());
  EXPECT_FALSE(BlockSenderOptions{.max_bytes_in_flight = 0}.Validate().ok());
  EXPECT_FALSE(BlockSenderOptions{.timeout = absl::ZeroDuration()}.Validate().ok());
  EXPECT_FALSE(BlockSenderOptions{.reclaim_after = -absl::Seconds(1)}.Validate().ok());
  EXPECT_FALSE(BlockSenderOptions{.max_attempts = 0}.Validate().ok());
  EXPECT_FALSE(BlockSenderOptions{.retry_backoff = -absl::Seconds(1)}.Validate().ok());
  EXPECT_FALSE(BlockSenderOptions{.piece_bytes = 100}.Validate().ok());
  EXPECT_TRUE(BlockSenderOptions{.piece_bytes = 0}.Validate().ok());
  EXPECT_TRUE(BlockSenderOptions{}.Validate().ok());
}

}  // namespace
}  // namespace strata::transport
