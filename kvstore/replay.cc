#include "kvstore/replay.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <fstream>
#include <list>
#include <memory>
#include <optional>
#include <queue>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/mix64.h"
#include "kvstore/tier_ledger.h"
#include "nlohmann/json.hpp"

namespace strata::kvstore {

absl::StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("trace: cannot read ", path));
  std::vector<TraceRequest> out;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("trace ", path, " line ", n, ": ", why));
    };
    if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
    TraceRequest r;
    if (!j.contains("input_length") || !j["input_length"].is_number_unsigned()) {
      return bad("input_length is missing or not a non-negative integer");
    }
    if (!j.contains("hash_ids") || !j["hash_ids"].is_array()) return bad("hash_ids is not a list");
    r.input_tokens = j["input_length"].get<uint32_t>();
    r.output_tokens = j.value("output_length", 0u);
    r.timestamp_ms = j.value("timestamp", 0.0);
    for (const auto& id : j["hash_ids"]) {
      if (!id.is_number_unsigned()) return bad("a hash id is not a non-negative integer");
      r.hash_ids.push_back(id.get<uint64_t>());
    }
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

// The store's tiers over sizes alone: BlockStore's own ledger (tier_ledger.h), driven in the
// order BlockStore drives it (a Put written through to disk first when puts are durable, then
// into RAM; a RAM victim spilled, kept or dropped as the ledger says; the disk trimmed after each
// block it takes; a disk hit promoted to RAM, its disk copy kept).
class TierModel {
 public:
  explicit TierModel(const ReplayConfig& c)
      : c_(c), ledger_(c.ram_bytes, c.disk_bytes, c.disk_bytes > 0, c.ram_policy) {}

  // The tier holding `id`: 0 none, 1 RAM, 2 disk.
  int Where(uint64_t id) const {
    const auto* e = ledger_.Find(id);
    if (e == nullptr) return 0;
    return e->in_ram ? 1 : 2;
  }

  void Hit(uint64_t id, ReplayResult& r) {
    if (ledger_.Find(id)->in_ram) {
      ledger_.TouchRam(id);
      r.bytes_read_ram += c_.chunk_bytes;
      return;
    }
    ledger_.TouchDisk(id);
    r.bytes_read_disk += c_.chunk_bytes;
    if (InsertRam(id, r)) ++r.promotions;  // the disk copy stays
  }

  // A newly prefilled chunk; false when its parent is gone (it could never be found).
  bool Put(uint64_t id, uint64_t parent, bool has_parent, ReplayResult& r) {
    if (ledger_.Contains(id)) return true;
    if (has_parent && !ledger_.Contains(parent)) return false;
    ledger_.Add(id, has_parent ? &parent : nullptr, c_.chunk_bytes);
    if (c_.durable_puts && ledger_.disk_tier()) {
      WriteToDisk(id, r);
      if (!ledger_.Contains(id)) return false;  // larger than the disk tier
    }
    if (!InsertRam(id, r) && !ledger_.Find(id)->on_disk) {
      if (ledger_.disk_tier()) {
        WriteToDisk(id, r);  // RAM cannot take it: straight to disk
      } else {
        Drop(id, r);
      }
    }
    return ledger_.Contains(id);
  }

 private:
  // False when RAM cannot take it (smaller than a block, or full of prefixes of resident blocks).
  bool InsertRam(uint64_t id, ReplayResult& r) {
    if (c_.chunk_bytes > c_.ram_bytes) return false;
    const bool room = ledger_.EvictRam(
        c_.chunk_bytes, [](uint64_t) { return false; },
        [&](uint64_t victim, const Ledger::Entry&, RamFate fate) {
          ++r.ram_evictions;
          if (fate == RamFate::kSpill) WriteToDisk(victim, r);
          if (fate == RamFate::kDrop) Drop(victim, r);
        });
    if (!room || !ledger_.Contains(id)) return false;
    ledger_.AddToRam(id);
    return true;
  }

  void WriteToDisk(uint64_t id, ReplayResult& r) {
    ledger_.AddToDisk(id);
    r.bytes_written_disk += c_.chunk_bytes;
    ledger_.EvictDisk(0, [&](uint64_t victim, const Ledger::Entry& e) {
      ++r.disk_evictions;
      if (!e.in_ram) Drop(victim, r);  // in no tier any more
    });
  }

  void Drop(uint64_t id, ReplayResult& r) {
    r.orphans_dropped += ledger_.Drop(id, [](uint64_t, const Ledger::Entry&) {});
  }

  struct NoBytes {};
  using Ledger = TierLedger<uint64_t, NoBytes>;
  const ReplayConfig c_;
  Ledger ledger_;
};

}  // namespace

uint64_t JemallocSizeClass(uint64_t n) {
  if (n <= 8) return 8;
  if (n <= 128) return (n + 15) / 16 * 16;
  const uint64_t group = std::bit_floor(n - 1);  // four classes per doubling above 128 B
  const uint64_t spacing = group / 4;
  return (n + spacing - 1) / spacing * spacing;
}

uint64_t RedisChunkBytes(uint64_t chunk_bytes, uint32_t layers) {
  if (layers == 0) return chunk_bytes;
  const uint64_t value = (chunk_bytes + layers - 1) / layers;
  // Per field: the value's sds (a 9-byte header and a NUL), its name's sds, its dictEntry.
  const uint64_t field =
      JemallocSizeClass(value + 10) + JemallocSizeClass(16) + JemallocSizeClass(24);
  // Per key: its dictEntry and sds name in the keyspace, the robj, the hash's dict and table,
  // the expires dictEntry (every chunk has a TTL).
  const uint64_t key = JemallocSizeClass(24) + JemallocSizeClass(48) + JemallocSizeClass(16) +
                       JemallocSizeClass(96) + JemallocSizeClass(24);
  return layers * field + key;
}

namespace {

// The shared tier: a Redis Cluster's masters, each a RedisMasterModel of an equal share of the
// memory less what Redis takes before any key, the chunks spread over them by their names' hash
// (as hash slots spread keys). Chunks enter with no parent (Redis knows no chains); parents are
// remembered to count the orphans left. Each chunk takes `cost` bytes (RedisChunkBytes) and
// moves chunk_bytes.
class SharedTierModel {
 public:
  SharedTierModel(const ClusterReplayConfig& c, uint64_t chunk_bytes, uint64_t cost)
      : chunk_bytes_(chunk_bytes), cost_(cost) {
    const uint32_t masters = std::max<uint32_t>(1, c.shared_masters);
    const uint64_t share = c.shared_bytes / masters;
    for (uint32_t m = 0; m < masters; ++m) {
      masters_.emplace_back(share > c.shared_baseline_bytes ? share - c.shared_baseline_bytes : 0,
                            c.shared_lru_samples, c.seed + 7919 * (m + 1));
    }
  }

  bool Contains(uint64_t id) const { return Master(id).Contains(id); }

  void Hit(uint64_t id, int64_t now_s, ReplayResult& r) {  // GETEX: read, and recent again
    Master(id).Touch(id, now_s);
    r.bytes_read_shared += chunk_bytes_;
  }

  void Put(uint64_t id, uint64_t parent, bool has_parent, int64_t now_s, ReplayResult& r) {
    RedisMasterModel& m = Master(id);
    if (m.Contains(id)) {
      m.Touch(id, now_s);
      return;
    }
    if (!m.Add(id, cost_, now_s, [&](uint64_t victim) {
          ++r.shared_evictions;
          parents_.erase(victim);
        })) {
      return;
    }
    r.bytes_written_shared += chunk_bytes_;
    if (has_parent) parents_[id] = parent;
  }

  void Finish(ReplayResult& r) const {
    r.shared_chunks = 0;
    for (const RedisMasterModel& m : masters_) r.shared_chunks += m.size();
    for (const auto& [id, parent] : parents_) {
      if (!Contains(parent)) ++r.shared_orphans;
    }
  }

 private:
  size_t MasterIndex(uint64_t id) const {
    return Mix64(id) % masters_.size();  // trace ids are small: mixed first
  }
  RedisMasterModel& Master(uint64_t id) { return masters_[MasterIndex(id)]; }
  const RedisMasterModel& Master(uint64_t id) const { return masters_[MasterIndex(id)]; }

  const uint64_t chunk_bytes_;
  const uint64_t cost_;
  std::vector<RedisMasterModel> masters_;
  absl::flat_hash_map<uint64_t, uint64_t> parents_;  // of chunks in the tier with a parent
};

}  // namespace

absl::StatusOr<StoreLayout> ParseStoreLayout(absl::string_view name) {
  if (name == "central") return StoreLayout::kCentral;
  if (name == "per-host") return StoreLayout::kPerHost;
  if (name == "shared-tier") return StoreLayout::kSharedTier;
  return absl::InvalidArgumentError(absl::StrCat("replay: store layout '", name,
                                                 "' is not one of central, per-host, shared-tier"));
}

const char* StoreLayoutName(StoreLayout layout) {
  switch (layout) {
    case StoreLayout::kPerHost:
      return "per-host";
    case StoreLayout::kSharedTier:
      return "shared-tier";
    default:
      return "central";
  }
}

ReplayResult ReplayCluster(const std::vector<TraceRequest>& trace,
                           const ClusterReplayConfig& config) {
  const ReplayConfig& sc = config.store;
  const bool one_store = config.layout == StoreLayout::kCentral || config.hosts <= 1;
  if (one_store && !config.decode_puts) {
    ReplayResult r = Replay(trace, sc);
    r.host_requests = {r.requests};
    return r;
  }
  // One store: the cluster's walk with one host (what Replay does, plus the decode nodes' puts).
  const uint32_t hosts = one_store ? 1 : config.hosts;
  ReplayResult r;
  r.host_requests.assign(hosts, 0);
  std::vector<std::unique_ptr<TierModel>> stores;
  for (uint32_t h = 0; h < hosts; ++h) stores.push_back(std::make_unique<TierModel>(sc));
  std::optional<SharedTierModel> shared;
  if (config.layout == StoreLayout::kSharedTier && !one_store)
    shared.emplace(config, sc.chunk_bytes, RedisChunkBytes(sc.chunk_bytes, config.shared_layers));
  std::vector<double> queue(hosts, 0);
  double last_ms = trace.empty() ? 0 : trace.front().timestamp_ms;
  std::mt19937_64 rng(config.seed);
  std::vector<size_t> own(hosts);
  uint64_t next_generated_id = uint64_t{1} << 63;  // above any trace's ids
  // Chunks a request computed, written to its host's store and through to the shared tier: at
  // once, or (in_flight) once its host has prefilled it.
  struct Puts {
    double ready_ms = 0;
    uint64_t order = 0;  // arrival order, for equal times
    uint32_t host = 0;
    const TraceRequest* q = nullptr;
    size_t from = 0, to = 0;  // q->hash_ids[from, to)
    uint32_t decode_host = 0;
    bool operator>(const Puts& o) const {
      return ready_ms != o.ready_ms ? ready_ms > o.ready_ms : order > o.order;
    }
  };
  std::priority_queue<Puts, std::vector<Puts>, std::greater<Puts>> pending;
  auto put = [&](const Puts& p) {
    TierModel& store = *stores[p.host];
    const int64_t at_s = static_cast<int64_t>(std::floor(p.ready_ms / 1e3));
    for (size_t i = p.from; i < p.to; ++i) {
      const uint64_t id = p.q->hash_ids[i];
      const uint64_t parent = i > 0 ? p.q->hash_ids[i - 1] : 0;
      if (!store.Put(id, parent, i > 0, r)) break;
      if (shared) shared->Put(id, parent, i > 0, at_s, r);  // the store writes every put through
    }
    if (!config.decode_puts) return;
    // The decode node's puts at the request's end (DecodeEngine::PutGenerated).
    const TraceRequest& q = *p.q;
    const size_t full = p.to;
    const size_t total = (size_t{q.input_tokens} + q.output_tokens -
                          std::min<size_t>(1, size_t{q.input_tokens} + q.output_tokens)) /
                         sc.block_tokens;
    if (total <= full) return;
    ++r.decode_writers;
    TierModel& dec = *stores[p.decode_host];
    auto put_one = [&](uint64_t id, uint64_t parent, bool has_parent) {
      if (!dec.Put(id, parent, has_parent, r)) return false;
      if (shared) shared->Put(id, parent, has_parent, at_s, r);
      return true;
    };
    size_t i = full;
    if (full > 0 && dec.Where(q.hash_ids[full - 1]) == 0) {  // refused: from chunk 0
      for (i = 0; i < full; ++i) {
        const bool held = dec.Where(q.hash_ids[i]) != 0;
        if (!put_one(q.hash_ids[i], i > 0 ? q.hash_ids[i - 1] : 0, i > 0)) return;
        if (!held) ++r.decode_prompt_copies;
      }
    }
    uint64_t parent = full > 0 ? q.hash_ids[full - 1] : 0;
    for (; i < total; ++i) {
      const uint64_t id = next_generated_id++;
      if (!put_one(id, parent, i > 0)) return;
      ++r.decode_generated_chunks;
      parent = id;
    }
  };
  // One store (Replay's layout) stores a request's chunks on arrival, as Replay does.
  const bool in_flight = config.in_flight && config.prefill_tokens_per_s > 0 && !one_store;
  for (const TraceRequest& q : trace) {
    while (!pending.empty() && pending.top().ready_ms <= q.timestamp_ms) {
      put(pending.top());
      pending.pop();
    }
    ++r.requests;
    const size_t full = std::min<size_t>(q.hash_ids.size(), q.input_tokens / sc.block_tokens);
    r.chunks_requested += full;
    r.tokens_requested += q.input_tokens;
    // The queues drain between arrivals.
    if (config.prefill_tokens_per_s > 0) {
      const double drained =
          std::max(0.0, q.timestamp_ms - last_ms) / 1e3 * config.prefill_tokens_per_s;
      for (double& x : queue) x = std::max(0.0, x - drained);
    }
    last_ms = std::max(last_ms, q.timestamp_ms);
    const int64_t now_s = static_cast<int64_t>(std::floor(q.timestamp_ms / 1e3));
    // The router's pick: each host's leading overlap in its store, the shared tier's.
    size_t in_shared = 0;
    while (shared && in_shared < full && shared->Contains(q.hash_ids[in_shared])) ++in_shared;
    double best = 0;
    std::vector<uint32_t> ties;
    for (uint32_t h = 0; h < hosts; ++h) {
      own[h] = 0;
      while (own[h] < full && stores[h]->Where(q.hash_ids[own[h]]) != 0) ++own[h];
      const double credit = config.store_credit * static_cast<double>(std::max(own[h], in_shared));
      const double cost = std::max(0.0, (queue[h] + q.input_tokens) / sc.block_tokens - credit);
      if (ties.empty() || cost < best) {
        best = cost;
        ties = {h};
      } else if (cost == best) {
        ties.push_back(h);
      }
    }
    const uint32_t h = ties[rng() % ties.size()];
    ++r.host_requests[h];
    TierModel& store = *stores[h];
    size_t hits = 0;
    for (; hits < full; ++hits) {
      const uint64_t id = q.hash_ids[hits];
      const int where = store.Where(id);
      if (where != 0) {
        (where == 1 ? r.chunk_hits_ram : r.chunk_hits_disk)++;
        store.Hit(id, r);
        continue;
      }
      if (!shared || !shared->Contains(id)) break;
      ++r.chunk_hits_shared;
      shared->Hit(id, now_s, r);
      // Promoted into the host's store (not written back to the tier it came from).
      if (!store.Put(id, hits > 0 ? q.hash_ids[hits - 1] : 0, hits > 0, r)) {
        ++hits;
        break;
      }
    }
    r.tokens_saved += hits * sc.block_tokens;
    if (config.prefill_tokens_per_s > 0) {
      queue[h] += q.input_tokens - std::min<double>(q.input_tokens, hits * sc.block_tokens);
    }
    const Puts p{
        .ready_ms = in_flight ? q.timestamp_ms + 1e3 * queue[h] / config.prefill_tokens_per_s
                              : q.timestamp_ms,
        .order = r.requests,
        .host = h,
        .q = &q,
        .from = hits,
        .to = full,
        .decode_host = static_cast<uint32_t>(config.decode_puts && hosts > 1 ? rng() % hosts : 0)};
    if (in_flight) {
      pending.push(p);
    } else {
      put(p);
    }
  }
  for (; !pending.empty(); pending.pop()) put(pending.top());
  if (shared) shared->Finish(r);
  return r;
}

ReplayResult Replay(const std::vector<TraceRequest>& trace, const ReplayConfig& config) {
  ReplayResult r;
  TierModel m(config);
  for (const TraceRequest& q : trace) {
    ++r.requests;
    // Only whole chunks are shared; the prompt's last partial block never is.
    const size_t full = std::min<size_t>(q.hash_ids.size(), q.input_tokens / config.block_tokens);
    r.chunks_requested += full;
    r.tokens_requested += q.input_tokens;
    size_t hits = 0;
    for (; hits < full; ++hits) {
      const int where = m.Where(q.hash_ids[hits]);
      if (where == 0) break;
      (where == 1 ? r.chunk_hits_ram : r.chunk_hits_disk)++;
      m.Hit(q.hash_ids[hits], r);
    }
    r.tokens_saved += hits * config.block_tokens;
    for (size_t i = hits; i < full; ++i) {
      if (!m.Put(q.hash_ids[i], i > 0 ? q.hash_ids[i - 1] : 0, i > 0, r)) break;
    }
  }
  return r;
}

}  // namespace strata::kvstore
