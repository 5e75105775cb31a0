#include "rpc/grpc_security.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/time/clock.h"
#include "common/block_reader.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvstore/store_client.h"
#include "kvstore/store_service.h"

namespace strata::kvstore {
namespace {

using ::strata::rpc::GrpcSecurity;
using ::strata::rpc::GrpcSecurityOptions;
using testing::HasSubstr;
using testing::Not;

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Certificates made by scripts/make_certs.sh, as an operator makes them: the cluster's, and a
// second set under another CA.
struct CertSet {
  std::filesystem::path dir;
  std::string ca, cert, key, token;
};

CertSet MakeCerts(const std::string& name) {
  CertSet c;
  c.dir = std::filesystem::path(testing::TempDir()) /
          ("strata-certs-" + name + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(c.dir);
  const std::string cmd =
      std::string(STRATA_SOURCE_DIR) + "/scripts/make_certs.sh " + c.dir.string() + " >/dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  c.ca = Slurp(c.dir / "ca.crt");
  c.cert = Slurp(c.dir / "node.crt");
  c.key = Slurp(c.dir / "node.key");
  c.token = Slurp(c.dir / "cluster.token");
  c.token = c.token.substr(0, c.token.find('\n'));
  return c;
}

AlignedBuffer MakeBlock() {
  std::vector<float> k(size_t{64} * 2 * 64, 0.25f), v(k.size(), -0.5f);
  auto codec = *kernels::Codec::Create("kivi:k2v2:g32");
  return *codec->Encode({k.data(), v.data(), SourceDType::kFloat32, 64, 2, 64},
                        {.layer = 0, .chunk_index = 0, .model_fingerprint = 9});
}

BlockName NameOf(const AlignedBuffer& b) {
  const BlockHeader h = BlockView::Parse(b.span())->header();
  return BlockName{h.model_fingerprint, h.codec_fingerprint, h.calibration_fingerprint, BlockHash{},
                   h.layer};
}

class GrpcSecurityTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new CertSet(MakeCerts("cluster"));
    other_ = new CertSet(MakeCerts("other"));
  }
  static void TearDownTestSuite() {
    for (CertSet* c : {cluster_, other_}) {
      std::filesystem::remove_all(c->dir);
      delete c;
    }
  }

  void TearDown() override {
    if (server_ != nullptr) StopStoreServer(server_.get(), service_.get());
  }

  std::shared_ptr<const GrpcSecurity> Secure(const CertSet& c, const std::string& token) {
    absl::StatusOr<std::shared_ptr<const GrpcSecurity>> s =
        GrpcSecurity::FromPem(c.cert, c.key, c.ca, token);
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  }

  // A store served with `security`.
  void Serve(std::shared_ptr<const GrpcSecurity> security) {
    server_security_ = std::move(security);
    store_ = *BlockStore::Open({.ram_bytes = 1 << 24, .max_block_bytes = 1 << 20});
    service_ = std::make_unique<StoreService>(store_.get(), 1 << 20);
    int port = 0;
    server_ =
        *StartStoreServer(service_.get(), "127.0.0.1:0", 1 << 20, &port, server_security_.get());
    address_ = "127.0.0.1:" + std::to_string(port);
  }

  // A raw stub over `creds` (for clients GrpcSecurity would never build).
  std::unique_ptr<strata::v1::Store::Stub> Stub(std::shared_ptr<grpc::ChannelCredentials> creds) {
    return strata::v1::Store::NewStub(grpc::CreateChannel(address_, creds));
  }

  static grpc::Status RawPut(strata::v1::Store::Stub* stub, const AlignedBuffer& b) {
    strata::v1::PutRequest req;
    req.set_name(NameOf(b).Encode());
    req.set_block(reinterpret_cast<const char*>(b.data()), b.size());
    strata::v1::PutResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    return stub->Put(&ctx, req, &resp);
  }

  static grpc::Status RawGet(strata::v1::Store::Stub* stub, const AlignedBuffer& b) {
    strata::v1::GetRequest req;
    req.set_name(NameOf(b).Encode());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    auto reader = stub->Get(&ctx, req);
    strata::v1::GetResponse piece;
    while (reader->Read(&piece)) {
    }
    return reader->Finish();
  }

  static CertSet* cluster_;
  static CertSet* other_;
  std::shared_ptr<const GrpcSecurity> server_security_;
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

CertSet* GrpcSecurityTest::cluster_ = nullptr;
CertSet* GrpcSecurityTest::other_ = nullptr;

TEST_F(GrpcSecurityTest, TlsStoreServesAClientWithTheCasCertificateAndTheToken) {
  Serve(Secure(*cluster_, cluster_->token));
  absl::StatusOr<std::unique_ptr<StoreClient>> client = StoreClient::Connect(
      address_, absl::Seconds(10), {.security = Secure(*cluster_, cluster_->token)});
  ASSERT_TRUE(client.ok()) << client.status();
  const AlignedBuffer b = MakeBlock();
  ASSERT_TRUE((*client)->Put(NameOf(b), nullptr, b.span()).ok());
  absl::StatusOr<SharedBytes> got = (*client)->Get(NameOf(b));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->size(), b.size());
  absl::StatusOr<StoreStats> stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->puts, 1u);
}

TEST_F(GrpcSecurityTest, TlsStoreRefusesPutAndGetWithoutTheToken) {
  Serve(Secure(*cluster_, cluster_->token));
  // The cluster's certificate, but no call credentials: TLS succeeds, the call does not.
  auto stub = Stub(grpc::SslCredentials({.pem_root_certs = cluster_->ca,
                                         .pem_private_key = cluster_->key,
                                         .pem_cert_chain = cluster_->cert}));
  const AlignedBuffer b = MakeBlock();
  for (const grpc::Status& s : {RawPut(stub.get(), b), RawGet(stub.get(), b)}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("no cluster token"));
  }
  EXPECT_EQ(store_->Stats().puts, 0u);
  EXPECT_EQ(store_->Stats().misses, 0u);  // the Get never reached the store either
}

TEST_F(GrpcSecurityTest, TlsStoreRefusesAWrongTokenWithoutEchoingIt) {
  Serve(Secure(*cluster_, cluster_->token));
  absl::StatusOr<std::unique_ptr<StoreClient>> client = StoreClient::Connect(
      address_, absl::Seconds(10), {.security = Secure(*cluster_, other_->token)});
  ASSERT_TRUE(client.ok()) << client.status();  // TLS is fine; every call is refused
  const AlignedBuffer b = MakeBlock();
  const absl::Status put = (*client)->Put(NameOf(b), nullptr, b.span());
  const absl::Status get = (*client)->Get(NameOf(b)).status();
  const absl::Status lookup = (*client)->Stats().status();
  for (const absl::Status& s : {put, get, lookup}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_THAT(s.message(), HasSubstr("wrong cluster token"));
    EXPECT_THAT(s.message(), Not(HasSubstr(other_->token)));
    EXPECT_THAT(s.message(), Not(HasSubstr(cluster_->token)));
  }
  EXPECT_EQ(store_->Stats().puts, 0u);
}

TEST_F(GrpcSecurityTest, TlsStoreRefusesAClientWithoutACertificate) {
  Serve(Secure(*cluster_, cluster_->token));
  // Trusts the cluster's CA and carries the token, but presents no certificate: the handshake
  // fails (mutual TLS), so the call never starts.
  const AlignedBuffer b = MakeBlock();
  const grpc::Status s = RawPut(
      Stub(grpc::SslCredentials(
               {.pem_root_certs = cluster_->ca, .pem_private_key = "", .pem_cert_chain = ""}))
          .get(),
      b);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(store_->Stats().puts, 0u);
}

TEST_F(GrpcSecurityTest, TlsStoreAndClientsOfAnotherCaRefuseEachOther) {
  Serve(Secure(*cluster_, cluster_->token));
  const AlignedBuffer b = MakeBlock();
  // Another CA's certificate, trusting that CA: the client cannot verify the store, nor the
  // store the client.
  absl::StatusOr<std::unique_ptr<StoreClient>> stranger = StoreClient::Connect(
      address_, absl::Seconds(2), {.security = Secure(*other_, cluster_->token)});
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kUnavailable);
  // Trusting the cluster's CA but presenting another CA's certificate: the store refuses it.
  const grpc::Status s = RawPut(Stub(grpc::SslCredentials({.pem_root_certs = cluster_->ca,
                                                           .pem_private_key = other_->key,
                                                           .pem_cert_chain = other_->cert}))
                                    .get(),
                                b);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  // The cluster's own certificate, trusting only the other CA: the client refuses the store.
  const grpc::Status t = RawPut(Stub(grpc::SslCredentials({.pem_root_certs = other_->ca,
                                                           .pem_private_key = cluster_->key,
                                                           .pem_cert_chain = cluster_->cert}))
                                    .get(),
                                b);
  EXPECT_EQ(t.error_code(), grpc::StatusCode::UNAVAILABLE) << t.error_message();
  // Plaintext to the TLS port.
  EXPECT_EQ(RawPut(Stub(grpc::InsecureChannelCredentials()).get(), b).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(store_->Stats().puts, 0u);
}

TEST_F(GrpcSecurityTest, InsecureModeStillServesPlaintextWithoutAToken) {
  Serve(GrpcSecurity::Insecure());
  absl::StatusOr<std::unique_ptr<StoreClient>> client =
      StoreClient::Connect(address_, absl::Seconds(10), {.security = GrpcSecurity::Insecure()});
  ASSERT_TRUE(client.ok()) << client.status();
  const AlignedBuffer b = MakeBlock();
  ASSERT_TRUE((*client)->Put(NameOf(b), nullptr, b.span()).ok());
  EXPECT_TRUE((*client)->Get(NameOf(b)).ok());
  // A TLS client does not talk to a plaintext store.
  EXPECT_EQ(StoreClient::Connect(address_, absl::Seconds(1),
                                 {.security = Secure(*cluster_, cluster_->token)})
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(GrpcSecurityTest, OptionsNeedAnExplicitChoice) {
  const absl::Status none = GrpcSecurityOptions{}.Validate();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.message(), HasSubstr("--insecure"));
  EXPECT_THAT(none.message(), HasSubstr("--tls_cert"));
  const GrpcSecurityOptions partial_options{.tls_cert = "a", .tls_key = "b", .tls_ca = "c"};
  const absl::Status partial = partial_options.Validate();
  EXPECT_THAT(partial.message(), HasSubstr("--cluster_token_file is missing"));
  const GrpcSecurityOptions both{.tls_cert = "a", .insecure = true};
  EXPECT_EQ(both.Validate().code(), absl::StatusCode::kInvalidArgument);
  const GrpcSecurityOptions insecure{.insecure = true};
  EXPECT_TRUE(insecure.Validate().ok());

  const std::string dir = cluster_->dir.string();
  absl::StatusOr<std::shared_ptr<const GrpcSecurity>> loaded =
      GrpcSecurity::Load({.tls_cert = dir + "/node.crt",
                          .tls_key = dir + "/node.key",
                          .tls_ca = dir + "/ca.crt",
                          .cluster_token_file = dir + "/cluster.token"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_FALSE((*loaded)->insecure());
  EXPECT_THAT((*loaded)->Describe(), HasSubstr("mutual TLS"));
  // A key that is not the certificate's, and a token too short to be one.
  EXPECT_THAT(GrpcSecurity::FromPem(cluster_->cert, other_->key, cluster_->ca, cluster_->token)
                  .status()
                  .message(),
              HasSubstr("not the private key"));
  EXPECT_EQ(
      GrpcSecurity::FromPem(cluster_->cert, cluster_->key, cluster_->ca, "short").status().code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kvstore
