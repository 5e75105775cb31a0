// EtcdClient: what Strata needs of etcd v3 (a key-value range, leases, a prefix watch), behind an
// interface; HttpEtcdClient speaks etcd's JSON gRPC-gateway (`POST /v3/...` over HTTP/1.1, keys
// and values base64, int64 as strings) with Boost.Beast, one connection per call (watches hold
// theirs). See ../shared/notes/etcd-and-openai-api.md for the measured behaviour of Debian's
// etcd 3.4 this follows: one-shot lease keepalives, one long POST per watch resumed from the
// last revision + 1.
//
// Errors: UNAVAILABLE when etcd cannot be reached or answers 5xx; the gateway's code for 4xx;
// NOT_FOUND from KeepAlive when the lease is gone. Thread-safe (no shared connection).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace strata::membership {

struct EtcdKeyValue {
  std::string key, value;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

struct EtcdRange {
  std::vector<EtcdKeyValue> kvs;
  int64_t revision = 0;  // the store's revision the range was read at
};

struct EtcdEvent {
  bool deleted = false;  // DELETE (a lease's expiry too); else PUT
  EtcdKeyValue kv;       // for a DELETE: the key (and mod_revision) only
};

class EtcdClient {
 public:
  virtual ~EtcdClient() = default;
  virtual absl::Status Put(const std::string& key, const std::string& value, int64_t lease) = 0;
  // Every key starting with `prefix`.
  virtual absl::StatusOr<EtcdRange> RangePrefix(const std::string& prefix) = 0;
  virtual absl::Status Delete(const std::string& key) = 0;
  // A lease of `ttl` (whole seconds, >= 1); its id.
  virtual absl::StatusOr<int64_t> Grant(absl::Duration ttl) = 0;
  // Renews `lease`; its remaining TTL. NOT_FOUND when it has expired (or was revoked).
  virtual absl::StatusOr<absl::Duration> KeepAlive(int64_t lease) = 0;
  virtual absl::Status Revoke(int64_t lease) = 0;
  // Streams the events under `prefix` from `start_revision` (each batch with its revision) until
  // the stream breaks (its status returned), etcd cancels it (a compacted revision:
  // FAILED_PRECONDITION naming the compact revision), or `stop` turns true (CANCELLED, within
  // about a second).
  virtual absl::Status Watch(
      const std::string& prefix, int64_t start_revision,
      const std::function<void(int64_t revision, const std::vector<EtcdEvent>& events)>& on,
      const std::atomic<bool>& stop) = 0;
};

// One line of a watch stream: the batch's revision and its events.
struct EtcdWatchBatch {
  int64_t revision = 0;
  std::vector<EtcdEvent> events;
};

// The gateway's answers, parsed (exposed for the tests and tests/fuzz/etcd_answer_fuzz.cc; any
// bytes give a value or an error, never a crash). `endpoint` only names etcd in messages.
// A watch line: UNAVAILABLE for one that is not JSON or carries an error, FAILED_PRECONDITION for
// a cancelled watch (a compacted revision).
absl::StatusOr<EtcdWatchBatch> ParseEtcdWatchLine(const std::string& line,
                                                  const std::string& endpoint);
// A /v3/kv/range answer's body (fields missing read as empty / zero).
absl::StatusOr<EtcdRange> ParseEtcdRange(const std::string& body, const std::string& endpoint);
// The status of an answer with HTTP status `http_status` (its first line `body`): OK below 400,
// UNAVAILABLE for 5xx, else the gateway's gRPC code (UNKNOWN when it names none or an invalid
// one), never OK.
absl::Status EtcdAnswerStatus(int http_status, const std::string& body, const std::string& where);

// `endpoint` is host:port of etcd's client URL (http).
std::unique_ptr<EtcdClient> NewHttpEtcdClient(const std::string& endpoint,
                                              absl::Duration timeout = absl::Seconds(5));

}  // namespace strata::membership
