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
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/allocator.h"
#include "common/byte_size.h"
#include "common/log.h"
#include "common/signals.h"
#include "kvstore/block_store.h"
#include "kvstore/shared_tier_flags.h"
#include "kvstore/store_service.h"
#include "membership/etcd_flags.h"
#include "membership/etcd_membership.h"
#include "prometheus/exposer.h"
#include "rpc/grpc_security.h"
#include "rpc/grpc_security_flags.h"
#include "serving/node_process.h"

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
ABSL_FLAG(std::string, store_id, "",
          "the store's id in etcd ([A-Za-z0-9._-]; default: store-HOST-PORT of its address)");
ABSL_FLAG(std::string, host_name, "",
          "the machine this store serves, as registered in etcd: nodes started with --store host "
          "and the same --host_name use it (default: the host of its registered address; in "
          "Kubernetes, where pods have addresses of their own, the node's name)");
ABSL_FLAG(std::string, advertise, "",
          "the gRPC address registered in etcd (default: --listen's, with the port it got; "
          "required when --listen's host is 0.0.0.0 or ::)");

namespace {

namespace kv = strata::kvstore;
namespace membership = strata::membership;

// How often a shared tier that did not answer at start is tried again.
constexpr absl::Duration kSharedRetry = absl::Seconds(5);

// A usage error: said on stderr, exit code 2.
int Usage(const absl::Status& s) {
  std::cerr << "strata-store: " << s.message() << "\n";
  return 2;
}

// --ram_bytes, --disk_path, --disk_bytes, --policy, --max_block_bytes, --durable_puts, --repair.
absl::StatusOr<kv::StoreOptions> StoreOptionsFromFlags() {
  kv::StoreOptions o;
  o.disk_path = absl::GetFlag(FLAGS_disk_path);
  o.durable_puts = absl::GetFlag(FLAGS_durable_puts);
  o.repair = absl::GetFlag(FLAGS_repair);
  for (const auto& [flag, dst] :
       {std::pair{absl::GetFlag(FLAGS_ram_bytes), &o.ram_bytes},
        std::pair{absl::GetFlag(FLAGS_disk_bytes), &o.disk_bytes},
        std::pair{absl::GetFlag(FLAGS_max_block_bytes), &o.max_block_bytes}}) {
    uint64_t n = 0;
    if (!strata::ParseByteSize(flag, &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", flag, "' is not a byte count (e.g. 512M, 8G)"));
    }
    *dst = n;
  }
  absl::StatusOr<kv::PolicyKind> policy = kv::ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) return policy.status();
  o.ram_policy = *policy;
  return o;
}

// The shared tier behind the service (--shared_tier). A bad flag stops the store; a Redis Cluster
// that does not answer at start leaves the store serving alone (said once) and is tried again
// every kSharedRetry in the background, the service taking it once it answers.
class SharedTierLink {
 public:
  ~SharedTierLink() { Stop(); }

  // Connects at once, or says it will retry; an error only for flags that cannot work.
  absl::Status Connect() {
    absl::StatusOr<std::optional<kv::SharedTierOptions>> options = kv::SharedTierOptionsFromFlags();
    if (!options.ok()) return options.status();
    if (!options->has_value()) return absl::OkStatus();
    options_ = **options;
    absl::StatusOr<std::unique_ptr<kv::SharedTier>> t = kv::SharedTier::Connect(options_);
    if (!t.ok() && t.status().code() != absl::StatusCode::kUnavailable) {
      return absl::InvalidArgumentError(absl::StrCat("--shared_tier: ", t.status().ToString()));
    }
    if (!t.ok()) {
      strata::Log("", absl::StrCat("--shared_tier: ", t.status().message(),
                                   "; serving without the shared tier until it answers (tried "
                                   "every ",
                                   absl::FormatDuration(kSharedRetry), ")"));
      retry_later_ = true;
      return absl::OkStatus();
    }
    tier_ = *std::move(t);
    std::cout << "strata-store: shared tier on " << absl::GetFlag(FLAGS_shared_tier) << std::endl;
    return absl::OkStatus();
  }
  kv::SharedTier* tier() const { return tier_.get(); }

  // Ends the retries (before the service they hand the tier to goes).
  void Stop() {
    stop_ = true;
    if (retry_.joinable()) retry_.join();
  }

  // When Connect left it for later: retries in the background, handing it to `service`.
  void RetryInto(kv::StoreService* service) {
    if (!retry_later_) return;
    retry_ = std::thread([this, service] { Retry(service); });
  }

 private:
  void Retry(kv::StoreService* service) {
    bool told = false;
    while (!stop_) {
      for (absl::Duration slept; slept < kSharedRetry && !stop_; slept += absl::Milliseconds(100)) {
        absl::SleepFor(absl::Milliseconds(100));
      }
      if (stop_) return;
      absl::StatusOr<std::unique_ptr<kv::SharedTier>> t = kv::SharedTier::Connect(options_);
      if (!t.ok()) {
        if (t.status().code() != absl::StatusCode::kUnavailable && !told) {
          told = true;  // e.g. a password the cluster refuses: said once, tried on
          strata::Log("", absl::StrCat("--shared_tier: ", t.status().ToString()));
        }
        continue;
      }
      tier_ = *std::move(t);
      service->SetSharedTier(tier_.get());
      std::cout << "strata-store: shared tier on " << absl::GetFlag(FLAGS_shared_tier)
                << " (it answers now)" << std::endl;
      return;
    }
  }

  kv::SharedTierOptions options_;
  bool retry_later_ = false;
  std::unique_ptr<kv::SharedTier> tier_;  // written by the retry thread once, before it ends
  std::atomic<bool> stop_{false};
  std::thread retry_;
};

// --metrics_host:--metrics_port, or "" when --metrics_port is -1.
std::string MetricsAddress() {
  if (absl::GetFlag(FLAGS_metrics_port) < 0) return "";
  return absl::StrCat(absl::GetFlag(FLAGS_metrics_host), ":", absl::GetFlag(FLAGS_metrics_port));
}

// With --etcd, registers the store serving on `port` (null without --etcd).
absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> RegisterStore(int port) {
  const std::string etcd = absl::GetFlag(FLAGS_etcd);
  if (etcd.empty()) return nullptr;
  absl::StatusOr<membership::StoreSpec> self = membership::StoreSpecFromFlags(
      absl::GetFlag(FLAGS_listen), port, absl::GetFlag(FLAGS_advertise),
      absl::GetFlag(FLAGS_store_id), MetricsAddress());
  if (!self.ok()) return self.status();
  absl::StatusOr<std::string> prefix = membership::EtcdPrefixFromFlags();
  if (!prefix.ok()) return prefix.status();
  absl::StatusOr<absl::Duration> lease = membership::EtcdLeaseFromFlags();
  if (!lease.ok()) return lease.status();
  absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> r =
      membership::EtcdRegistration::StartStore(membership::NewHttpEtcdClient(etcd), *prefix, *self,
                                               *lease);
  if (r.ok()) {
    std::cout << "strata-store: registered in etcd " << etcd << " as " << *prefix << "stores/"
              << self->id << " (" << self->grpc << ", host " << membership::StoreHost(*self) << ")"
              << std::endl;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  strata::BlockTerminationSignals();  // first: every thread started later has them blocked
  strata::serving::ConfigureFlagsUsage();
  absl::SetProgramUsageMessage(
      "the Strata KV block store as a gRPC service\n"
      "  strata-store --listen ADDR --ram_bytes N [--disk_path DIR --disk_bytes N]");
  absl::ParseCommandLine(argc, argv);
  strata::SetLogIdentity("strata-store", "");
  absl::StatusOr<std::shared_ptr<const strata::rpc::GrpcSecurity>> security =
      strata::serving::LoadGrpcSecurity(strata::rpc::GrpcSecurityOptionsFromFlags());
  if (!security.ok()) return Usage(security.status());
  absl::StatusOr<kv::StoreOptions> o = StoreOptionsFromFlags();
  if (!o.ok()) return Usage(o.status());
  SharedTierLink shared;
  if (absl::Status s = shared.Connect(); !s.ok()) return Usage(s);

  auto store = kv::BlockStore::Open(*o);
  if (!store.ok()) {
    std::cerr << "strata-store: " << store.status() << "\n";
    return 1;
  }
  kv::StoreService service(store->get(), o->max_block_bytes, shared.tier());
  int port = 0;
  auto server = kv::StartStoreServer(&service, absl::GetFlag(FLAGS_listen), o->max_block_bytes,
                                     &port, security->get());
  if (!server.ok()) {
    std::cerr << server.status() << "\n";
    return 1;
  }
  std::unique_ptr<prometheus::Exposer> metrics;
  if (const std::string address = MetricsAddress(); !address.empty()) {
    absl::StatusOr<std::unique_ptr<prometheus::Exposer>> m =
        strata::serving::StartMetrics(address, service.metrics());
    if (!m.ok()) {
      std::cerr << "strata-store: " << m.status().message() << "\n";
      kv::StopStoreServer(server->get(), &service);
      return 1;
    }
    metrics = *std::move(m);
    const std::vector<int> ports = metrics->GetListeningPorts();
    std::cout << "strata-store: metrics on port " << (ports.empty() ? -1 : ports.front())
              << std::endl;
  }
  absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> registration = RegisterStore(port);
  if (!registration.ok()) {
    std::cerr << "strata-store: --etcd " << absl::GetFlag(FLAGS_etcd) << ": "
              << registration.status() << "\n";
    kv::StopStoreServer(server->get(), &service);
    return 1;
  }
  std::cout << "strata-store: serving on port " << port << " (RAM " << o->ram_bytes
            << " bytes, disk " << (o->disk_path.empty() ? "none" : o->disk_path) << "; "
            << (*security)->Describe() << "; " << strata::AllocatorName() << ")" << std::endl;
  shared.RetryInto(&service);

  strata::WaitForTermination();
  registration->reset();  // out of etcd first: nodes and routers stop counting on it
  shared.Stop();
  kv::StopStoreServer(server->get(), &service);  // open Watch streams end too
  std::cout << "strata-store: stopped" << std::endl;
  return 0;
}
