#include "kvstore/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/host_port.h"

namespace strata::kvstore {
namespace {

constexpr int kSlots = 16384;
constexpr uint16_t kUnassigned = 0xffff;

RedisReply Convert(const redisReply* r, bool aligned_strings = false) {
  RedisReply out;
  switch (r->type) {
    case REDIS_REPLY_STRING:
      out.type = RedisReply::Type::kString;
      if (aligned_strings) {
        AlignedBuffer b = AlignedBuffer::Uninitialized(r->len);
        if (r->len > 0) std::memcpy(b.data(), r->str, r->len);
        out.bytes = SharedBytes::FromBuffer(std::move(b));
      } else {
        out.str.assign(r->str, r->len);
      }
      break;
    case REDIS_REPLY_STATUS:
      out.type = RedisReply::Type::kStatus;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_INTEGER:
      out.type = RedisReply::Type::kInteger;
      out.integer = r->integer;
      break;
    case REDIS_REPLY_ARRAY:
      out.type = RedisReply::Type::kArray;
      for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(Convert(r->element[i]));
      break;
    default:
      out.type = RedisReply::Type::kNil;
  }
  return out;
}

// Sends one command and reads its reply (for AUTH and CLUSTER SLOTS); a Redis error reply is
// put in `error`.
absl::StatusOr<RedisReply> Call(RedisConnection& c, const RedisCommand& cmd, std::string* error,
                                absl::Time deadline = absl::InfiniteFuture()) {
  const std::vector<absl::string_view> argv(cmd.begin(), cmd.end());
  absl::StatusOr<RedisReplyPtr> r = c.Call(argv, deadline);
  if (!r.ok()) return r.status();
  if ((*r)->type == REDIS_REPLY_ERROR) error->assign((*r)->str, (*r)->len);
  return Convert(r->get());
}

}  // namespace

// A redirection's "host:port" as the pool names nodes: Redis writes an IPv6 host without
// brackets ("fd00::5:7001") and an unknown endpoint as an empty host (":7001", which means the
// node that answered).
std::string RedisRedirectTarget(const std::string& target, const std::string& answered_by) {
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return target;
  std::string host = target.substr(0, colon);
  uint32_t port = 0;
  if (!absl::SimpleAtoi(target.substr(colon + 1), &port) || port > 65535) return target;
  if (host.empty()) {
    const absl::StatusOr<HostPort> asked = ParseHostPort(answered_by);
    if (!asked.ok()) return target;
    host = asked->host;
  }
  if (!host.empty() && host.front() == '[') return target;  // already bracketed
  return JoinHostPort(host, static_cast<uint16_t>(port));
}

// Idle connections per node.
struct RedisCluster::Pool {
  std::mutex mu;
  std::map<std::string, std::vector<std::unique_ptr<RedisConnection>>> idle;
};

absl::Status RedisClusterOptions::Validate() const {
  if (seeds.empty()) return absl::InvalidArgumentError("redis cluster: no seed nodes");
  for (const std::string& s : seeds) {
    absl::StatusOr<HostPort> hp = ParseHostPort(s);
    if (!hp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis cluster: seed '", s, "': ", hp.status().message()));
    }
  }
  if (connect_timeout <= absl::ZeroDuration() || io_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("redis cluster: connect_timeout and io_timeout must be > 0");
  }
  if (max_redirects < 1) return absl::InvalidArgumentError("redis cluster: max_redirects < 1");
  if (!user.empty() && password.empty()) {
    return absl::InvalidArgumentError("redis cluster: a user without a password");
  }
  if (!tls.enabled && (!tls.ca_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty() ||
                       !tls.server_name.empty())) {
    return absl::InvalidArgumentError("redis cluster: TLS files or a server name without TLS");
  }
  return absl::OkStatus();
}

uint16_t RedisCluster::Slot(absl::string_view key) {
  // A {hash tag}: only the part between the first '{' and the next '}', when not empty.
  const size_t open = key.find('{');
  if (open != absl::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != absl::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  uint16_t crc = 0;  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial 0
  for (unsigned char ch : key) {
    crc ^= static_cast<uint16_t>(ch) << 8;
    for (int i = 0; i < 8; ++i) {
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc % kSlots;
}

RedisCluster::RedisCluster(RedisClusterOptions options)
    : options_(std::move(options)), slots_(kSlots, kUnassigned), pool_(std::make_unique<Pool>()) {}

RedisCluster::~RedisCluster() = default;

absl::StatusOr<std::unique_ptr<RedisCluster>> RedisCluster::Connect(RedisClusterOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::shared_ptr<RedisTlsContext> tls;
  if (options.tls.enabled) {
    absl::StatusOr<std::shared_ptr<RedisTlsContext>> t = RedisTlsContext::Create(options.tls);
    if (!t.ok()) return t.status();
    tls = *std::move(t);
  }
  std::unique_ptr<RedisCluster> r(new RedisCluster(std::move(options)));
  r->tls_ = std::move(tls);
  if (absl::Status s = r->Refresh(); !s.ok()) return s;
  return r;
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisCluster::Take(const std::string& node,
                                                                    absl::Time deadline) {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("redis ", node, ": the deadline passed before sending"));
  }
  // The newest idle connection the server has not closed meanwhile; those it closed (Redis's
  // `timeout`, a restart) are dropped here rather than failed on a command. Each is checked
  // (and a stale one closed) outside the pool's lock, which every node shares.
  uint64_t stale = 0;
  std::unique_ptr<RedisConnection> pooled;
  while (pooled == nullptr) {
    std::unique_ptr<RedisConnection> c;
    {
      std::lock_guard<std::mutex> lock(pool_->mu);
      auto it = pool_->idle.find(node);
      if (it == pool_->idle.end() || it->second.empty()) break;
      c = std::move(it->second.back());
      it->second.pop_back();
    }
    if (c->Reusable()) {
      pooled = std::move(c);
    } else {
      ++stale;
    }
  }
  if (stale > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.stale += stale;
  }
  if (pooled != nullptr) return pooled;
  absl::StatusOr<HostPort> hp = ParseHostPort(node);
  if (!hp.ok()) return hp.status();
  const absl::Duration connect_timeout = std::min(options_.connect_timeout, deadline - absl::Now());
  if (connect_timeout <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(
        absl::StrCat("redis ", node, ": the deadline passed before connecting"));
  }
  absl::StatusOr<std::unique_ptr<RedisConnection>> c =
      RedisConnection::Open(hp->host, hp->port, connect_timeout, options_.io_timeout, tls_.get());
  if (!c.ok()) return c.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.connects;
  }
  if (!options_.password.empty()) {
    RedisCommand auth = {"AUTH"};
    if (!options_.user.empty()) auth.push_back(options_.user);
    auth.push_back(options_.password);
    std::string error;
    absl::StatusOr<RedisReply> r = Call(**c, auth, &error, deadline);
    if (!r.ok() || !error.empty()) {
      return r.ok() ? absl::FailedPreconditionError(absl::StrCat("redis ", node, ": AUTH: ", error))
                    : r.status();
    }
  }
  return c;
}

void RedisCluster::Give(const std::string& node, std::unique_ptr<RedisConnection> c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    suspects_.erase(node);
  }
  std::lock_guard<std::mutex> lock(pool_->mu);
  std::vector<std::unique_ptr<RedisConnection>>& idle = pool_->idle[node];
  if (idle.size() < options_.max_idle_per_node) idle.push_back(std::move(c));
}

void RedisCluster::SuspectUnlessLate(const std::string& node, absl::Time deadline) {
  if (absl::Now() >= deadline) return;  // the call's time ran out: not the node's fault
  std::lock_guard<std::mutex> lock(mu_);
  suspects_.insert(node);
}

absl::Status RedisCluster::Refresh(absl::Time deadline) {
  std::vector<std::string> candidates;
  std::set<std::string> suspects;
  {
    std::lock_guard<std::mutex> lock(mu_);
    candidates = nodes_;
    suspects = suspects_;
    ++stats_.refreshes;
  }
  for (const std::string& s : options_.seeds) {
    if (std::find(candidates.begin(), candidates.end(), s) == candidates.end()) {
      candidates.push_back(s);
    }
  }
  // A node that just failed (a master lost, a host gone silent) is asked last: each one that
  // does not answer costs a timeout.
  std::stable_partition(candidates.begin(), candidates.end(),
                        [&](const std::string& n) { return suspects.count(n) == 0; });
  std::vector<std::string> failures;
  for (const std::string& node : candidates) {
    if (absl::Now() >= deadline) {
      failures.push_back("the deadline passed");
      break;
    }
    absl::StatusOr<std::unique_ptr<RedisConnection>> c = Take(node, deadline);
    if (!c.ok()) {
      if (c.status().code() == absl::StatusCode::kFailedPrecondition) return c.status();
      failures.push_back(std::string(c.status().message()));
      SuspectUnlessLate(node, deadline);
      continue;
    }
    std::string error;
    absl::StatusOr<RedisReply> r = Call(**c, {"CLUSTER", "SLOTS"}, &error, deadline);
    if (!r.ok()) {
      failures.push_back(std::string(r.status().message()));
      SuspectUnlessLate(node, deadline);
      continue;
    }
    Give(node, *std::move(c));
    if (!error.empty()) {
      if (absl::StrContains(error, "cluster support disabled")) {
        return absl::FailedPreconditionError(
            absl::StrCat("redis ", node, ": not in cluster mode (", error, ")"));
      }
      failures.push_back(absl::StrCat("redis ", node, ": ", error));
      continue;
    }
    // [[start, end, [host, port, id...], replicas...], ...]
    const absl::StatusOr<HostPort> asked = ParseHostPort(node);
    std::vector<std::string> nodes;
    std::vector<uint16_t> slots(kSlots, kUnassigned);
    size_t assigned = 0;
    for (const RedisReply& range : r->elements) {
      if (range.elements.size() < 3 || range.elements[2].elements.size() < 2) continue;
      const int64_t start = range.elements[0].integer, end = range.elements[1].integer;
      std::string host = range.elements[2].elements[0].str;
      if (host.empty() || host == "?") host = asked.ok() ? asked->host : "127.0.0.1";
      const std::string addr =
          JoinHostPort(host, static_cast<uint16_t>(range.elements[2].elements[1].integer));
      auto it = std::find(nodes.begin(), nodes.end(), addr);
      const uint16_t index = static_cast<uint16_t>(it - nodes.begin());
      if (it == nodes.end()) nodes.push_back(addr);
      for (int64_t s = std::max<int64_t>(0, start); s <= std::min<int64_t>(kSlots - 1, end); ++s) {
        slots[s] = index;
        ++assigned;
      }
    }
    if (assigned == 0) {
      failures.push_back(absl::StrCat("redis ", node, ": CLUSTER SLOTS assigns no slot"));
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    nodes_ = std::move(nodes);
    slots_ = std::move(slots);
    last_refresh_ = absl::Now();
    // Suspects that left the cluster are forgotten (hosts come back under new addresses).
    std::erase_if(suspects_, [&](const std::string& n) {
      return std::find(nodes_.begin(), nodes_.end(), n) == nodes_.end() &&
             std::find(options_.seeds.begin(), options_.seeds.end(), n) == options_.seeds.end();
    });
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("redis cluster: no node answered CLUSTER SLOTS: ",
                                             absl::StrJoin(failures, "; ")));
}

std::string RedisCluster::NodeFor(uint16_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint16_t i = slots_[slot % kSlots];
  return i == kUnassigned || i >= nodes_.size() ? "" : nodes_[i];
}

RedisClusterStats RedisCluster::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::vector<absl::StatusOr<RedisReply>> RedisCluster::Run(absl::Span<const RedisCommand> commands,
                                                          absl::Time deadline) {
  std::vector<RedisCommandView> views;
  views.reserve(commands.size());
  for (const RedisCommand& c : commands) views.emplace_back(c.begin(), c.end());
  return RunViews(views, deadline);
}

std::vector<absl::StatusOr<RedisReply>> RedisCluster::RunViews(
    absl::Span<const RedisCommandView> commands, absl::Time deadline, bool aligned_strings) {
  const size_t n = commands.size();
  std::vector<absl::StatusOr<RedisReply>> out(
      n, absl::DeadlineExceededError("redis cluster: the deadline passed before a reply"));
  std::vector<size_t> pending;
  std::vector<std::string> ask(n);  // an ASK target, for the next attempt only
  std::vector<int> redirects(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (commands[i].size() < 2) {
      out[i] = absl::InvalidArgumentError("redis cluster: a command without a key");
    } else {
      pending.push_back(i);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.commands += pending.size();
  }
  absl::Duration backoff = absl::Milliseconds(10);
  bool reached_any = false;
  std::string last_problem;
  while (!pending.empty()) {
    // Group by node: the ASK target, else the slot's owner.
    std::map<std::string, std::vector<size_t>> by_node;
    std::vector<size_t> unrouted;
    for (size_t i : pending) {
      std::string node = ask[i];
      if (node.empty()) node = NodeFor(Slot(commands[i][1]));
      if (node.empty()) {
        unrouted.push_back(i);
      } else {
        by_node[node].push_back(i);
      }
    }
    std::vector<size_t> again = unrouted;
    bool refresh = !unrouted.empty(), retry_later = !unrouted.empty();
    if (!unrouted.empty()) last_problem = "slots not served by any node (cluster down?)";
    // Every node's commands are sent before any reply is read: the nodes work at once, and a
    // call costs one round trip, not one per node.
    struct Leg {
      std::string node;
      std::vector<size_t> idx;
      std::unique_ptr<RedisConnection> conn;
      absl::Status io;
    };
    std::vector<Leg> legs;
    legs.reserve(by_node.size());
    for (auto& [node, idx] : by_node) {
      absl::StatusOr<std::unique_ptr<RedisConnection>> c = Take(node, deadline);
      if (!c.ok() && c.status().code() == absl::StatusCode::kDeadlineExceeded) {
        // Nothing more is sent once the call's time is out: these stay pending.
        if (last_problem.empty()) last_problem = std::string(c.status().message());
        again.insert(again.end(), idx.begin(), idx.end());
        continue;
      }
      if (!c.ok()) {
        if (c.status().code() == absl::StatusCode::kFailedPrecondition) {
          for (size_t i : idx) out[i] = c.status();
          continue;
        }
        SuspectUnlessLate(node, deadline);
        last_problem = std::string(c.status().message());
        again.insert(again.end(), idx.begin(), idx.end());
        refresh = retry_later = true;
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.io_errors;
        continue;
      }
      // Pipeline: every command (after ASKING where redirected); the replies below.
      RedisConnection& conn = **c;
      static constexpr absl::string_view kAsking[] = {"ASKING"};
      for (size_t i : idx) {
        if (!ask[i].empty()) conn.Append(kAsking);
        conn.Append(commands[i]);
      }
      absl::Status io = conn.Flush(deadline);
      legs.push_back({node, std::move(idx), *std::move(c), std::move(io)});
    }
    for (Leg& leg : legs) {
      const std::string& node = leg.node;
      const std::vector<size_t>& idx = leg.idx;
      RedisConnection& conn = *leg.conn;
      absl::Status& io = leg.io;
      for (size_t k = 0; io.ok() && k < idx.size(); ++k) {
        const size_t i = idx[k];
        const bool was_ask = !ask[i].empty();
        ask[i].clear();
        if (was_ask) {  // ASKING's +OK
          if (absl::StatusOr<RedisReplyPtr> ok = conn.Read(deadline); !ok.ok()) {
            io = ok.status();
            break;
          }
        }
        // Values into aligned buffers: a large one straight from the socket.
        absl::StatusOr<RedisDirectReply> reply = conn.ReadReply(deadline, aligned_strings);
        if (!reply.ok()) {
          io = reply.status();
          break;
        }
        reached_any = true;
        if (reply->bulk.has_value()) {
          RedisReply value;
          value.type = RedisReply::Type::kString;
          value.bytes = SharedBytes::FromBuffer(*std::move(reply->bulk));
          out[i] = std::move(value);
          continue;
        }
        const redisReply* r = reply->parsed.get();
        if (r->type != REDIS_REPLY_ERROR) {
          out[i] = Convert(r, aligned_strings);
          continue;
        }
        const std::string error(r->str, r->len);
        std::vector<std::string> parts = absl::StrSplit(error, ' ');
        const bool moved = parts[0] == "MOVED", asked = parts[0] == "ASK";
        if ((moved || asked) && parts.size() >= 3) {
          parts[2] = RedisRedirectTarget(parts[2], node);
          if (++redirects[i] > options_.max_redirects) {
            out[i] = absl::UnavailableError(absl::StrCat(
                "redis cluster: more than ", options_.max_redirects, " redirections: ", error));
            std::lock_guard<std::mutex> lock(mu_);
            ++stats_.errors;
            continue;
          }
          std::lock_guard<std::mutex> lock(mu_);
          if (moved) {
            ++stats_.moved;
            uint32_t slot = 0;
            if (absl::SimpleAtoi(parts[1], &slot) && slot < kSlots) {
              auto it = std::find(nodes_.begin(), nodes_.end(), parts[2]);
              if (it == nodes_.end()) it = nodes_.insert(nodes_.end(), parts[2]);
              slots_[slot] = static_cast<uint16_t>(it - nodes_.begin());
            }
            refresh = true;  // a MOVED is usually one slot of many that moved
          } else {
            ++stats_.ask;
            ask[i] = parts[2];
          }
          again.push_back(i);
          continue;
        }
        if (parts[0] == "TRYAGAIN" || parts[0] == "CLUSTERDOWN" || parts[0] == "LOADING" ||
            parts[0] == "MASTERDOWN") {
          last_problem = error;
          again.push_back(i);
          retry_later = true;
          if (parts[0] != "TRYAGAIN") refresh = true;
          continue;
        }
        out[i] = absl::FailedPreconditionError(absl::StrCat("redis ", node, ": ", error));
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.errors;
      }
      if (io.ok()) {
        Give(node, std::move(leg.conn));
        continue;
      }
      // The connection failed mid-pipeline: the commands without a reply go again (a SET or
      // GETEX that ran twice does no harm: the values are content-addressed).
      last_problem = std::string(io.message());
      SuspectUnlessLate(node, deadline);
      for (size_t i : idx) {
        if (out[i].status().code() == absl::StatusCode::kDeadlineExceeded) again.push_back(i);
      }
      refresh = retry_later = true;
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.io_errors;
    }
    std::sort(again.begin(), again.end());
    again.erase(std::unique(again.begin(), again.end()), again.end());
    pending = std::move(again);
    if (pending.empty()) break;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.retries += retry_later ? pending.size() : 0;
    }
    if (retry_later) {
      if (absl::Now() + backoff >= deadline) break;
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(200));
    }
    if (refresh) (void)Refresh(deadline);  // failing is fine: the next attempt tries again
    if (absl::Now() >= deadline) break;
  }
  for (size_t i : pending) {
    out[i] = reached_any ? absl::DeadlineExceededError(absl::StrCat(
                               "redis cluster: no reply before the deadline: ", last_problem))
                         : absl::UnavailableError(
                               absl::StrCat("redis cluster: no node reachable: ", last_problem));
  }
  if (!pending.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.errors += pending.size();
  }
  return out;
}

}  // namespace strata::kvstore
