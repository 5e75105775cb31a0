#include "kvstore/store_service.h"

#include <string>

#include "common/block_reader.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"

namespace strata::kvstore {
namespace {

using testing::HasSubstr;

AlignedBuffer MakeBlock(uint32_t chunk, uint32_t tokens = 256) {
  std::vector<float> k(size_t{tokens} * 2 * 64, 0.25f * chunk), v(k.size(), -0.5f);
  auto codec = *kernels::Codec::Create("kivi:k2v2:g32");
  return *codec->Encode({k.data(), v.data(), SourceDType::kFloat32, tokens, 2, 64},
                        {.layer = 0, .chunk_index = chunk, .model_fingerprint = 9});
}

BlockHash Key(uint8_t i) {
  BlockHash h{};
  h[0] = i;
  return h;
}

std::string NameOf(const AlignedBuffer& b, uint8_t key) {
  const BlockHeader h = BlockView::Parse(b.span())->header();
  return BlockName{h.model_fingerprint, h.codec_fingerprint, h.calibration_fingerprint, Key(key),
                   h.layer}
      .Encode();
}

// A real server on a loopback port, a real client.
class StoreServiceTest : public testing::Test {
 protected:
  void SetUp() override {
    store_ = *BlockStore::Open({.ram_bytes = 1 << 24, .max_block_bytes = 1 << 20});
    service_ = std::make_unique<StoreService>(store_.get(), 1 << 20);
    int port = 0;
    server_ = *StartStoreServer(service_.get(), "127.0.0.1:0", 1 << 20, &port);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(8 << 20);
    args.SetMaxSendMessageSize(8 << 20);
    stub_ = strata::v1::Store::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<strata::v1::Store::Stub> stub_;
};

TEST_F(StoreServiceTest, PutLookupGetStreamsDeleteStats) {
  AlignedBuffer b0 = MakeBlock(0), b1 = MakeBlock(1);
  for (int i = 0; i < 2; ++i) {
    const AlignedBuffer& b = i == 0 ? b0 : b1;
    strata::v1::PutRequest put;
    put.set_name(NameOf(b, static_cast<uint8_t>(i)));
    if (i == 1) put.set_parent_key(std::string(32, '\0'));  // Key(0)
    put.set_block(reinterpret_cast<const char*>(b.data()), b.size());
    strata::v1::PutResponse pr;
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->Put(&ctx, put, &pr);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const BlockHeader h = BlockView::Parse(b0.span())->header();
  strata::v1::LookupRequest lk;
  lk.set_model_fingerprint(h.model_fingerprint);
  lk.set_codec_fingerprint(h.codec_fingerprint);
  lk.set_layers(1);
  for (uint8_t i : {0, 1, 2}) lk.add_chain(std::string(reinterpret_cast<const char*>(Key(i).data()), 32));
  strata::v1::LookupResponse lr;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Lookup(&ctx, lk, &lr).ok());
  }
  EXPECT_EQ(lr.chunks(), 2u);
  ASSERT_EQ(lr.tiers_size(), 2);
  EXPECT_EQ(lr.tiers(0), strata::v1::TIER_RAM);
  // Get streams the block in pieces that reassemble exactly.
  strata::v1::GetRequest get;
  get.set_name(NameOf(b1, 1));
  get.set_max_chunk_bytes(4096);
  grpc::ClientContext gctx;
  auto reader = stub_->Get(&gctx, get);
  strata::v1::GetResponse piece;
  std::string bytes;
  int pieces = 0;
  uint64_t total = 0;
  while (reader->Read(&piece)) {
    if (pieces++ == 0) total = piece.total_bytes();
    bytes += piece.data();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(total, b1.size());
  EXPECT_EQ(bytes, std::string(reinterpret_cast<const char*>(b1.data()), b1.size()));
  EXPECT_GT(pieces, 1);
  // Delete, then Get is NOT_FOUND; stats count it all.
  strata::v1::DeleteRequest del;
  del.set_name(NameOf(b0, 0));
  strata::v1::DeleteResponse dr;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Delete(&ctx, del, &dr).ok());
  }
  EXPECT_TRUE(dr.deleted());
  {
    grpc::ClientContext ctx;
    auto r = stub_->Get(&ctx, get);
    while (r->Read(&piece)) {
    }
    EXPECT_EQ(r->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  strata::v1::StatsResponse st;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Stats(&ctx, strata::v1::StatsRequest(), &st).ok());
  }
  EXPECT_EQ(st.counters().at("puts"), 2u);
  const std::string metrics = service_->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("strata_store_puts_total 2\n"));
  EXPECT_THAT(metrics, HasSubstr("strata_store_rpc_seconds_count{rpc=\"put\"} 2\n"));
  EXPECT_THAT(metrics, HasSubstr("strata_store_rpc_seconds_count{rpc=\"get\"} 2\n"));
  EXPECT_EQ(st.counters().at("orphans_dropped"), 1u);
  EXPECT_EQ(st.counters().at("ram_blocks"), 0u);
}

TEST_F(StoreServiceTest, MalformedRequestsAreInvalidArgumentWithAReason) {
  AlignedBuffer b = MakeBlock(0);
  struct Case {
    std::string name, parent, block, message;
  } cases[] = {
      {"short", "", std::string(reinterpret_cast<const char*>(b.data()), b.size()),
       "put: name is 5 bytes"},
      {NameOf(b, 0), "xyz", std::string(reinterpret_cast<const char*>(b.data()), b.size()),
       "parent_key is 3 bytes"},
      {NameOf(b, 0), "", "not a block at all", "block"},
      {NameOf(b, 0), "", std::string(2 << 20, 'x'), "exceeds"},
  };
  for (const Case& c : cases) {
    strata::v1::PutRequest put;
    put.set_name(c.name);
    put.set_parent_key(c.parent);
    put.set_block(c.block);
    strata::v1::PutResponse pr;
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->Put(&ctx, put, &pr);
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED)
        << c.message << ": " << s.error_code() << " " << s.error_message();
    if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    }
  }
  strata::v1::LookupRequest lk;
  lk.set_layers(1);
  lk.add_chain("short");
  strata::v1::LookupResponse lr;
  grpc::ClientContext ctx;
  const grpc::Status s = stub_->Lookup(&ctx, lk, &lr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("chain[0] is 5 bytes"));
}

}  // namespace
}  // namespace strata::kvstore
