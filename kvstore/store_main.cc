// strata-store: the KV store as a service.
//   strata-store --listen 0.0.0.0:7070 --ram_bytes 8G --disk_path /nvme/strata --disk_bytes 1T
#include <atomic>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/byte_size.h"
#include "common/log.h"
#include "common/signals.h"
#include "kvstore/block_store.h"
#include "kvstore/shared_tier_flags.h"
#include "kvstore/store_service.h"
#include "membership/etcd_membership.h"
#include "prometheus/exposer.h"
#include "rpc/grpc_security.h"
#include "rpc/grpc_security_flags.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "address to serve gRPC on (port 0: any)");
ABSL_FLAG(std::string, ram_bytes, "1G", "RAM tier capacity (suffixes K, M, G, T: powers of 1024)");
ABSL_FLAG(std::string, disk_path, "", "RocksDB folder of the disk tier (empty: RAM only)");
ABSL_FLAG(std::string, disk_bytes, "0", "disk tier capacity");
ABSL_FLAG(std::string, policy, "s3fifo", "RAM eviction policy: lru or s3fifo");
ABSL_FLAG(std::string, max_block_bytes, "64M", "largest block accepted");
ABSL_FLAG(bool, durable_puts, true, "write blocks through to disk before Put returns");
ABSL_FLAG(bool, repair, false,
          "when the disk tier's index fails at start (it will not open, or reading it meets "
          "damage), set it aside (DISK_PATH/damaged-index-TIME/) and rebuild it from the block "
          "log: every block whose bytes verify and whose log record names it comes back; a "
          "healthy index is left as it is");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus metrics at http://HOST:PORT/metrics (-1: off)");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "address the metrics endpoint listens on");
ABSL_FLAG(std::string, etcd, "",
          "etcd's client address (host:port): register this store there under a lease, so that "
          "routers list it and nodes started with --store host find it (empty: no registration)");
ABSL_FLAG(std::string, etcd_prefix, "/strata/", "the cluster's key prefix in etcd");
ABSL_FLAG(int, etcd_ttl_s, 6, "the registration lease, in seconds (renewed at half of it)");
ABSL_FLAG(std::string, store_id, "",
          "the store's id in etcd ([A-Za-z0-9._-]; default: store-HOST-PORT of its address)");
ABSL_FLAG(std::string, advertise, "",
          "the gRPC address registered in etcd (default: --listen's, with the port it got; "
          "required when --listen's host is 0.0.0.0 or ::)");

namespace {

// How often a shared tier that did not answer at start is tried again.
constexpr absl::Duration kSharedRetry = absl::Seconds(5);

}  // namespace

int main(int argc, char** argv) {
  strata::BlockTerminationSignals();  // first: every thread started later has them blocked
  absl::SetProgramUsageMessage(
      "the Strata KV block store as a gRPC service\n"
      "  strata-store --listen ADDR --ram_bytes N [--disk_path DIR --disk_bytes N]");
  // --help lists this file's flags (Abseil's default looks for a file named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "store_main.cc") ||
           absl::EndsWith(file, strata::rpc::kGrpcSecurityFlagsFile) ||
           absl::EndsWith(file, strata::kvstore::kSharedTierFlagsFile);
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  strata::SetLogIdentity("strata-store", "");
  absl::StatusOr<std::shared_ptr<const strata::rpc::GrpcSecurity>> security =
      strata::rpc::GrpcSecurity::Load(strata::rpc::GrpcSecurityOptionsFromFlags());
  if (!security.ok()) {
    std::cerr << "strata-store: " << security.status().message() << "\n";
    return 2;
  }
  if ((*security)->insecure()) strata::Log("", strata::rpc::kInsecureWarning);
  strata::kvstore::StoreOptions o;
  o.disk_path = absl::GetFlag(FLAGS_disk_path);
  o.durable_puts = absl::GetFlag(FLAGS_durable_puts);
  o.repair = absl::GetFlag(FLAGS_repair);
  for (const auto& [flag, dst] : {std::pair{absl::GetFlag(FLAGS_ram_bytes), &o.ram_bytes},
                                  std::pair{absl::GetFlag(FLAGS_disk_bytes), &o.disk_bytes},
                                  std::pair{absl::GetFlag(FLAGS_max_block_bytes), &o.max_block_bytes}}) {
    uint64_t n = 0;
    if (!strata::ParseByteSize(flag, &n)) {
      std::cerr << "strata-store: '" << flag << "' is not a byte count (e.g. 512M, 8G)\n";
      return 2;
    }
    *dst = n;
  }
  absl::StatusOr<strata::kvstore::PolicyKind> policy =
      strata::kvstore::ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) {
    std::cerr << "strata-store: " << policy.status() << "\n";
    return 2;
  }
  o.ram_policy = *policy;
  auto store = strata::kvstore::BlockStore::Open(o);
  if (!store.ok()) {
    std::cerr << "strata-store: " << store.status() << "\n";
    return 1;
  }
  // The shared tier: a bad flag stops the store; a Redis Cluster that does not answer at start
  // leaves this store serving alone (said once) and is tried again every kSharedRetry in the
  // background, the service taking it once it answers.
  std::unique_ptr<strata::kvstore::SharedTier> shared;
  bool retry_shared = false;
  absl::StatusOr<std::optional<strata::kvstore::SharedTierOptions>> shared_options =
      strata::kvstore::SharedTierOptionsFromFlags();
  if (!shared_options.ok()) {
    std::cerr << "strata-store: " << shared_options.status().message() << "\n";
    return 2;
  }
  if (shared_options->has_value()) {
    absl::StatusOr<std::unique_ptr<strata::kvstore::SharedTier>> t =
        strata::kvstore::SharedTier::Connect(**shared_options);
    if (!t.ok() && t.status().code() != absl::StatusCode::kUnavailable) {
      std::cerr << "strata-store: --shared_tier: " << t.status() << "\n";
      return 2;
    }
    if (!t.ok()) {
      strata::Log("", absl::StrCat("--shared_tier: ", t.status().message(),
                                   "; serving without the shared tier until it answers (tried "
                                   "every ",
                                   absl::FormatDuration(kSharedRetry), ")"));
      retry_shared = true;
    } else {
      shared = *std::move(t);
      std::cout << "strata-store: shared tier on " << absl::GetFlag(FLAGS_shared_tier) << std::endl;
    }
  }
  strata::kvstore::StoreService service(store->get(), o.max_block_bytes, shared.get());
  int port = 0;
  auto server = strata::kvstore::StartStoreServer(&service, absl::GetFlag(FLAGS_listen),
                                                  o.max_block_bytes, &port, security->get());
  if (!server.ok()) {
    std::cerr << server.status() << "\n";
    return 1;
  }
  std::unique_ptr<prometheus::Exposer> metrics;
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    const std::string address =
        absl::StrCat(absl::GetFlag(FLAGS_metrics_host), ":", absl::GetFlag(FLAGS_metrics_port));
    try {
      metrics = std::make_unique<prometheus::Exposer>(address);
    } catch (const std::exception& e) {
      std::cerr << "strata-store: metrics on " << address << ": " << e.what() << "\n";
      return 1;
    }
    metrics->RegisterCollectable(service.metrics());
    const std::vector<int> ports = metrics->GetListeningPorts();
    std::cout << "strata-store: metrics on port " << (ports.empty() ? -1 : ports.front())
              << std::endl;
  }
  std::unique_ptr<strata::membership::EtcdRegistration> registration;
  if (const std::string etcd = absl::GetFlag(FLAGS_etcd); !etcd.empty()) {
    absl::StatusOr<strata::membership::StoreSpec> self = strata::membership::StoreSpecFromFlags(
        absl::GetFlag(FLAGS_listen), port, absl::GetFlag(FLAGS_advertise),
        absl::GetFlag(FLAGS_store_id),
        absl::GetFlag(FLAGS_metrics_port) >= 0
            ? absl::StrCat(absl::GetFlag(FLAGS_metrics_host), ":",
                           absl::GetFlag(FLAGS_metrics_port))
            : "");
    absl::StatusOr<std::unique_ptr<strata::membership::EtcdRegistration>> r =
        self.ok()
            ? strata::membership::EtcdRegistration::StartStore(
                  strata::membership::NewHttpEtcdClient(etcd), absl::GetFlag(FLAGS_etcd_prefix),
                  *self, absl::Seconds(absl::GetFlag(FLAGS_etcd_ttl_s)))
            : self.status();
    if (!r.ok()) {
      std::cerr << "strata-store: --etcd " << etcd << ": " << r.status() << "\n";
      strata::kvstore::StopStoreServer(server->get(), &service);
      return 1;
    }
    registration = *std::move(r);
    std::cout << "strata-store: registered in etcd " << etcd << " as "
              << absl::GetFlag(FLAGS_etcd_prefix) << "stores/" << self->id << " (" << self->grpc
              << ")" << std::endl;
  }
  std::cout << "strata-store: serving on port " << port << " (RAM " << o.ram_bytes
            << " bytes, disk " << (o.disk_path.empty() ? "none" : o.disk_path) << "; "
            << (*security)->Describe() << ")" << std::endl;
  std::atomic<bool> stop{false};
  std::thread shared_retry;
  if (retry_shared) {
    shared_retry = std::thread([&] {
      bool told = false;
      while (!stop) {
        for (absl::Duration slept; slept < kSharedRetry && !stop;
             slept += absl::Milliseconds(100)) {
          absl::SleepFor(absl::Milliseconds(100));
        }
        if (stop) return;
        absl::StatusOr<std::unique_ptr<strata::kvstore::SharedTier>> t =
            strata::kvstore::SharedTier::Connect(**shared_options);
        if (!t.ok()) {
          if (t.status().code() != absl::StatusCode::kUnavailable && !told) {
            told = true;  // e.g. a password the cluster refuses: said once, tried on
            strata::Log("", absl::StrCat("--shared_tier: ", t.status().ToString()));
          }
          continue;
        }
        shared = *std::move(t);
        service.SetSharedTier(shared.get());
        std::cout << "strata-store: shared tier on " << absl::GetFlag(FLAGS_shared_tier)
                  << " (it answers now)" << std::endl;
        return;
      }
    });
  }
  strata::WaitForTermination();
  registration.reset();  // out of etcd first: nodes and routers stop counting on it
  stop = true;
  if (shared_retry.joinable()) shared_retry.join();
  strata::kvstore::StopStoreServer(server->get(), &service);  // open Watch streams end too
  std::cout << "strata-store: stopped" << std::endl;
  return 0;
}
