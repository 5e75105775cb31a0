// Offload-capacity replay: a request trace (Mooncake format: 512-token prefix blocks named by
// hash ids) against the store's own tier ledger (tier_ledger.h: its eviction policies and rules,
// written once for both) with sizes only, so that terabyte-scale tier sweeps run in seconds.
// ReplayTest checks its hits against a real BlockStore fed the same trace. Each chunk carries all
// layers of one block_tokens-token chunk: chunk_bytes = layers x the codec's block size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstore/eviction_policy.h"

namespace strata::kvstore {

struct TraceRequest {
  double timestamp_ms = 0;
  uint32_t input_tokens = 0;
  uint32_t output_tokens = 0;
  std::vector<uint64_t> hash_ids;  // one per block_tokens tokens of the prompt (last partial)
};

// One JSON object per line; errors name the line and the field.
absl::StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path);

struct ReplayConfig {
  uint32_t block_tokens = 512;
  uint64_t chunk_bytes = 0;  // every layer of one chunk
  uint64_t ram_bytes = 0;
  uint64_t disk_bytes = 0;  // 0: no disk tier
  PolicyKind ram_policy = PolicyKind::kS3Fifo;
  // As StoreOptions::durable_puts (the store's default with a disk tier): every new chunk is
  // written to disk as it arrives, so RAM evictions never spill and the disk holds everything
  // (as far as it can). False: write-back, chunks reach the disk only when RAM evicts them.
  bool durable_puts = true;
};

struct ReplayResult {
  uint64_t requests = 0;
  uint64_t chunks_requested = 0, chunk_hits_ram = 0, chunk_hits_disk = 0;
  // ReplayCluster with a shared tier: chunks found there (and promoted into the host's store),
  // bytes it served and took, its evictions, and at the end the chunks it holds and how many of
  // them are orphans (their parent gone from the tier: unreachable by a lookup there).
  uint64_t chunk_hits_shared = 0, bytes_read_shared = 0, bytes_written_shared = 0;
  uint64_t shared_evictions = 0, shared_chunks = 0, shared_orphans = 0;
  std::vector<uint64_t> host_requests;              // ReplayCluster: requests routed to each host
  uint64_t tokens_requested = 0, tokens_saved = 0;  // prompt tokens; those not prefilled
  uint64_t bytes_read_ram = 0, bytes_read_disk = 0, bytes_written_disk = 0;
  uint64_t ram_evictions = 0, disk_evictions = 0, promotions = 0, orphans_dropped = 0;
  double chunk_hit_rate() const {
    return chunks_requested
               ? double(chunk_hits_ram + chunk_hits_disk + chunk_hits_shared) / chunks_requested
               : 0;
  }
  double token_hit_rate() const {
    return tokens_requested ? double(tokens_saved) / tokens_requested : 0;
  }
};

ReplayResult Replay(const std::vector<TraceRequest>& trace, const ReplayConfig& config);

// Where a cluster's stores are (issue "Beyond one store machine"):
//   kCentral     one strata-store every host's nodes share: one machine's RAM and disk (Replay).
//   kPerHost     a store per host, each host's nodes using their own (cluster.sh --host-stores).
//   kSharedTier  a store per host and a Redis Cluster behind them all (--shared-tier): every
//                chunk a store takes is written through to it; a lookup that misses the host's
//                store walks on into it, and what it finds is promoted into the host's store.
//                The tier is modelled as Redis under maxmemory with an LRU policy, which knows no
//                chains: its evictions leave orphans (counted); TTLs are not modelled.
enum class StoreLayout { kCentral, kPerHost, kSharedTier };
absl::StatusOr<StoreLayout> ParseStoreLayout(
    absl::string_view name);  // central|per-host|shared-tier
const char* StoreLayoutName(StoreLayout layout);

struct ClusterReplayConfig {
  ReplayConfig store;  // each store's tiers (one machine's)
  StoreLayout layout = StoreLayout::kCentral;
  uint32_t hosts = 4;
  uint64_t shared_bytes = 0;  // kSharedTier: the tier's memory, all masters together
  // kSharedTier: the layers of a chunk, each a field of the chunk's Redis hash (as SharedTier
  // keeps it). Each chunk then takes what Redis takes for it (RedisChunkBytes); 0: chunk_bytes,
  // an allocator that wastes nothing.
  uint32_t shared_layers = 0;
  // The router's pick among hosts (routing_policy.h's prefill cost, with stores only):
  //   cost_h = max(0, (queue_h + prompt) / C - (own_h + store_credit * max(0, shared - own_h)))
  // own_h: leading chunks in host h's store; shared: in the shared tier; queue_h: tokens host h
  // still has to prefill, drained at prefill_tokens_per_s between requests (trace timestamps;
  // 0: no queue). The lowest cost wins, ties at random (seeded).
  double prefill_tokens_per_s = 0;
  double store_credit = 0.5;
  uint64_t seed = 1;
};

ReplayResult ReplayCluster(const std::vector<TraceRequest>& trace,
                           const ClusterReplayConfig& config);

// The allocation jemalloc (Redis's allocator) makes for `n` bytes: 16-byte steps to 128 B, then
// four size classes per doubling (a 5,386-byte value takes 6,144).
uint64_t JemallocSizeClass(uint64_t n);
// Redis 7's memory for one chunk of `chunk_bytes` kept as a hash of `layers` fields (values
// larger than hash-max-listpack-value, so a hashtable): every value, field name and entry
// rounded up to its size class, and the key's own structures and TTL. 0 layers: chunk_bytes.
// Checked against Redis's count on a live run (bench/results/trace_replay-shared-redis-*: 19 KB
// for a 3-layer chunk of 16 KB).
uint64_t RedisChunkBytes(uint64_t chunk_bytes, uint32_t layers);

}  // namespace strata::kvstore
