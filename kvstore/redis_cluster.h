// A Redis Cluster client on hiredis (Debian's libhiredis 0.14): the cluster protocol done
// properly — the slot map from CLUSTER SLOTS, MOVED (the map updated, then refreshed) and ASK
// (ASKING then the command on the importing node) redirections, TRYAGAIN / CLUSTERDOWN / LOADING
// and lost nodes retried with backoff (a failover: the map refreshed from any node that answers)
// until the call's deadline, a pool of idle connections per node, AUTH (Redis ACL user or the
// default user), TLS (kvstore/redis_connection.h: hiredis parses, OpenSSL encrypts), and a
// call's commands pipelined per node.
//
//   RedisClusterOptions o{.seeds = {"127.0.0.1:7000"}};
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<RedisCluster> redis, RedisCluster::Connect(o));
//   std::vector<RedisCommand> cmds = {{"SET", "k1", value}, {"GET", "k2"}};
//   std::vector<absl::StatusOr<RedisReply>> replies = redis->Run(cmds, absl::Now() + timeout);
//
// Every command's second argument is its key (the slot it is routed by). Replies come back in the
// commands' order; a Redis error reply (other than a redirection or a retryable state) is that
// command's kFailedPrecondition naming the error; a command still unanswered at the deadline is
// kDeadlineExceeded (kUnavailable when no node could be reached).
//
// Thread-safe: calls may run concurrently, each on connections of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/shared_bytes.h"
#include "kvstore/redis_connection.h"

namespace strata::kvstore {

struct RedisClusterOptions {
  std::vector<std::string> seeds;  // host:port of any of the cluster's nodes (one is enough)
  std::string user = "";           // ACL user ("": the default user)
  std::string password = "";       // AUTH ("": none)
  absl::Duration connect_timeout = absl::Milliseconds(500);
  absl::Duration io_timeout = absl::Seconds(2);  // one reply's wait
  int max_redirects = 8;                         // per command and call
  size_t max_idle_per_node = 8;                  // pooled connections kept per node
  RedisTlsOptions tls = {};                      // TLS to every node (Redis's tls-port)

  absl::Status Validate() const;  // kInvalidArgument naming the field
};

using RedisCommand = std::vector<std::string>;  // argv; binary-safe
// The same without copies: views of bytes the caller keeps alive for the call (a block's value).
using RedisCommandView = std::vector<absl::string_view>;

struct RedisReply {
  enum class Type { kNil, kString, kStatus, kInteger, kArray };
  Type type = Type::kNil;
  std::string str;    // kString (unless RunViews put it in `bytes`), kStatus
  SharedBytes bytes;  // kString with RunViews(..., aligned_strings): 64-byte aligned, no `str`
  int64_t integer = 0;
  std::vector<RedisReply> elements;  // kArray
};

// A MOVED or ASK target as the client names nodes ("host:port", IPv6 hosts in brackets): Redis
// writes an IPv6 host bare ("fd00::5:7001") and an unknown endpoint as an empty host (":7001",
// the node that answered, `answered_by`). Anything else is returned as it is.
std::string RedisRedirectTarget(const std::string& target, const std::string& answered_by);

struct RedisClusterStats {
  uint64_t commands = 0;
  uint64_t moved = 0;      // MOVED redirections followed
  uint64_t ask = 0;        // ASK redirections followed
  uint64_t retries = 0;    // TRYAGAIN / CLUSTERDOWN / LOADING / a node lost, retried
  uint64_t refreshes = 0;  // slot map reloads
  uint64_t connects = 0;   // connections opened
  uint64_t stale = 0;      // pooled connections the server closed while idle, dropped unused
  uint64_t io_errors = 0;  // connections lost or timed out
  uint64_t errors = 0;     // commands that ended in an error
};

class RedisCluster {
 public:
  // Connects to a seed and loads the slot map. kInvalidArgument for bad options; kUnavailable
  // when no seed answers (naming each and why); kFailedPrecondition when AUTH is refused or the
  // node is not in cluster mode.
  static absl::StatusOr<std::unique_ptr<RedisCluster>> Connect(RedisClusterOptions options);
  ~RedisCluster();
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  std::vector<absl::StatusOr<RedisReply>> Run(absl::Span<const RedisCommand> commands,
                                              absl::Time deadline);
  // `aligned_strings`: string replies land in RedisReply::bytes (an aligned buffer, copied once
  // from hiredis's reply) instead of `str` — a block read is then ready to parse as it is.
  std::vector<absl::StatusOr<RedisReply>> RunViews(absl::Span<const RedisCommandView> commands,
                                                   absl::Time deadline,
                                                   bool aligned_strings = false);

  // The hash slot of `key` (CRC16 of the key or its {hash tag}, modulo 16384).
  static uint16_t Slot(absl::string_view key);
  // The node serving `slot` in the current map ("host:port").
  std::string NodeFor(uint16_t slot) const;
  RedisClusterStats Stats() const;

 private:
  struct Pool;
  explicit RedisCluster(RedisClusterOptions options);
  // Reloads the slot map from any known node or seed, those that failed last tried last, each
  // wait capped by `deadline`; kUnavailable when none answers in time.
  absl::Status Refresh(absl::Time deadline = absl::InfiniteFuture());
  // A pooled connection to `node`, or a new one (connect bounded by the connect timeout and
  // `deadline`).
  absl::StatusOr<std::unique_ptr<RedisConnection>> Take(const std::string& node,
                                                        absl::Time deadline);
  // Back to the pool after a good exchange (the node is no longer suspect).
  void Give(const std::string& node, std::unique_ptr<RedisConnection> c);
  // It failed before `deadline` passed: a refresh asks it last until an exchange succeeds.
  void SuspectUnlessLate(const std::string& node, absl::Time deadline);

  const RedisClusterOptions options_;
  mutable std::mutex mu_;
  std::vector<std::string> nodes_;  // known masters, "host:port"
  std::vector<uint16_t> slots_;     // slot -> index into nodes_ (65535: unassigned)
  std::set<std::string> suspects_;  // nodes whose last exchange failed
  std::unique_ptr<Pool> pool_;
  std::shared_ptr<RedisTlsContext> tls_;  // null: plain TCP
  RedisClusterStats stats_;
  absl::Time last_refresh_ = absl::InfinitePast();
};

}  // namespace strata::kvstore
