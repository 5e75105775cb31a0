#include "router/node_pool.h"

#include <algorithm>
#include <condition_variable>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "router/routing_policy.h"
#include "rpc/grpc_keepalive.h"
#include "rpc/grpc_status.h"
#include "serving/node_process.h"

namespace strata::router {
namespace {

int Millis(absl::Duration d) {
  return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, INT32_MAX));
}

NodeRole RoleOf(membership::Role role) {
  return role == membership::Role::kPrefill ? NodeRole::kPrefill : NodeRole::kDecode;
}

}  // namespace

absl::Status NodePoolOptions::Validate() const {
  if (load_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("node pool: load_timeout must be positive");
  }
  if (max_reconnect_backoff <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("node pool: max_reconnect_backoff must be positive");
  }
  return absl::OkStatus();
}

struct NodePool::Probe {
  std::string id;
  std::shared_ptr<const NodeConnection> connection;
  grpc::ClientContext context;
  strata::v1::LoadRequest request;
  strata::v1::NodeLoad response;
  grpc::Status status;
  absl::Time answered_at;
};

NodePool::NodePool(NodePoolOptions options,
                   std::shared_ptr<const membership::Membership> membership,
                   prometheus::Registry* registry)
    : options_(std::move(options)), membership_(std::move(membership)) {
  if (registry != nullptr) {
    health_family_ = &prometheus::BuildGauge()
                          .Name("strata_router_node_healthy")
                          .Help("1 when the node answers Load and fits the cluster, else 0")
                          .Register(*registry);
  }
  SyncMembership();
}

NodePool::~NodePool() = default;

std::shared_ptr<const NodeConnection> NodePool::Connect(const membership::NodeSpec& spec) const {
  auto c = std::make_shared<NodeConnection>();
  c->spec = spec;
  c->description =
      absl::StrCat(membership::RoleName(spec.role), " node ", spec.id, " (", spec.grpc, ")");
  grpc::ChannelArguments args;
  rpc::SetClientKeepalive(&args);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, Millis(options_.max_reconnect_backoff));
  // Prompts travel in one message: allow what the nodes accept (64 MiB).
  args.SetMaxSendMessageSize(64 << 20);
  c->channel = options_.security != nullptr
                   ? options_.security->CreateChannel(spec.grpc, args)
                   : grpc::CreateCustomChannel(spec.grpc, grpc::InsecureChannelCredentials(), args);
  if (spec.role == membership::Role::kPrefill) {
    c->prefill = strata::v1::PrefillNode::NewStub(c->channel);
  } else {
    c->decode = strata::v1::DecodeNode::NewStub(c->channel);
  }
  return c;
}

std::vector<std::unique_ptr<NodePool::Probe>> NodePool::SyncMembership() {
  const std::vector<membership::NodeSpec> members = membership_->Nodes();
  std::vector<std::unique_ptr<Probe>> probes;
  std::vector<std::string> logs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    absl::flat_hash_set<std::string> ids;
    for (const membership::NodeSpec& m : members) ids.insert(m.id);
    for (auto it = nodes_.begin(); it != nodes_.end();) {
      if (ids.contains(it->first)) {
        ++it;
        continue;
      }
      logs.push_back(absl::StrCat(it->second.connection->description, " left the cluster"));
      if (it->second.health_gauge != nullptr) health_family_->Remove(it->second.health_gauge);
      it = nodes_.erase(it);
    }
    order_.clear();
    for (const membership::NodeSpec& m : members) {
      auto it = nodes_.find(m.id);
      if (it != nodes_.end() && (it->second.connection->spec.grpc != m.grpc ||
                                 it->second.connection->spec.role != m.role)) {
        if (it->second.health_gauge != nullptr) health_family_->Remove(it->second.health_gauge);
        nodes_.erase(it);
        it = nodes_.end();
      }
      if (it == nodes_.end()) {
        Node n;
        n.connection = Connect(m);
        n.status.spec = m;
        if (health_family_ != nullptr) {
          n.health_gauge =
              &health_family_->Add({{"node", m.id}, {"role", membership::RoleName(m.role)}});
          n.health_gauge->Set(0);
        }
        logs.push_back(
            absl::StrCat(n.connection->description, " joined (", membership_->Describe(), ")"));
        it = nodes_.emplace(m.id, std::move(n)).first;
      }
      order_.push_back(m.id);
      auto probe = std::make_unique<Probe>();
      probe->id = m.id;
      probe->connection = it->second.connection;
      probes.push_back(std::move(probe));
    }
  }
  for (const std::string& line : logs) serving::Log("", line);
  return probes;
}

void NodePool::PollOnce() {
  std::vector<std::unique_ptr<Probe>> probes = SyncMembership();

  // Every node at once: one slow or dead node must not delay the others' reports.
  std::mutex done_mu;
  std::condition_variable done_cv;
  size_t pending = probes.size();
  const absl::Time deadline = absl::Now() + options_.load_timeout;
  for (const std::unique_ptr<Probe>& p : probes) {
    p->context.set_deadline(absl::ToChronoTime(deadline));
    // The waiter below returns only once every callback has signalled, under done_mu, so the
    // captured locals outlive every callback's use of them.
    auto done = [&done_mu, &done_cv, &pending, probe = p.get()](grpc::Status s) {
      probe->status = std::move(s);
      probe->answered_at = absl::Now();
      std::lock_guard<std::mutex> lock(done_mu);
      --pending;
      done_cv.notify_all();
    };
    if (p->connection->prefill != nullptr) {
      p->connection->prefill->async()->Load(&p->context, &p->request, &p->response, done);
    } else {
      p->connection->decode->async()->Load(&p->context, &p->request, &p->response, done);
    }
  }
  {
    std::unique_lock<std::mutex> lock(done_mu);
    done_cv.wait(lock, [&] { return pending == 0; });
  }
  for (const std::unique_ptr<Probe>& p : probes) Record(p->id, *p);
}

std::string NodePool::Contradiction(const membership::NodeSpec& spec,
                                    const strata::v1::NodeLoad& report) const {
  const std::string role = membership::RoleName(spec.role);
  if (!report.role().empty() && report.role() != role) {
    return absl::StrCat("answers as a ", report.role(), " node, the cluster file says ", role);
  }
  if (!report.node_id().empty() && report.node_id() != spec.id) {
    return absl::StrCat("answers as node '", report.node_id(), "'");
  }
  if (!options_.model_name.empty() && !report.model().empty() &&
      report.model() != options_.model_name) {
    return absl::StrCat("serves model '", report.model(), "', the router '", options_.model_name,
                        "'");
  }
  const model::ServedFormat& format = options_.format;
  if (format.chunk_tokens != 0 && report.chunk_tokens() != 0 &&
      report.chunk_tokens() != format.chunk_tokens) {
    return absl::StrCat("uses chunks of ", report.chunk_tokens(), " tokens, the router ",
                        format.chunk_tokens);
  }
  if (!format.codec.empty() && !report.codec().empty() && report.codec() != format.codec) {
    return absl::StrCat("serves codec ", report.codec(), ", the router ", format.codec);
  }
  return "";
}

void NodePool::Record(const std::string& id, const Probe& probe) {
  std::string line;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(id);
    // A node replaced while its probe was out: the next round reports on the new one.
    if (it == nodes_.end() || it->second.connection != probe.connection) return;
    Node& n = it->second;
    NodeStatus& s = n.status;
    const NodeConnection& c = *n.connection;
    std::string problem;
    if (!probe.status.ok()) {
      problem = std::string(rpc::FromGrpc(probe.status, "Load").message());
    } else {
      problem = Contradiction(c.spec, probe.response);
      // Leaving the cluster: nothing new goes there (what it runs finishes or is handed off).
      if (problem.empty() && probe.response.draining()) problem = "draining (leaving the cluster)";
    }
    const bool first = s.reported_at == absl::InfinitePast() && s.problem == "never answered";
    if (problem.empty()) {
      if (!s.healthy) {
        line = absl::StrCat(c.description, " is healthy (incarnation ",
                            probe.response.incarnation(), ")");
      } else if (s.report.incarnation() != probe.response.incarnation()) {
        line = absl::StrCat(c.description, " restarted (incarnation ", s.report.incarnation(),
                            " -> ", probe.response.incarnation(), ")");
      }
      s.report = probe.response;
      s.reported_at = probe.answered_at;
    } else if (s.healthy || first) {
      line = absl::StrCat(c.description, " is unhealthy: ", problem);
    }
    s.healthy = problem.empty();
    s.problem = problem;
    if (n.health_gauge != nullptr) n.health_gauge->Set(s.healthy ? 1 : 0);
  }
  if (!line.empty()) serving::Log("", line);
}

std::vector<NodeLoad> NodePool::Loads() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<NodeLoad> out;
  out.reserve(order_.size());
  for (const std::string& id : order_) {
    const NodeStatus& s = nodes_.at(id).status;
    const strata::v1::NodeLoad& r = s.report;
    NodeLoad l;
    l.id = id;
    l.role = RoleOf(s.spec.role);
    l.healthy = s.healthy;
    l.queued_prefill_tokens = r.queued_prefill_tokens();
    l.active_requests = r.active_requests();
    l.kv_bytes_in_use = r.kv_bytes_in_use();
    l.kv_bytes_reserved = r.kv_bytes_reserved();
    l.kv_bytes_capacity = r.kv_bytes_capacity();
    l.max_batch = r.max_batch();
    l.max_waiting = r.max_waiting();
    l.max_queued_prefill_tokens = r.max_queued_prefill_tokens();
    l.prefill_tokens_per_second = r.prefill_tokens_per_second();
    l.reads_store = options_.prefill_reads_store || !s.spec.store.empty();
    const std::string& store = s.spec.store.empty() ? options_.cluster_store : s.spec.store;
    if (!store.empty()) l.store_holder = StoreHolderId(store, options_.cluster_store);
    l.reported_at = s.reported_at;
    out.push_back(std::move(l));
  }
  return out;
}

double NodePool::DecodeKvBytesPerToken() const {
  std::lock_guard<std::mutex> lock(mu_);
  double most = 0;
  for (const auto& [id, n] : nodes_) {
    if (n.status.healthy && n.status.spec.role == membership::Role::kDecode) {
      most = std::max(most, n.status.report.kv_bytes_per_token());
    }
  }
  return most;
}

std::shared_ptr<const NodeConnection> NodePool::Connection(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second.connection;
}

std::vector<NodeStatus> NodePool::Status() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<NodeStatus> out;
  out.reserve(order_.size());
  for (const std::string& id : order_) out.push_back(nodes_.at(id).status);
  return out;
}

}  // namespace strata::router
