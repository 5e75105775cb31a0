#include "rpc/grpc_security.h"

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/credentials.h"

namespace strata::rpc {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::ostringstream s;
  s << in.rdbuf();
  if (s.str().empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  return s.str();
}

// PEM text parses as what it should be (gRPC would otherwise fail later, with a vaguer message,
// when the server starts or the first call connects).
absl::Status CheckPem(const std::string& cert_pem, const std::string& key_pem,
                      const std::string& ca_pem) {
  auto bio = [](const std::string& s) {
    return BIO_new_mem_buf(s.data(), static_cast<int>(s.size()));
  };
  BIO* b = bio(cert_pem);
  X509* cert = PEM_read_bio_X509(b, nullptr, nullptr, nullptr);
  BIO_free(b);
  b = bio(key_pem);
  EVP_PKEY* key = PEM_read_bio_PrivateKey(b, nullptr, nullptr, nullptr);
  BIO_free(b);
  b = bio(ca_pem);
  X509* ca = PEM_read_bio_X509(b, nullptr, nullptr, nullptr);
  BIO_free(b);
  absl::Status s;
  if (cert == nullptr) {
    s = absl::InvalidArgumentError("--tls_cert: not a PEM certificate");
  } else if (key == nullptr) {
    s = absl::InvalidArgumentError("--tls_key: not a PEM private key (or it is encrypted)");
  } else if (ca == nullptr) {
    s = absl::InvalidArgumentError("--tls_ca: not a PEM certificate");
  } else if (X509_check_private_key(cert, key) != 1) {
    s = absl::InvalidArgumentError("--tls_key: not the private key of --tls_cert's certificate");
  }
  X509_free(cert);
  EVP_PKEY_free(key);
  X509_free(ca);
  return s;
}

absl::Status CheckToken(const std::string& token) {
  if (token.size() < 16 || token.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cluster_token_file: the token is ", token.size(),
                     " characters; it needs 16..4096 (scripts/make_certs.sh makes one of 64)"));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "--cluster_token_file: the token must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

// Client side: the token on every call (gRPC runs call credentials on secure channels only).
class TokenPlugin final : public grpc::MetadataCredentialsPlugin {
 public:
  explicit TokenPlugin(std::string token) : token_(std::move(token)) {}
  bool IsBlocking() const override { return false; }  // a copy: no need for gRPC's thread pool
  const char* GetType() const override { return "strata-cluster-token"; }
  grpc::Status GetMetadata(grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
                           std::multimap<grpc::string, grpc::string>* metadata) override {
    metadata->emplace(kClusterTokenHeader, token_);
    return grpc::Status::OK;
  }

 private:
  const std::string token_;
};

// Server side: every call's token, checked before any handler runs. Digests of equal length are
// compared in constant time, so neither the token's bytes nor its length leak through timing.
class TokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenProcessor(const std::string& token) : want_(Sha256::Hash(token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext*,
                       OutputMetadata* consumed, OutputMetadata*) override {
    auto it = auth_metadata.find(kClusterTokenHeader);
    if (it == auth_metadata.end()) {
      return grpc::Status(
          grpc::StatusCode::UNAUTHENTICATED,
          absl::StrCat("no cluster token: the call carries no ", kClusterTokenHeader,
                       " (is the caller run with --cluster_token_file?)"));
    }
    const Sha256Digest got = Sha256::Hash(it->second.data(), it->second.size());
    if (CRYPTO_memcmp(got.data(), want_.data(), want_.size()) != 0) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat("wrong cluster token in ", kClusterTokenHeader,
                                       " (not this cluster's --cluster_token_file)"));
    }
    consumed->emplace(std::string(it->first.data(), it->first.size()),
                      std::string(it->second.data(), it->second.size()));
    return grpc::Status::OK;
  }

 private:
  const Sha256Digest want_;
};

}  // namespace

absl::Status GrpcSecurityOptions::Validate() const {
  const bool any =
      !tls_cert.empty() || !tls_key.empty() || !tls_ca.empty() || !cluster_token_file.empty();
  if (insecure) {
    if (any) {
      return absl::InvalidArgumentError(
          "--insecure excludes --tls_cert, --tls_key, --tls_ca and --cluster_token_file");
    }
    return absl::OkStatus();
  }
  if (!any) {
    return absl::InvalidArgumentError(
        "no transport security chosen: give --tls_cert, --tls_key, --tls_ca and "
        "--cluster_token_file (scripts/make_certs.sh makes them), or --insecure for plaintext "
        "without a token");
  }
  for (const auto& [value, flag] :
       {std::pair{&tls_cert, "--tls_cert"}, std::pair{&tls_key, "--tls_key"},
        std::pair{&tls_ca, "--tls_ca"}, std::pair{&cluster_token_file, "--cluster_token_file"}}) {
    if (value->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag,
                       " is missing: mutual TLS needs --tls_cert, --tls_key, --tls_ca and "
                       "--cluster_token_file together (or --insecure for none)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const GrpcSecurity>> GrpcSecurity::Load(
    const GrpcSecurityOptions& options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (options.insecure) return Insecure();
  STRATA_ASSIGN_OR_RETURN(std::string cert, ReadFile(options.tls_cert, "--tls_cert"));
  STRATA_ASSIGN_OR_RETURN(std::string key, ReadFile(options.tls_key, "--tls_key"));
  STRATA_ASSIGN_OR_RETURN(std::string ca, ReadFile(options.tls_ca, "--tls_ca"));
  STRATA_ASSIGN_OR_RETURN(std::string token_file,
                          ReadFile(options.cluster_token_file, "--cluster_token_file"));
  std::string token(absl::StripAsciiWhitespace(token_file.substr(0, token_file.find('\n'))));
  return Secure(std::move(cert), std::move(key), std::move(ca), std::move(token),
                absl::StrCat("mutual TLS (CA ", options.tls_ca, ", certificate ", options.tls_cert,
                             ") + cluster token (", options.cluster_token_file, ")"));
}

absl::StatusOr<std::shared_ptr<const GrpcSecurity>> GrpcSecurity::FromPem(std::string cert_pem,
                                                                          std::string key_pem,
                                                                          std::string ca_pem,
                                                                          std::string token) {
  return Secure(std::move(cert_pem), std::move(key_pem), std::move(ca_pem), std::move(token),
                "mutual TLS + cluster token");
}

absl::StatusOr<std::shared_ptr<const GrpcSecurity>> GrpcSecurity::Secure(std::string cert_pem,
                                                                         std::string key_pem,
                                                                         std::string ca_pem,
                                                                         std::string token,
                                                                         std::string description) {
  STRATA_RETURN_IF_ERROR(CheckPem(cert_pem, key_pem, ca_pem));
  STRATA_RETURN_IF_ERROR(CheckToken(token));
  std::shared_ptr<GrpcSecurity> s(new GrpcSecurity());
  s->insecure_ = false;
  s->cert_pem_ = std::move(cert_pem);
  s->key_pem_ = std::move(key_pem);
  s->ca_pem_ = std::move(ca_pem);
  s->token_ = std::move(token);
  s->description_ = std::move(description);
  return std::shared_ptr<const GrpcSecurity>(std::move(s));
}

std::shared_ptr<const GrpcSecurity> GrpcSecurity::Insecure() {
  return std::shared_ptr<const GrpcSecurity>(new GrpcSecurity());
}

std::shared_ptr<grpc::ServerCredentials> GrpcSecurity::ServerCredentials() const {
  if (insecure_) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = ca_pem_;
  o.pem_key_cert_pairs.push_back({key_pem_, cert_pem_});
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(o);
  creds->SetAuthMetadataProcessor(std::make_shared<TokenProcessor>(token_));
  return creds;
}

std::shared_ptr<grpc::Channel> GrpcSecurity::CreateChannel(
    const std::string& address, const grpc::ChannelArguments& args) const {
  if (insecure_) {
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ca_pem_;
  o.pem_private_key = key_pem_;
  o.pem_cert_chain = cert_pem_;
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::CompositeChannelCredentials(
      grpc::SslCredentials(o),
      grpc::MetadataCredentialsFromPlugin(std::make_unique<TokenPlugin>(token_)));
  return grpc::CreateCustomChannel(address, creds, args);
}

}  // namespace strata::rpc
