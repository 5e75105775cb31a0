// Offload-capacity replay: a request trace (Mooncake format: 512-token prefix blocks named by
// hash ids) against the store's own tier ledger (tier_ledger.h: its eviction policies and rules,
// written once for both) with sizes only, so that terabyte-scale tier sweeps run in seconds.
// ReplayTest checks its hits against a real BlockStore fed the same trace. Each chunk carries all
// layers of one block_tokens-token chunk: chunk_bytes = layers x the codec's block size.
#pragma once

#include <cstdint>
#include <list>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
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
  // ReplayCluster with decode_puts: requests whose decode wrote chunks, the chunks of generated
  // text it wrote, and the prompt chunks it copied into a decode host's store that lacked them.
  uint64_t decode_writers = 0, decode_generated_chunks = 0, decode_prompt_copies = 0;
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
//                The tier is modelled as Redis's masters under maxmemory with its (sampled) LRU
//                policy, which knows no chains: its evictions leave orphans (counted); TTLs are
//                not modelled.
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
  // kSharedTier: the Redis Cluster's masters, each with an equal share of shared_bytes (the
  // chunks spread over them by hash, as hash slots spread keys); what each takes before any key
  // (Redis 7.0.15 in cluster mode: 1.6 MB, its used_memory_startup); and its eviction:
  // maxmemory-samples keys sampled per eviction (Redis's default 5; 0: an exact LRU).
  uint32_t shared_masters = 1;
  uint64_t shared_baseline_bytes = 0;
  uint32_t shared_lru_samples = 0;
  // The router's pick among hosts (routing_policy.h's prefill cost, with stores only):
  //   cost_h = max(0, (queue_h + prompt) / C - store_credit * max(own_h, shared))
  // own_h: leading chunks in host h's store; shared: in the shared tier (the live router credits
  // the chunks a node can read from its store or the tier alike, at its store_hit_weight);
  // queue_h: tokens host h still has to prefill, drained at prefill_tokens_per_s between
  // requests (trace timestamps; 0: no queue). The lowest cost wins, ties at random (seeded).
  double prefill_tokens_per_s = 0;
  double store_credit = 0.5;
  uint64_t seed = 1;
  // With prefill_tokens_per_s: a request's chunks reach its host's store (and the shared tier)
  // when its host has prefilled it (its queue, then its own missed tokens, at that rate), not
  // when it arrives. A request arriving meanwhile misses them, as in a serving cluster, where
  // requests are in flight together.
  bool in_flight = false;
  // Decode nodes store what they computed (DecodeEngine::PutGenerated, on by default there): a
  // request whose KV at its end, (input + output - 1) / block_tokens chunks, holds more chunks
  // than its prompt's full ones has the new chunks put into its decode host's store (and through
  // to the shared tier), and the prompt's chunks too where that store lacks the prompt's last
  // one (the store refuses a chunk without its parent; the node then puts from chunk 0). The
  // decode host is drawn at random (seeded): the live router picks it by load alone. The new
  // chunks' ids are fresh (generated text is never another prompt's). With kCentral, the one
  // store takes the new chunks alone.
  bool decode_puts = true;
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

// One Redis master under maxmemory (the shared tier's model, ReplayCluster, is one per master)
// (allkeys-lru or volatile-lru: every chunk has a TTL). With `samples` 0 an exact LRU; else Redis's
// approximation (evict.c): each eviction samples that many keys at random into a pool of the 16
// with the longest idle time seen, then evicts the pool's longest-idle key that still exists. Idle
// times are whole seconds (Redis's LRU clock) taken when a key is sampled, as Redis keeps them.
class RedisMasterModel {
 public:
  RedisMasterModel(uint64_t capacity, uint32_t samples, uint64_t seed)
      : capacity_(capacity), samples_(samples), rng_(seed) {}

  bool Contains(uint64_t id) const { return entries_.contains(id); }
  size_t size() const { return entries_.size(); }

  void Touch(uint64_t id, int64_t now_s) {
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    it->second.access_s = now_s;
    lru_.splice(lru_.begin(), lru_, it->second.order);
  }

  // Adds `id` taking `cost` bytes, first evicting as Redis would (each victim to `evicted`);
  // false when it cannot fit at all.
  template <typename Evicted>
  bool Add(uint64_t id, uint64_t cost, int64_t now_s, Evicted&& evicted) {
    if (cost > capacity_) return false;
    while (used_ + cost > capacity_ && !entries_.empty()) {
      const uint64_t victim = samples_ == 0 ? lru_.back() : SampledVictim(now_s);
      Remove(victim);
      evicted(victim);
    }
    lru_.push_front(id);
    entries_[id] = {lru_.begin(), keys_.size(), now_s, cost};
    keys_.push_back(id);
    used_ += cost;
    return true;
  }

 private:
  struct Entry {
    std::list<uint64_t>::iterator order;
    size_t index;  // in keys_
    int64_t access_s;
    uint64_t cost;
  };
  uint64_t SampledVictim(int64_t now_s) {
    constexpr size_t kPool = 16;
    while (true) {
      for (uint32_t i = 0; i < samples_; ++i) {
        const uint64_t key = keys_[rng_() % keys_.size()];
        const int64_t idle = now_s - entries_.at(key).access_s;
        if (pool_.size() == kPool && idle <= pool_.front().first) continue;
        pool_.insert(std::upper_bound(pool_.begin(), pool_.end(), std::make_pair(idle, key)),
                     {idle, key});
        if (pool_.size() > kPool) pool_.erase(pool_.begin());
      }
      while (!pool_.empty()) {
        const uint64_t key = pool_.back().second;
        pool_.pop_back();
        if (entries_.contains(key)) return key;  // else evicted or gone since it was sampled
      }
    }
  }
  void Remove(uint64_t id) {
    auto it = entries_.find(id);
    lru_.erase(it->second.order);
    const size_t i = it->second.index;
    keys_[i] = keys_.back();
    entries_.at(keys_[i]).index = i;
    keys_.pop_back();
    used_ -= it->second.cost;
    entries_.erase(it);
  }

  const uint64_t capacity_;
  const uint32_t samples_;
  uint64_t used_ = 0;
  std::mt19937_64 rng_;
  std::list<uint64_t> lru_;  // most recent first
  absl::flat_hash_map<uint64_t, Entry> entries_;
  std::vector<uint64_t> keys_;                      // for sampling at random
  std::vector<std::pair<int64_t, uint64_t>> pool_;  // (idle s, key), longest idle last
};

}  // namespace strata::kvstore
