#include "transport/shipment.h"

#include "gtest/gtest.h"

namespace strata::transport {
namespace {

TEST(ShipmentTest, IdsRoundTripAndNameEveryKind) {
  BlockHash parent{}, key{};
  parent[0] = 7;
  key[31] = 9;
  const ShipmentId block{.kind = ShipmentKind::kBlock,
                         .request_id = "chatcmpl-abc123",
                         .layer = 2,
                         .chunk = 5,
                         .name = {.model_fingerprint = 1, .codec_fingerprint = 2, .key = key, .layer = 2},
                         .parent_key = parent};
  absl::StatusOr<ShipmentId> back = ShipmentId::Decode(block.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->request_id, "chatcmpl-abc123");
  EXPECT_EQ(back->chunk, 5u);
  EXPECT_EQ(back->name, block.name);
  EXPECT_EQ(back->parent_key, parent);
  for (ShipmentKind k : {ShipmentKind::kWindow, ShipmentKind::kEnd, ShipmentKind::kAbort}) {
    const ShipmentId id{.kind = k, .request_id = "r1", .layer = 1};
    absl::StatusOr<ShipmentId> b = ShipmentId::Decode(id.Encode());
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->kind, k);
    EXPECT_EQ(b->layer, 1u);
  }
  const ShipmentEnd end{.first_token = 42, .prompt_tokens = 300, .chunks = 1, .layers = 3,
                        .window_tokens = 44, .cached_tokens = 256};
  absl::StatusOr<ShipmentEnd> e = ShipmentEnd::Decode(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(end.Encode().data()), 32));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->first_token, 42u);
  EXPECT_EQ(e->cached_tokens, 256u);
}

TEST(ShipmentTest, MalformedIdsAreRefusedNamingTheField) {
  const ShipmentId id{.kind = ShipmentKind::kBlock, .request_id = "r", .layer = 0, .chunk = 0};
  std::string good = id.Encode();
  EXPECT_EQ(ShipmentId::Decode(good.substr(0, 5)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShipmentId::Decode(good + "x").status().code(), absl::StatusCode::kInvalidArgument);
  std::string kind = good;
  kind[1] = 9;
  EXPECT_EQ(ShipmentId::Decode(kind).status().code(), absl::StatusCode::kInvalidArgument);
  std::string orphan = good;
  orphan[8] = 3;  // chunk 3 without a parent key
  EXPECT_EQ(ShipmentId::Decode(orphan).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateRequestId("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateRequestId("a b").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateRequestId(std::string(129, 'a')).code(), absl::StatusCode::kInvalidArgument);
  const ShipmentEnd bad{.prompt_tokens = 1, .cached_tokens = 2};
  const std::string b = bad.Encode();
  EXPECT_EQ(ShipmentEnd::Decode(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(b.data()), b.size()))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::transport
