#include "kvstore/store_service.h"

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/block_reader.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvstore/store_client.h"

namespace strata::kvstore {
namespace {

using testing::HasSubstr;

AlignedBuffer MakeBlock(uint32_t chunk, uint32_t tokens = 256, uint32_t layer = 0,
                        const char* codec_spec = "kivi:k2v2:g32") {
  std::vector<float> k(size_t{tokens} * 2 * 64, 0.25f * chunk), v(k.size(), -0.5f);
  auto codec = *kernels::Codec::Create(codec_spec);
  return *codec->Encode({k.data(), v.data(), SourceDType::kFloat32, tokens, 2, 64},
                        {.layer = layer, .chunk_index = chunk, .model_fingerprint = 9});
}

BlockHash Key(uint8_t i) {
  BlockHash h{};
  h[0] = i;
  return h;
}

BlockName BlockNameOf(const AlignedBuffer& b, uint8_t key) {
  const BlockHeader h = BlockView::Parse(b.span())->header();
  return BlockName{h.model_fingerprint, h.codec_fingerprint, h.calibration_fingerprint, Key(key),
                   h.layer};
}

std::string NameOf(const AlignedBuffer& b, uint8_t key) { return BlockNameOf(b, key).Encode(); }

std::string KeyString(uint8_t i) {
  return std::string(reinterpret_cast<const char*>(Key(i).data()), 32);
}

std::string Bytes(const AlignedBuffer& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

strata::v1::PutRequest PutReq(const AlignedBuffer& b, uint8_t key, bool has_parent) {
  strata::v1::PutRequest put;
  put.set_name(NameOf(b, key));
  if (has_parent) put.set_parent_key(KeyString(key - 1));
  put.set_block(Bytes(b));
  return put;
}

// A real server on a loopback port, a real client.
class StoreServiceTest : public testing::Test {
 protected:
  void SetUp() override {
    StartServer("127.0.0.1:0");
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(8 << 20);
    args.SetMaxSendMessageSize(8 << 20);
    stub_ = strata::v1::Store::NewStub(grpc::CreateCustomChannel(
        address_, grpc::InsecureChannelCredentials(), args));
  }
  void TearDown() override { StopServer(); }

  void StartServer(const std::string& listen) {
    store_ = *BlockStore::Open({.ram_bytes = 1 << 24, .max_block_bytes = 1 << 20});
    service_ = std::make_unique<StoreService>(store_.get(), 1 << 20);
    int port = 0;
    server_ = *StartStoreServer(service_.get(), listen, 1 << 20, &port);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void StopServer() {
    if (server_ == nullptr) return;
    StopStoreServer(server_.get(), service_.get(), absl::Seconds(5));
    server_.reset();
    service_.reset();
    store_.reset();
  }

  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<strata::v1::Store::Stub> stub_;
};

// Collects a Watch's updates; tests wait on a condition of them, never on time.
class Collector {
 public:
  WatchCallback callback() {
    return [this](const WatchUpdate& u) {
      std::lock_guard<std::mutex> lock(mu_);
      updates_.push_back(u);
      cv_.notify_all();
    };
  }
  // Waits (up to a minute) until pred(updates) holds; false if it never did.
  bool WaitFor(const std::function<bool(const std::vector<WatchUpdate>&)>& pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return pred(updates_); });
  }
  std::vector<WatchUpdate> updates() {
    std::lock_guard<std::mutex> lock(mu_);
    return updates_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<WatchUpdate> updates_;
};

bool Has(const std::vector<WatchUpdate>& us, WatchUpdate::Kind kind, size_t n = 1) {
  return static_cast<size_t>(std::count_if(us.begin(), us.end(), [&](const WatchUpdate& u) {
           return u.kind == kind;
         })) >= n;
}

// A condition for Collector::WaitFor: at least n updates of `kind`.
std::function<bool(const std::vector<WatchUpdate>&)> AtLeast(WatchUpdate::Kind kind,
                                                             size_t n = 1) {
  return [=](const std::vector<WatchUpdate>& us) { return Has(us, kind, n); };
}

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

// Per-layer codecs over RPC: layer l is looked up under layer_codec_fingerprints[l].
TEST_F(StoreServiceTest, LookupWithPerLayerCodecFingerprints) {
  const char* codecs[2] = {"kivi:k2v2:g32", "fp16"};
  strata::v1::LookupRequest lk;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    for (uint8_t c = 0; c < 2; ++c) {
      const AlignedBuffer b = MakeBlock(c, 64, layer, codecs[layer]);
      strata::v1::PutResponse pr;
      grpc::ClientContext ctx;
      const grpc::Status s = stub_->Put(&ctx, PutReq(b, c, c > 0), &pr);
      ASSERT_TRUE(s.ok()) << s.error_message();
      if (c == 0) {
        const BlockName n = BlockNameOf(b, 0);
        lk.set_model_fingerprint(n.model_fingerprint);
        lk.add_layer_codec_fingerprints(n.codec_fingerprint);
      }
    }
  }
  ASSERT_NE(lk.layer_codec_fingerprints(0), lk.layer_codec_fingerprints(1));
  for (uint8_t i : {0, 1, 2}) lk.add_chain(KeyString(i));
  auto lookup = [&](const strata::v1::LookupRequest& req, strata::v1::LookupResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->Lookup(&ctx, req, resp);
  };
  strata::v1::LookupResponse lr;
  ASSERT_TRUE(lookup(lk, &lr).ok());
  EXPECT_EQ(lr.chunks(), 2u);
  lk.set_layers(2);  // may be given, if it agrees
  ASSERT_TRUE(lookup(lk, &lr).ok());
  EXPECT_EQ(lr.chunks(), 2u);
  strata::v1::LookupRequest one_codec = lk;  // the old form: one codec for every layer
  one_codec.clear_layer_codec_fingerprints();
  one_codec.set_codec_fingerprint(lk.layer_codec_fingerprints(0));
  ASSERT_TRUE(lookup(one_codec, &lr).ok());
  EXPECT_EQ(lr.chunks(), 0u);
  lk.set_layers(3);
  grpc::Status s = lookup(lk, &lr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("layer_codec_fingerprints"));
  lk.set_layers(0);
  for (int i = 0; i < 4096; ++i) lk.add_layer_codec_fingerprints(1);
  s = lookup(lk, &lr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("layer_codec_fingerprints has 4098 entries"));
}

TEST_F(StoreServiceTest, PutStreamAnswersEveryBlockInOrder) {
  strata::v1::PutStreamResponse resp;
  grpc::ClientContext ctx;
  auto writer = stub_->PutStream(&ctx, &resp);
  for (uint8_t c = 0; c < 3; ++c) ASSERT_TRUE(writer->Write(PutReq(MakeBlock(c), c, c > 0)));
  ASSERT_TRUE(writer->Write(PutReq(MakeBlock(5), 5, true)));  // its parent (4) is not stored
  strata::v1::PutRequest bad = PutReq(MakeBlock(6), 6, false);
  bad.set_name("short");
  ASSERT_TRUE(writer->Write(bad));
  ASSERT_TRUE(writer->Write(PutReq(MakeBlock(3), 3, true)));  // a failure does not stop the rest
  ASSERT_TRUE(writer->WritesDone());
  const grpc::Status s = writer->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.results_size(), 6);
  const int want[6] = {0, 0, 0, grpc::StatusCode::FAILED_PRECONDITION,
                       grpc::StatusCode::INVALID_ARGUMENT, 0};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(resp.results(i).code(), want[i]) << i;
  EXPECT_THAT(resp.results(4).message(), HasSubstr("put: name is 5 bytes"));
  EXPECT_EQ(resp.stored(), 4u);
  const BlockName prefix = BlockNameOf(MakeBlock(0), 0);
  const std::vector<BlockHash> chain = {Key(0), Key(1), Key(2), Key(3)};
  EXPECT_EQ(store_->Lookup(prefix, chain, 1).chunks, 4u);
}

// Watch: a snapshot (closed by snapshot_end) when the client has nothing, then live events; a
// client that knows the incarnation and an id still in the ring gets only what follows.
TEST_F(StoreServiceTest, WatchSendsASnapshotThenLiveEvents) {
  for (uint8_t c = 0; c < 2; ++c) {
    const AlignedBuffer b = MakeBlock(c);
    const BlockHash parent = Key(c - 1);
    ASSERT_TRUE(store_->Put(BlockNameOf(b, c), c > 0 ? &parent : nullptr, b.span()).ok());
  }
  grpc::ClientContext ctx;
  auto reader = stub_->Watch(&ctx, strata::v1::WatchRequest());
  strata::v1::BlockEvent e;
  std::vector<std::string> names;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(reader->Read(&e));
    EXPECT_TRUE(e.snapshot());
    EXPECT_FALSE(e.snapshot_end());
    EXPECT_EQ(e.kind(), strata::v1::BLOCK_STORED);
    EXPECT_EQ(e.tier(), strata::v1::TIER_RAM);
    EXPECT_EQ(e.event_id(), 2u);
    EXPECT_EQ(e.store_id(), store_->store_id());
    names.push_back(e.name());
  }
  EXPECT_THAT(names,
              testing::UnorderedElementsAre(NameOf(MakeBlock(0), 0), NameOf(MakeBlock(1), 1)));
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_TRUE(e.snapshot_end());
  EXPECT_EQ(e.event_id(), 2u);
  EXPECT_TRUE(e.name().empty());
  const AlignedBuffer b2 = MakeBlock(2);
  const BlockHash k1 = Key(1);
  ASSERT_TRUE(store_->Put(BlockNameOf(b2, 2), &k1, b2.span()).ok());
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_FALSE(e.snapshot());
  EXPECT_EQ(e.event_id(), 3u);
  EXPECT_EQ(e.kind(), strata::v1::BLOCK_STORED);
  EXPECT_EQ(e.name(), NameOf(b2, 2));
  ASSERT_TRUE(store_->Delete(BlockNameOf(b2, 2)));
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.event_id(), 4u);
  EXPECT_EQ(e.kind(), strata::v1::BLOCK_REMOVED);
  EXPECT_EQ(e.tier(), strata::v1::TIER_NONE);
  ctx.TryCancel();
  while (reader->Read(&e)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Resuming after event 3 of this incarnation: event 4 comes first, no snapshot.
  strata::v1::WatchRequest resume;
  resume.set_after_event_id(3);
  resume.set_store_id(store_->store_id());
  {
    grpc::ClientContext rctx;
    auto r = stub_->Watch(&rctx, resume);
    ASSERT_TRUE(r->Read(&e));
    EXPECT_FALSE(e.snapshot());
    EXPECT_EQ(e.event_id(), 4u);
    rctx.TryCancel();
    while (r->Read(&e)) {
    }
    r->Finish();
  }
  // The same id of another incarnation means nothing here: a snapshot.
  resume.set_store_id(store_->store_id() + 1);
  {
    grpc::ClientContext rctx;
    auto r = stub_->Watch(&rctx, resume);
    ASSERT_TRUE(r->Read(&e));
    EXPECT_TRUE(e.snapshot());
    EXPECT_EQ(e.event_id(), 4u);
    rctx.TryCancel();
    while (r->Read(&e)) {
    }
    r->Finish();
  }
}

// Shutting the server down with a Watch open ends the stream (UNAVAILABLE) instead of waiting.
TEST_F(StoreServiceTest, ShutdownEndsOpenWatchStreams) {
  grpc::ClientContext ctx;
  auto reader = stub_->Watch(&ctx, strata::v1::WatchRequest());
  strata::v1::BlockEvent e;
  ASSERT_TRUE(reader->Read(&e));
  ASSERT_TRUE(e.snapshot_end());
  const absl::Time t0 = absl::Now();
  StopStoreServer(server_.get(), service_.get(), absl::Seconds(30));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10)) << "shutdown waited for the watch's deadline";
  while (reader->Read(&e)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(StoreServiceTest, ClientPutLookupGetDeleteStatsAndPutMany) {
  StoreClientOptions o;
  o.get_piece_bytes = 4096;
  absl::StatusOr<std::unique_ptr<StoreClient>> client =
      StoreClient::Connect(address_, absl::Seconds(10), o);
  ASSERT_TRUE(client.ok()) << client.status();
  StoreClient& c = **client;
  const AlignedBuffer b0 = MakeBlock(0), b1 = MakeBlock(1);
  const BlockHash k0 = Key(0);
  ASSERT_TRUE(c.Put(BlockNameOf(b0, 0), nullptr, b0.span()).ok());
  ASSERT_TRUE(c.Put(BlockNameOf(b1, 1), &k0, SharedBytes::FromBuffer(MakeBlock(1))).ok());
  const BlockHash missing = Key(9);
  absl::Status st = c.Put(BlockNameOf(b1, 3), &missing, b1.span());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(st.message()),
              testing::StartsWith("store " + address_ + ": FAILED_PRECONDITION: "));
  const BlockName prefix = BlockNameOf(b0, 0);
  const std::vector<BlockHash> chain = {Key(0), Key(1), Key(2)};
  absl::StatusOr<LookupResult> hit = c.Lookup(prefix, chain, {prefix.codec_fingerprint});
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->chunks, 2u);
  EXPECT_EQ(hit->tiers, std::vector<Tier>(2, Tier::kRam));
  EXPECT_EQ(c.Lookup(prefix, chain, {}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<SharedBytes> got = c.Get(BlockNameOf(b1, 1));  // in pieces of 4 KiB
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), b1.size());
  EXPECT_TRUE(std::equal(got->span().begin(), got->span().end(), b1.data()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(got->data()) % AlignedBuffer::kAlignment, 0u);
  EXPECT_EQ(c.Get(BlockNameOf(b1, 7)).status().code(), absl::StatusCode::kNotFound);
  // PutMany: one status per item, in order.
  std::vector<StoreClient::PutItem> items;
  for (uint8_t k = 2; k < 5; ++k) {
    const AlignedBuffer b = MakeBlock(k);
    items.push_back({BlockNameOf(b, k), Key(k - 1), SharedBytes::FromBuffer(MakeBlock(k))});
  }
  items[1].parent = Key(8);  // an orphan; the third block then is one too
  absl::StatusOr<std::vector<absl::Status>> many = c.PutMany(items);
  ASSERT_TRUE(many.ok()) << many.status();
  ASSERT_EQ(many->size(), 3u);
  EXPECT_TRUE((*many)[0].ok()) << (*many)[0];
  EXPECT_EQ((*many)[1].code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*many)[2].code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.Lookup(prefix, {Key(0), Key(1), Key(2), Key(3)}, {prefix.codec_fingerprint})->chunks,
            3u);
  absl::StatusOr<bool> deleted = c.Delete(prefix);
  ASSERT_TRUE(deleted.ok());
  EXPECT_TRUE(*deleted);
  EXPECT_FALSE(*c.Delete(prefix));
  absl::StatusOr<StoreStats> stats = c.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->puts, store_->Stats().puts);
  EXPECT_EQ(stats->orphans_dropped, 2u);
  EXPECT_EQ(stats->ram_blocks, 0u);
}

// A Get announcing more than the client accepts is refused before anything is allocated.
TEST_F(StoreServiceTest, ClientGetRefusesABlockLargerThanItsLimit) {
  const AlignedBuffer b = MakeBlock(0);
  ASSERT_TRUE(store_->Put(BlockNameOf(b, 0), nullptr, b.span()).ok());
  StoreClientOptions o;
  o.max_block_bytes = b.size() - 1;
  auto c = *StoreClient::Connect(address_, absl::Seconds(10), o);
  EXPECT_EQ(c->Get(BlockNameOf(b, 0)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c->Put(BlockNameOf(b, 0), nullptr, b.span()).code(),
            absl::StatusCode::kInvalidArgument);
}

// The client's Watch: snapshot, live events, and after the store restarts (a new incarnation on
// the same port) a new snapshot without being asked.
TEST_F(StoreServiceTest, ClientWatchFollowsTheStoreAcrossARestart) {
  const AlignedBuffer b0 = MakeBlock(0);
  ASSERT_TRUE(store_->Put(BlockNameOf(b0, 0), nullptr, b0.span()).ok());
  auto c = *StoreClient::Connect(address_, absl::Seconds(10));
  Collector seen;
  std::unique_ptr<StoreWatch> watch = c->Watch(0, seen.callback());
  ASSERT_TRUE(seen.WaitFor(AtLeast(WatchUpdate::Kind::kSnapshotEnd)));
  const uint64_t first_store = store_->store_id();
  const AlignedBuffer b1 = MakeBlock(1);
  const BlockHash k0 = Key(0);
  ASSERT_TRUE(store_->Put(BlockNameOf(b1, 1), &k0, b1.span()).ok());
  ASSERT_TRUE(seen.WaitFor(AtLeast(WatchUpdate::Kind::kEvent)));
  std::vector<WatchUpdate> us = seen.updates();
  ASSERT_EQ(us.size(), 3u);
  EXPECT_EQ(us[0].kind, WatchUpdate::Kind::kSnapshotBlock);
  EXPECT_EQ(us[0].event.name, BlockNameOf(b0, 0));
  EXPECT_EQ(us[0].store_id, first_store);
  EXPECT_EQ(us[2].event.id, 2u);
  EXPECT_EQ(us[2].event.kind, BlockEventKind::kStored);
  EXPECT_EQ(us[2].event.name, BlockNameOf(b1, 1));
  // The store goes away (the watch hears of it) and a new one comes up on the same port.
  const std::string port = address_.substr(address_.rfind(':') + 1);
  StopServer();
  ASSERT_TRUE(seen.WaitFor(AtLeast(WatchUpdate::Kind::kDisconnected)));
  StartServer("127.0.0.1:" + port);
  ASSERT_TRUE(seen.WaitFor(AtLeast(WatchUpdate::Kind::kSnapshotEnd, 2)));
  us = seen.updates();
  EXPECT_NE(us.back().store_id, first_store);
  EXPECT_EQ(us.back().store_id, store_->store_id());
  EXPECT_EQ(us.back().event_id, 0u);  // an empty new store
  watch.reset();  // cancels and joins
}

// A stopped store: calls fail at once with UNAVAILABLE (not at their deadline); connecting fails.
TEST_F(StoreServiceTest, ClientFailsFastWhenTheStoreIsDown) {
  StoreClientOptions o;
  o.timeout = absl::Seconds(30);
  auto c = *StoreClient::Connect(address_, absl::Seconds(10), o);
  const std::string address = address_;
  StopServer();
  const BlockName n = BlockNameOf(MakeBlock(0), 0);
  const absl::Time t0 = absl::Now();
  const absl::Status s = c->Get(n).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()),
              testing::StartsWith("store " + address + ": UNAVAILABLE: "));
  EXPECT_EQ(c->Lookup(n, {Key(0)}, {1}).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c->Stats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  absl::StatusOr<std::unique_ptr<StoreClient>> none =
      StoreClient::Connect(address, absl::Milliseconds(300));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(StoreClient::Connect(address, absl::Seconds(1), {.timeout = absl::ZeroDuration()})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kvstore
