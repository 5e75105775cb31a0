// strata-router: the OpenAI-compatible HTTP front of a Strata cluster. Reads the cluster file
// (model, nodes, store, the router's HTTP address); flags override.
//   strata-router --cluster cluster.json [--listen 0.0.0.0:8000]
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/host_port.h"
#include "kvstore/shared_tier_flags.h"
#include "membership/cluster_file.h"
#include "membership/etcd_flags.h"
#include "membership/etcd_membership.h"
#include "router/cluster_backend.h"
#include "router/http_server.h"
#include "rpc/grpc_security_flags.h"
#include "serving/node_process.h"

ABSL_FLAG(std::string, cluster, "", "the cluster file (required)");
ABSL_FLAG(std::string, listen, "", "HTTP address HOST:PORT (default: the file's router.http)");
ABSL_FLAG(int, max_in_flight, 1024, "requests in flight at most; more are answered 429");
ABSL_FLAG(int, http_threads, 4, "HTTP I/O threads");
ABSL_FLAG(int, poll_ms, 100, "how often every node's load is polled, in milliseconds");
ABSL_FLAG(std::string, etcd, "",
          "etcd's client address (host:port): the nodes are those registered there under "
          "--etcd_prefix, followed as they come and go (empty: the cluster file's nodes)");
ABSL_FLAG(int, etcd_removal_grace_s, 10,
          "how long a node whose registration left etcd stays in the membership, for it to "
          "register again (etcd cut off from the nodes expires every lease); a node that is down "
          "fails the router's load polls and is not routed to meanwhile");
ABSL_FLAG(std::string, api_keys, "",
          "file of 'KEY TENANT' lines: /v1/* then needs 'Authorization: Bearer KEY' (401 "
          "otherwise), and each tenant's prefixes are its own (empty: no keys, open)");
ABSL_FLAG(int, max_in_flight_per_tenant, 0,
          "with --api_keys: requests in flight per tenant at most; more are answered 429 (0: no "
          "limit)");
ABSL_FLAG(std::string, http_tls_cert, "",
          "PEM certificate (chain) of the HTTPS endpoint (scripts/make_certs.sh makes "
          "router-http.crt)");
ABSL_FLAG(std::string, http_tls_key, "", "PEM private key of --http_tls_cert");

namespace {

int Fail(const std::string& what, const absl::Status& s, int code = 1) {
  std::cerr << "strata-router: " << what << ": " << s << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  strata::serving::BlockTerminationSignals();
  strata::serving::ConfigureFlagsUsage();
  absl::SetProgramUsageMessage(
      "the Strata router: OpenAI-compatible HTTP in front of a cluster's prefill and decode "
      "nodes.\n  strata-router --cluster cluster.json [--listen 0.0.0.0:8000]");
  absl::ParseCommandLine(argc, argv);
  namespace serving = strata::serving;
  namespace membership = strata::membership;
  namespace rt = strata::router;
  if (absl::GetFlag(FLAGS_cluster).empty()) {
    std::cerr << "strata-router: --cluster is required (see --help)\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_in_flight) < 1) {
    std::cerr << "strata-router: --max_in_flight must be >= 1, got "
              << absl::GetFlag(FLAGS_max_in_flight) << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_http_threads) < 1 || absl::GetFlag(FLAGS_http_threads) > 256) {
    std::cerr << "strata-router: --http_threads must be in [1, 256], got "
              << absl::GetFlag(FLAGS_http_threads) << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_poll_ms) < 1) {
    std::cerr << "strata-router: --poll_ms must be >= 1, got " << absl::GetFlag(FLAGS_poll_ms)
              << "\n";
    return 2;
  }
  absl::StatusOr<membership::ClusterSpec> spec =
      membership::LoadClusterFile(absl::GetFlag(FLAGS_cluster));
  if (!spec.ok()) return Fail("cluster file", spec.status(), 2);
  const std::string listen =
      absl::GetFlag(FLAGS_listen).empty() ? spec->router_http : absl::GetFlag(FLAGS_listen);
  if (absl::Status s = membership::ValidateHostPort(listen, "--listen"); !s.ok()) {
    return Fail("flags", s, 2);
  }
  serving::SetLogIdentity("strata-router", "");
  absl::StatusOr<std::shared_ptr<const strata::rpc::GrpcSecurity>> security =
      serving::LoadGrpcSecurity(strata::rpc::GrpcSecurityOptionsFromFlags());
  if (!security.ok()) return Fail("flags", security.status(), 2);
  const bool https =
      !absl::GetFlag(FLAGS_http_tls_cert).empty() || !absl::GetFlag(FLAGS_http_tls_key).empty();
  if (absl::GetFlag(FLAGS_insecure) && https) {
    std::cerr << "strata-router: --insecure excludes --http_tls_cert and --http_tls_key\n";
    return 2;
  }
  if (!absl::GetFlag(FLAGS_insecure) &&
      (absl::GetFlag(FLAGS_http_tls_cert).empty() || absl::GetFlag(FLAGS_http_tls_key).empty())) {
    std::cerr << "strata-router: HTTPS needs --http_tls_cert and --http_tls_key (or --insecure "
                 "for plain HTTP)\n";
    return 2;
  }

  rt::ClusterBackendOptions o;
  o.spec = *spec;
  o.max_in_flight = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_in_flight));
  o.load_poll_interval = absl::Milliseconds(absl::GetFlag(FLAGS_poll_ms));
  o.security = *security;
  absl::StatusOr<std::optional<strata::kvstore::SharedTierOptions>> shared =
      strata::kvstore::SharedTierOptionsFromFlags();
  if (!shared.ok()) return Fail("flags", shared.status(), 2);
  o.shared_tier = *std::move(shared);
  if (!absl::GetFlag(FLAGS_etcd).empty()) {
    absl::StatusOr<std::string> prefix = membership::EtcdPrefixFromFlags();
    if (!prefix.ok()) return Fail("flags", prefix.status(), 2);
    absl::StatusOr<std::unique_ptr<membership::EtcdMembership>> m =
        membership::EtcdMembership::Start(
            membership::NewHttpEtcdClient(absl::GetFlag(FLAGS_etcd)), *prefix,
            absl::Seconds(std::max(0, absl::GetFlag(FLAGS_etcd_removal_grace_s))));
    if (!m.ok()) return Fail("etcd", m.status());
    serving::Log(
        "", absl::StrCat("membership: ", (*m)->Describe(), " at ", absl::GetFlag(FLAGS_etcd), ", ",
                         (*m)->Nodes().size(), " nodes now"));
    o.membership = std::shared_ptr<const membership::Membership>(*std::move(m));
  }
  absl::StatusOr<std::unique_ptr<rt::ClusterBackend>> backend = rt::ClusterBackend::Create(o);
  if (!backend.ok()) return Fail("backend", backend.status());

  rt::HttpServerOptions h;
  const strata::HostPort hp = *strata::ParseHostPort(listen);  // validated above
  h.host = hp.host;
  h.port = hp.port;
  h.threads = absl::GetFlag(FLAGS_http_threads);
  h.tls_cert_file = absl::GetFlag(FLAGS_http_tls_cert);
  h.tls_key_file = absl::GetFlag(FLAGS_http_tls_key);
  h.on_token_written = [b = backend->get()](absl::Duration d) { b->RecordTokenWritten(d); };
  if (!absl::GetFlag(FLAGS_api_keys).empty()) {
    absl::StatusOr<rt::ApiKeys> keys = rt::ApiKeys::Load(absl::GetFlag(FLAGS_api_keys));
    if (!keys.ok()) return Fail("--api_keys", keys.status(), 2);
    h.api_keys = std::make_shared<const rt::ApiKeys>(*std::move(keys));
    serving::Log("", absl::StrCat("API keys: ", h.api_keys->size(), " keys from ",
                                  absl::GetFlag(FLAGS_api_keys), "; /v1/* needs one"));
  }
  if (absl::GetFlag(FLAGS_max_in_flight_per_tenant) < 0) {
    std::cerr << "strata-router: --max_in_flight_per_tenant must be >= 0\n";
    return 2;
  }
  h.max_in_flight_per_tenant = static_cast<size_t>(absl::GetFlag(FLAGS_max_in_flight_per_tenant));
  absl::StatusOr<std::unique_ptr<rt::HttpServer>> server = rt::HttpServer::Start(h, backend->get());
  if (!server.ok()) return Fail("HTTP", server.status());
  const std::string shown = absl::StrContains(h.host, ':') ? "[" + h.host + "]" : h.host;
  if (!https) serving::Log("", "WARNING: --insecure: the HTTP API is plain HTTP (no TLS)");
  std::cout << "strata-router: serving on " << (https ? "https://" : "http://") << shown << ":"
            << (*server)->port()
            << ((*security)->insecure() ? " (INSECURE: --insecure, plaintext gRPC and HTTP)" : "")
            << std::endl;

  const int signal = serving::WaitForTermination();
  serving::Log("", absl::StrCat("signal ", signal, ": stopping"));
  (*server)->Stop();  // cancels the open streams
  server->reset();
  backend->reset();  // waits for the cancelled calls to end
  std::cout << "strata-router: stopped" << std::endl;
  return 0;
}
