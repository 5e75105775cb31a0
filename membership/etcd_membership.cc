#include "membership/etcd_membership.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_port.h"
#include "common/log.h"
#include "nlohmann/json.hpp"

namespace strata::membership {
namespace {

using nlohmann::json;

std::string NodesPrefix(const std::string& prefix) { return prefix + "nodes/"; }
std::string StoresPrefix(const std::string& prefix) { return prefix + "stores/"; }

// A registration's string field; "" when it is missing or not a string.
std::string StringField(const json& j, const char* field) {
  auto it = j.find(field);
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace

std::string StoreToJson(const StoreSpec& store) {
  json j{{"id", store.id}, {"grpc", store.grpc}, {"metrics", store.metrics}};
  if (!store.host.empty()) j["host"] = store.host;
  return j.dump();
}

std::string StoreHost(const StoreSpec& store) {
  if (!store.host.empty()) return store.host;
  absl::StatusOr<HostPort> hp = ParseHostPort(store.grpc);
  return hp.ok() ? hp->host : "";
}

absl::StatusOr<StoreSpec> StoreFromJson(const std::string& text) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError("store registration: not a JSON object");
  StoreSpec s;
  s.id = StringField(j, "id");
  if (!ValidNodeId(s.id)) {
    return absl::InvalidArgumentError(absl::StrCat("store registration: id ", kNodeIdRule));
  }
  s.grpc = StringField(j, "grpc");
  s.metrics = StringField(j, "metrics");
  s.host = StringField(j, "host");
  if (absl::Status st =
          ValidateHostPort(s.grpc, absl::StrCat("store registration ", s.id, ": grpc"));
      !st.ok()) {
    return st;
  }
  if (s.host.size() > 253) {
    return absl::InvalidArgumentError(
        absl::StrCat("store registration ", s.id, ": host is longer than 253 characters"));
  }
  return s;
}

absl::StatusOr<StoreSpec> StoreSpecFromFlags(const std::string& listen, int port,
                                             const std::string& advertise, const std::string& id,
                                             const std::string& metrics,
                                             const std::string& host_name) {
  StoreSpec s;
  s.metrics = metrics;
  s.host = host_name;
  if (!advertise.empty()) {
    if (absl::Status st = ValidateHostPort(advertise, "--advertise"); !st.ok()) return st;
    s.grpc = advertise;
  } else {
    absl::StatusOr<HostPort> hp = ParseHostPort(listen);
    if (!hp.ok()) return hp.status();
    if (hp->host.empty() || hp->host == "0.0.0.0" || hp->host == "::") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen ", listen, " names no host others can reach: give --advertise HOST:PORT"));
    }
    s.grpc = JoinHostPort(hp->host, port);
  }
  s.id = id;
  if (s.id.empty()) {
    s.id = "store-" + s.grpc;
    for (char& c : s.id) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
        c = '-';
      }
    }
  }
  if (!ValidNodeId(s.id)) {
    return absl::InvalidArgumentError(absl::StrCat("--store_id '", s.id, "': ", kNodeIdRule));
  }
  return s;
}

absl::StatusOr<StoreSpec> HostStore(EtcdClient& client, const std::string& prefix,
                                    const std::string& host, absl::Duration wait) {
  const absl::Time until = absl::Now() + wait;
  while (true) {
    absl::StatusOr<EtcdRange> range = client.RangePrefix(StoresPrefix(prefix));
    if (!range.ok()) return range.status();
    std::vector<StoreSpec> here;
    std::vector<std::string> all;
    for (const EtcdKeyValue& kv : range->kvs) {
      absl::StatusOr<StoreSpec> s = StoreFromJson(kv.value);
      if (!s.ok()) continue;
      all.push_back(absl::StrCat(s->id, " at ", s->grpc));
      if (StoreHost(*s) == host) here.push_back(*std::move(s));
    }
    if (here.size() > 1) {
      std::vector<std::string> names;
      for (const StoreSpec& s : here) names.push_back(absl::StrCat(s.id, " at ", s.grpc));
      return absl::FailedPreconditionError(absl::StrCat("several stores are registered on host ",
                                                        host, " (", absl::StrJoin(names, ", "),
                                                        "): give the node --store HOST:PORT"));
    }
    if (here.size() == 1) return here[0];
    if (absl::Now() >= until) {
      return absl::NotFoundError(absl::StrCat(
          "no store is registered in etcd ", StoresPrefix(prefix), " on host ", host,
          all.empty() ? std::string(" (none is registered)")
                      : absl::StrCat(" (registered: ", absl::StrJoin(all, ", "), ")")));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

std::string NodeToJson(const NodeSpec& node) {
  return json{{"id", node.id},           {"role", RoleName(node.role)},
              {"grpc", node.grpc},       {"transport", node.transport},
              {"metrics", node.metrics}, {"store", node.store}}
      .dump();
}

absl::StatusOr<NodeSpec> NodeFromJson(const std::string& text) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError("node registration: not a JSON object");
  NodeSpec n;
  n.id = StringField(j, "id");
  if (!ValidNodeId(n.id)) {
    return absl::InvalidArgumentError(absl::StrCat("node registration: id ", kNodeIdRule));
  }
  const std::string role = StringField(j, "role");
  if (role != "prefill" && role != "decode") {
    return absl::InvalidArgumentError(absl::StrCat(
        "node registration ", n.id, ": role must be prefill or decode, got '", role, "'"));
  }
  n.role = role == "prefill" ? Role::kPrefill : Role::kDecode;
  n.grpc = StringField(j, "grpc");
  n.transport = StringField(j, "transport");
  n.metrics = StringField(j, "metrics");
  n.store = StringField(j, "store");
  if (absl::Status s = ValidateHostPort(n.grpc, absl::StrCat("node registration ", n.id, ": grpc"));
      !s.ok()) {
    return s;
  }
  if (!n.store.empty()) {
    if (absl::Status s =
            ValidateHostPort(n.store, absl::StrCat("node registration ", n.id, ": store"));
        !s.ok()) {
      return s;
    }
  }
  return n;
}

// ---- EtcdMembership ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<EtcdMembership>> EtcdMembership::Start(
    std::unique_ptr<EtcdClient> client, std::string prefix, absl::Duration removal_grace) {
  std::unique_ptr<EtcdMembership> m(
      new EtcdMembership(std::move(client), std::move(prefix), removal_grace));
  if (absl::Status s = m->Read(); !s.ok()) return s;
  m->thread_ = std::thread([p = m.get()] { p->Loop(); });
  return m;
}

EtcdMembership::~EtcdMembership() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::vector<NodeSpec> EtcdMembership::Nodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = absl::Now();
  std::vector<NodeSpec> out;
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (it->second.gone_since != absl::InfiniteFuture() && it->second.gone_since + grace_ <= now) {
      Log("", absl::StrCat("membership: ", it->first, " gone from etcd for ",
                           absl::FormatDuration(grace_), "; removed"));
      it = nodes_.erase(it);
      continue;
    }
    out.push_back(it->second.node);
    ++it;
  }
  return out;
}

std::vector<StoreSpec> EtcdMembership::Stores() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StoreSpec> out;
  for (const auto& [key, s] : stores_) out.push_back(s);
  return out;
}

void EtcdMembership::RemoveLocked(const std::string& key, absl::Time now) {
  if (stores_.erase(key) > 0) return;
  auto it = nodes_.find(key);
  if (it == nodes_.end()) return;
  if (grace_ <= absl::ZeroDuration()) {
    nodes_.erase(it);
  } else if (it->second.gone_since == absl::InfiniteFuture()) {
    it->second.gone_since = now;
  }
}

std::string EtcdMembership::Describe() const {
  return absl::StrCat("etcd ", NodesPrefix(prefix_), "* (and ", StoresPrefix(prefix_), "*)");
}

absl::Status EtcdMembership::Read() {
  absl::StatusOr<EtcdRange> range = client_->RangePrefix(prefix_);
  if (!range.ok()) return range.status();
  std::map<std::string, NodeSpec> nodes;
  std::map<std::string, StoreSpec> stores;
  for (const EtcdKeyValue& kv : range->kvs) {
    if (kv.key.starts_with(StoresPrefix(prefix_))) {
      absl::StatusOr<StoreSpec> s = StoreFromJson(kv.value);
      if (!s.ok()) {
        Log("", absl::StrCat("membership: ", kv.key, ": ", s.status().message(), "; ignored"));
      } else {
        stores[kv.key] = *std::move(s);
      }
      continue;
    }
    if (!kv.key.starts_with(NodesPrefix(prefix_))) continue;
    absl::StatusOr<NodeSpec> n = NodeFromJson(kv.value);
    if (!n.ok()) {
      Log("", absl::StrCat("membership: ", kv.key, ": ", n.status().message(), "; ignored"));
      continue;
    }
    nodes[kv.key] = *std::move(n);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = absl::Now();
    std::vector<std::string> gone;
    for (const auto& [key, e] : nodes_) {
      if (!nodes.contains(key)) gone.push_back(key);
    }
    for (const std::string& key : gone) RemoveLocked(key, now);
    for (auto& [key, node] : nodes) nodes_[key] = Entry{.node = std::move(node)};
    stores_ = std::move(stores);
  }
  revision_ = range->revision;
  return absl::OkStatus();
}

void EtcdMembership::Apply(const EtcdKeyValue& kv, bool deleted) {
  std::lock_guard<std::mutex> lock(mu_);
  if (deleted) {
    RemoveLocked(kv.key, absl::Now());
    return;
  }
  if (kv.key.starts_with(StoresPrefix(prefix_))) {
    absl::StatusOr<StoreSpec> s = StoreFromJson(kv.value);
    if (!s.ok()) {
      Log("", absl::StrCat("membership: ", kv.key, ": ", s.status().message(), "; ignored"));
      stores_.erase(kv.key);
    } else {
      stores_[kv.key] = *std::move(s);
    }
    return;
  }
  if (!kv.key.starts_with(NodesPrefix(prefix_))) return;
  absl::StatusOr<NodeSpec> n = NodeFromJson(kv.value);
  if (!n.ok()) {
    Log("", absl::StrCat("membership: ", kv.key, ": ", n.status().message(), "; ignored"));
    nodes_.erase(kv.key);
    return;
  }
  nodes_[kv.key] = Entry{.node = *std::move(n)};
}

void EtcdMembership::Loop() {
  bool need_read = false;    // the whole prefix again, before the next watch
  bool down_logged = false;  // one line when the watch breaks, one when etcd is back
  while (!stop_.load()) {
    if (need_read) {
      if (absl::Status s = Read(); !s.ok()) {
        connected_.store(false);
        for (int i = 0; i < 5 && !stop_.load(); ++i) absl::SleepFor(absl::Milliseconds(100));
        continue;  // the membership known is kept meanwhile
      }
      need_read = false;
      if (down_logged) {
        Log("", "membership: etcd is back; membership read again");
        down_logged = false;
      }
    }
    connected_.store(true);
    absl::Status s = client_->Watch(
        prefix_, revision_ + 1,
        [this](int64_t revision, const std::vector<EtcdEvent>& events) {
          for (const EtcdEvent& e : events) Apply(e.kv, e.deleted);
          if (revision > revision_) revision_ = revision;
        },
        stop_);
    if (stop_.load()) break;
    connected_.store(false);
    if (!down_logged) {
      Log("", absl::StrCat("membership: watch ended: ", s.message(),
                           "; keeping the membership known and resuming"));
      down_logged = true;
    }
    // After a compaction, or a break (events may have been missed), read the whole prefix again
    // and watch from there; otherwise resume from the last revision seen.
    need_read = absl::IsFailedPrecondition(s) || absl::IsUnavailable(s);
    for (int i = 0; i < 2 && !stop_.load(); ++i) absl::SleepFor(absl::Milliseconds(100));
  }
}

// ---- EtcdRegistration --------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<EtcdRegistration>> EtcdRegistration::Start(
    std::unique_ptr<EtcdClient> client, std::string prefix, NodeSpec self, absl::Duration ttl) {
  return StartKey(std::move(client), NodesPrefix(prefix) + self.id, NodeToJson(self), ttl);
}

absl::StatusOr<std::unique_ptr<EtcdRegistration>> EtcdRegistration::StartStore(
    std::unique_ptr<EtcdClient> client, std::string prefix, StoreSpec self, absl::Duration ttl) {
  return StartKey(std::move(client), StoresPrefix(prefix) + self.id, StoreToJson(self), ttl);
}

absl::StatusOr<std::unique_ptr<EtcdRegistration>> EtcdRegistration::StartKey(
    std::unique_ptr<EtcdClient> client, std::string key, std::string value, absl::Duration ttl) {
  if (ttl < absl::Seconds(1)) return absl::InvalidArgumentError("registration TTL must be >= 1 s");
  std::unique_ptr<EtcdRegistration> r(
      new EtcdRegistration(std::move(client), std::move(key), std::move(value), ttl));
  if (absl::Status s = r->Register(); !s.ok()) return s;
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

EtcdRegistration::~EtcdRegistration() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (const int64_t lease = lease_.load(); lease != 0) client_->Revoke(lease).IgnoreError();
}

absl::Status EtcdRegistration::Register() {
  absl::StatusOr<int64_t> lease = client_->Grant(ttl_);
  if (!lease.ok()) return lease.status();
  if (absl::Status s = client_->Put(key_, value_, *lease); !s.ok()) {
    client_->Revoke(*lease).IgnoreError();
    return s;
  }
  lease_.store(*lease);
  return absl::OkStatus();
}

void EtcdRegistration::Loop() {
  bool down_logged = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, absl::ToChronoMilliseconds(ttl_ / 2), [this] { return stop_; })) {
    lock.unlock();
    absl::StatusOr<absl::Duration> left = client_->KeepAlive(lease_.load());
    absl::Status s = left.status();
    if (absl::IsNotFound(s)) s = Register();  // expired while etcd was away: register again
    if (!s.ok() && !down_logged) {
      Log("", absl::StrCat("registration ", key_, ": ", s.message(), "; retrying"));
      down_logged = true;
    } else if (s.ok() && down_logged) {
      Log("", absl::StrCat("registration ", key_, ": renewed again"));
      down_logged = false;
    }
    lock.lock();
  }
}

}  // namespace strata::membership
