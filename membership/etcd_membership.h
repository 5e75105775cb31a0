// Membership in etcd: nodes and stores register themselves under a lease (EtcdRegistration), and
// routers follow the registrations (EtcdMembership).
//
//   <prefix>nodes/<id>   ->
//   {"id":..,"role":"prefill"|"decode","grpc":..,"transport":..,"metrics":..} <prefix>stores/<id>
//   ->  {"id":..,"grpc":..,"metrics":..[,"host":..]}
//
// A node started with `--store host` reads the stores once at start (HostStore) and uses the one
// registered for its own host (StoreHost: the store's "host", else its address's host).
//
// A node's key lives on a lease of `ttl` (a few seconds) renewed at half of it: a node that dies
// (or is cut off) leaves the membership within the TTL, and one that stops cleanly revokes its
// lease at once. The router reads the prefix, then watches it from the next revision; a broken
// watch is resumed from the last revision seen (a fresh read when that revision was compacted),
// and while etcd is unreachable the router keeps the membership it has.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "membership/cluster_file.h"
#include "membership/etcd_client.h"

namespace strata::membership {

// A node's registration as JSON, and back (errors name the field).
std::string NodeToJson(const NodeSpec& node);
absl::StatusOr<NodeSpec> NodeFromJson(const std::string& text);
// A store's registration as JSON, and back (errors name the field).
std::string StoreToJson(const StoreSpec& store);
absl::StatusOr<StoreSpec> StoreFromJson(const std::string& text);

// What a store registers: its id (`id`, or store-HOST-PORT), gRPC address (`advertise`, or
// `listen`'s host with the port it got: kInvalidArgument when that host is a wildcard) and the
// machine it serves (`host_name`; "" = its address's host).
absl::StatusOr<StoreSpec> StoreSpecFromFlags(const std::string& listen, int port,
                                             const std::string& advertise, const std::string& id,
                                             const std::string& metrics,
                                             const std::string& host_name = "");

// The machine a store serves: its `host`, else its gRPC address's host.
std::string StoreHost(const StoreSpec& store);

// The store registered under `prefix` for machine `host` (a node's own; StoreHost), waiting up to
// `wait` for one to register. kNotFound naming the stores registered when none is there;
// kFailedPrecondition when several are (hosts on one address: give the node --store HOST:PORT);
// kUnavailable when etcd cannot be read.
absl::StatusOr<StoreSpec> HostStore(EtcdClient& client, const std::string& prefix,
                                    const std::string& host, absl::Duration wait);

class EtcdMembership final : public Membership {
 public:
  // Reads the registrations under `prefix` (UNAVAILABLE when etcd cannot be reached), then
  // follows them from a thread of its own. A registration that disappears stays listed for
  // `removal_grace` (0: leaves at once) and leaves unless it reappears meanwhile: when etcd was
  // cut off from the nodes, every lease runs out in etcd and the nodes register again only once
  // they reach it, which the watch may report as deletions first (a partition need not break the
  // watch). Listed is not routed to: the router routes only to nodes that answer its load polls
  // and are not draining, so a node that died is out of routing at once all the same.
  static absl::StatusOr<std::unique_ptr<EtcdMembership>> Start(
      std::unique_ptr<EtcdClient> client, std::string prefix,
      absl::Duration removal_grace = absl::Seconds(10));
  ~EtcdMembership() override;

  std::vector<NodeSpec> Nodes() const override;
  std::vector<StoreSpec> Stores() const override;
  std::string Describe() const override;
  // Whether the watch is live now (false while etcd is unreachable).
  bool connected() const { return connected_.load(); }

 private:
  EtcdMembership(std::unique_ptr<EtcdClient> client, std::string prefix, absl::Duration grace)
      : client_(std::move(client)), prefix_(std::move(prefix)), grace_(grace) {}
  absl::Status Read();  // the whole prefix, replacing what is known
  void Apply(const EtcdKeyValue& kv, bool deleted);
  void Loop();
  // A registration gone: at once, or once the grace has passed. Under mu_.
  void RemoveLocked(const std::string& key, absl::Time now);

  struct Entry {
    NodeSpec node;
    absl::Time gone_since = absl::InfiniteFuture();  // still listed until gone_since + grace
  };
  const std::unique_ptr<EtcdClient> client_;
  const std::string prefix_;
  const absl::Duration grace_;
  mutable std::mutex mu_;
  mutable std::map<std::string, Entry> nodes_;  // by key; guarded by mu_
  std::map<std::string, StoreSpec> stores_;     // by key; guarded by mu_ (no grace: routing
                                                // does not depend on them)
  int64_t revision_ = 0;                        // the last revision applied; watch thread only
  std::atomic<bool> connected_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class EtcdRegistration {
 public:
  // Grants a lease of `ttl`, puts `self` under it, and renews it every ttl / 2 from a thread of
  // its own (a lease that expired meanwhile, etcd having been away, is granted and put again).
  static absl::StatusOr<std::unique_ptr<EtcdRegistration>> Start(std::unique_ptr<EtcdClient> client,
                                                                 std::string prefix, NodeSpec self,
                                                                 absl::Duration ttl);
  // A store's: under <prefix>stores/<id>.
  static absl::StatusOr<std::unique_ptr<EtcdRegistration>> StartStore(
      std::unique_ptr<EtcdClient> client, std::string prefix, StoreSpec self, absl::Duration ttl);
  // Deregisters: revokes the lease (the key goes with it).
  ~EtcdRegistration();
  int64_t lease() const { return lease_.load(); }

 private:
  EtcdRegistration(std::unique_ptr<EtcdClient> client, std::string key, std::string value,
                   absl::Duration ttl)
      : client_(std::move(client)), key_(std::move(key)), value_(std::move(value)), ttl_(ttl) {}
  static absl::StatusOr<std::unique_ptr<EtcdRegistration>> StartKey(
      std::unique_ptr<EtcdClient> client, std::string key, std::string value, absl::Duration ttl);
  absl::Status Register();
  void Loop();

  const std::unique_ptr<EtcdClient> client_;
  const std::string key_, value_;
  const absl::Duration ttl_;
  std::atomic<int64_t> lease_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace strata::membership
