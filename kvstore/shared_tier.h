// SharedTier: Strata blocks in a Redis Cluster that every host's store reads and writes, the tier
// behind the per-host stores (issue "Beyond one store machine"). Blocks keep their checksums end
// to end: Redis is not trusted with integrity, so a value that is not the block its key names
// (damaged, truncated, another block's bytes) is a miss, counted (`damaged`), never served.
//
// A chunk is one Redis hash, its layers the fields: the key is `key_prefix` + "c:" + the chunk's
// BlockName::Encode() with layer 0 (model, codec and calibration fingerprints, and the chunk's
// prefix key, which carries a tenant's cache salt: binary, 60 bytes after the prefix), the field
// the layer's number, the value the block's bytes as they are. One key per chunk, not per layer:
// Redis evicts whole keys, and a chunk missing any layer is a miss, so with a key per layer an
// eviction could leave a chunk's other layers holding memory that no lookup can use. (Measured on
// a scaled trace: token hit 7.78 % with a key per layer, 8.20 % with a hash per chunk, one run
// each: bench/results/trace_replay-shared-{redis,hash}-2026-11-28-*.txt.) A per-layer codec (the
// Strata mix) puts each codec's layers under a key of their own.
//
// Eviction that keeps chains useful: Redis evicts by its own LRU (or TTL) and knows nothing of
// prefixes, and a chunk is only useful after its whole prefix. So every block gets a TTL that
// grows toward the root — ttl + root_bonus / (chunk index + 1): chunk 0 lives longest — and a hit
// renews it (GETEX): a chain fetched together is renewed together, and its parents always outlive
// its descendants when nothing else touches them. Under `maxmemory` with an LRU policy the same
// renewal keeps a used chain's prefix recent.
//
//   SharedTierOptions o{.redis = {.seeds = {"10.0.0.9:7000"}}};
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SharedTier> tier, SharedTier::Connect(o));
//   std::vector<absl::Status> put = tier->Put({{name, chunk_index, bytes}});
//   std::vector<absl::StatusOr<SharedBytes>> got = tier->Get({{name, chunk_index}});  // kNotFound:
//   miss
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "kvstore/redis_cluster.h"

namespace strata::kvstore {

struct SharedTierOptions {
  RedisClusterOptions redis = {};
  std::string key_prefix = "strata:";
  absl::Duration ttl = absl::Hours(1);         // every block's
  absl::Duration root_bonus = absl::Hours(1);  // added to chunk 0's, half to chunk 1's, ...
  absl::Duration timeout = absl::Seconds(2);   // one call's deadline
  absl::Status Validate() const;
};

struct SharedTierStats {
  uint64_t gets = 0, hits = 0, misses = 0;
  uint64_t damaged = 0;  // values refused: not the block their key names
  uint64_t puts = 0, put_errors = 0, get_errors = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
  double get_seconds = 0, put_seconds = 0;  // summed over calls
  RedisClusterStats redis;
};

class SharedTier {
 public:
  static absl::StatusOr<std::unique_ptr<SharedTier>> Connect(SharedTierOptions options);

  struct Key {
    BlockName name;
    uint32_t chunk_index = 0;  // the chunk's position in its sequence (sets the TTL)
  };
  struct Item {
    BlockName name;
    uint32_t chunk_index = 0;
    SharedBytes block;  // read during the call only: borrowed bytes will do
    // The bytes' CRC was verified where they arrived in this process (a store's Put): the
    // structure and the name are still checked, the CRC is not computed again.
    bool checksum_verified = false;
  };
  // Writes the blocks (pipelined): each one's status. A block that does not parse, fails its
  // checksum or disagrees with its name (layer, fingerprints, chunk index) is refused
  // (kInvalidArgument / kDataLoss) and not written.
  std::vector<absl::Status> Put(absl::Span<const Item> items);
  // Reads the blocks (pipelined), renewing each hit's TTL: each one's bytes (checksum verified),
  // kNotFound for a miss (absent, or present but damaged: counted), or the error that kept the
  // tier from answering (kUnavailable, kDeadlineExceeded).
  std::vector<absl::StatusOr<SharedBytes>> Get(absl::Span<const Key> keys);
  // Whether each block is present (without reading or renewing it).
  std::vector<absl::StatusOr<bool>> Contains(absl::Span<const Key> keys);

  // The chunk's key and the block's field in it.
  std::string KeyOf(const BlockName& name) const;
  static std::string FieldOf(const BlockName& name);
  absl::Duration TtlFor(uint32_t chunk_index) const {
    return options_.ttl + options_.root_bonus / (static_cast<int64_t>(chunk_index) + 1);
  }
  SharedTierStats Stats() const;
  RedisCluster& redis() { return *redis_; }

 private:
  SharedTier(SharedTierOptions options, std::unique_ptr<RedisCluster> redis)
      : options_(std::move(options)), redis_(std::move(redis)) {}
  // OK when `bytes` is a sound block named `name` at `chunk_index`.
  absl::Status Check(const BlockName& name, uint32_t chunk_index, absl::Span<const uint8_t> bytes,
                     bool checksum_verified = false) const;

  const SharedTierOptions options_;
  std::unique_ptr<RedisCluster> redis_;
  mutable std::mutex mu_;
  SharedTierStats stats_;
};

}  // namespace strata::kvstore
