// The shared tier under memory pressure (issue "Beyond one store machine"): a Mooncake trace
// (../shared/data/traces/, prefix blocks named by hash ids) replayed against a Redis Cluster this
// program starts on loopback (3 masters, Debian's redis-server), each master capped at
// --maxmemory with an LRU policy, through kvstore::SharedTier as the stores use it: per request,
// one pipelined Get of the chain's blocks (a hit renews its TTL and its LRU clock), the leading
// hits counted, then the blocks from the first miss on Put (parents first, as prefill writes).
//
// Redis evicts by its own (sampled) LRU and knows nothing of prefixes; a block whose parent was
// evicted is an orphan: it can never be found again (a chunk is only useful after its whole
// prefix) yet holds memory. Reported per run: chunk and token hit rates, the blocks Redis
// evicted, and at the end how many of the blocks still present are orphans. Two orders in which
// Redis renews a chain's blocks are compared on the same trace, each on a fresh cluster: root
// first (the chain's order, as a store's promotion asks: the product's) and root last (the chain
// reversed, so that its root is its most recently used block). Redis's LRU is sampled (5 keys)
// and its clock ticks once a second, so the orders differ little and runs vary widely: run it
// several times before reading a difference into one. Each hash id (512 trace tokens) is one block
// of --block_tokens tokens: the bytes are scaled down so that the cluster's maxmemory is the
// pressure, not this machine's RAM; hit rates in tokens count 512 per hash id, as the trace does.
//
//   shared_tier_trace_bench --trace FILE [--requests N] [--maxmemory 16mb] [--block_tokens 16]
//                           [--out DIR] [--commit C]
// Prints a table; with --out writes DIR/shared_tier_trace_bench-DATE-COMMIT.{txt,json}.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "common/block_reader.h"
#include "kernels/codec.h"
#include "kvstore/replay.h"
#include "kvstore/shared_tier.h"
#include "kvstore/testing/redis_cluster_process.h"

namespace {

using strata::AlignedBuffer;
using strata::BlockName;
using strata::SharedBytes;
using strata::kvstore::SharedTier;
using strata::kvstore::TraceRequest;

constexpr uint64_t kTraceBlockTokens = 512;  // tokens per hash id in Mooncake traces

constexpr char kUsage[] =
    "usage: shared_tier_trace_bench --trace FILE [--requests N] [--maxmemory 16mb]\n"
    "                               [--block_tokens 16] [--out DIR] [--commit C]\n";

// A real fp16 block of `tokens` tokens, 8 KV heads of 128 (4 KiB per token), at `chunk`.
AlignedBuffer Block(uint32_t tokens, uint32_t chunk) {
  std::vector<float> k(size_t{tokens} * 8 * 128), v(k.size());
  std::mt19937 rng(chunk + 1);
  std::normal_distribution<float> n(0, 1);
  for (float& x : k) x = n(rng);
  for (float& x : v) x = n(rng);
  auto codec = *strata::kernels::Codec::Create("fp16");
  return *codec->Encode({k.data(), v.data(), strata::SourceDType::kFloat32, tokens, 8, 128},
                        {.layer = 0, .chunk_index = chunk, .model_fingerprint = 7});
}

struct RunResult {
  uint64_t requests = 0, chunks = 0, chunk_hits = 0, tokens = 0, tokens_hit = 0;
  uint64_t present = 0, orphans = 0, evicted = 0, get_errors = 0, put_errors = 0;
  double seconds = 0;
};

// Sum of one INFO field over the masters.
uint64_t InfoSum(strata::kvstore::testing::RedisClusterProcess& cluster, const std::string& field) {
  uint64_t sum = 0;
  for (const auto& n : cluster.nodes()) {
    if (n.pid <= 0) continue;
    const std::string info = cluster.Cli(n.port, {"INFO", "stats"});
    const size_t at = info.find(field + ":");
    if (at == std::string::npos) continue;
    uint64_t v = 0;
    const size_t end = info.find_first_of("\r\n", at);
    if (absl::SimpleAtoi(info.substr(at + field.size() + 1, end - at - field.size() - 1), &v)) {
      sum += v;
    }
  }
  return sum;
}

RunResult Run(const std::vector<TraceRequest>& trace, const std::vector<AlignedBuffer>& blocks,
              uint64_t codec_fingerprint, uint8_t tag, bool root_last,
              strata::kvstore::testing::RedisClusterProcess& cluster, SharedTier& tier) {
  auto name_of = [&](uint64_t hash_id) {
    BlockName n;
    n.model_fingerprint = 7;
    n.codec_fingerprint = codec_fingerprint;
    std::memcpy(n.key.data(), &hash_id, sizeof(hash_id));
    n.key[31] = tag;  // each run its own keys
    return n;
  };
  // Every block put, with its parent (the hash id before it in the chain that first put it).
  absl::flat_hash_map<uint64_t, std::pair<uint64_t, uint32_t>> parent;  // id -> (parent, chunk)
  const uint64_t evicted_before = InfoSum(cluster, "evicted_keys");
  RunResult r;
  const absl::Time start = absl::Now();
  for (const TraceRequest& q : trace) {
    const size_t n = std::min(q.hash_ids.size(), blocks.size());
    if (n == 0) continue;
    ++r.requests;
    std::vector<SharedTier::Key> keys;
    for (size_t c = 0; c < n; ++c) keys.push_back({name_of(q.hash_ids[c]), uint32_t(c)});
    std::vector<size_t> order(n);
    for (size_t c = 0; c < n; ++c) order[c] = root_last ? n - 1 - c : c;
    std::vector<SharedTier::Key> asked;
    for (size_t c : order) asked.push_back(keys[c]);
    const std::vector<absl::StatusOr<SharedBytes>> got = tier.Get(asked);
    std::vector<bool> hit(n, false);
    for (size_t i = 0; i < n; ++i) {
      if (got[i].ok()) {
        hit[order[i]] = true;
      } else if (got[i].status().code() != absl::StatusCode::kNotFound) {
        ++r.get_errors;
      }
    }
    size_t lead = 0;
    while (lead < n && hit[lead]) ++lead;
    r.chunks += n;
    r.chunk_hits += lead;
    r.tokens += q.input_tokens;
    r.tokens_hit += std::min<uint64_t>(q.input_tokens, uint64_t{lead} * kTraceBlockTokens);
    std::vector<SharedTier::Item> put;
    for (size_t c = lead; c < n; ++c) {
      put.push_back({keys[c].name, uint32_t(c), SharedBytes(blocks[c].span(), nullptr), true});
      parent.try_emplace(q.hash_ids[c], c > 0 ? q.hash_ids[c - 1] : q.hash_ids[c], uint32_t(c));
    }
    for (const absl::Status& s : tier.Put(put)) r.put_errors += !s.ok();
  }
  r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  r.evicted = InfoSum(cluster, "evicted_keys") - evicted_before;
  // What is left: present blocks, and those whose parent is gone.
  std::vector<uint64_t> ids;
  std::vector<SharedTier::Key> keys;
  for (const auto& [id, pc] : parent) {
    ids.push_back(id);
    keys.push_back({name_of(id), pc.second});
  }
  std::vector<absl::StatusOr<bool>> present;
  for (size_t i = 0; i < keys.size(); i += 4096) {
    const size_t end = std::min(keys.size(), i + 4096);
    std::vector<absl::StatusOr<bool>> part =
        tier.Contains(absl::MakeConstSpan(keys).subspan(i, end - i));
    present.insert(present.end(), part.begin(), part.end());
  }
  absl::flat_hash_map<uint64_t, bool> here;
  for (size_t i = 0; i < ids.size(); ++i) here[ids[i]] = present[i].ok() && *present[i];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!here[ids[i]]) continue;
    ++r.present;
    const auto& [p, chunk] = parent[ids[i]];
    if (chunk > 0 && !here[p]) ++r.orphans;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  auto flags = strata::bench::FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  std::string trace_path, out_dir, commit = "unknown", maxmemory = "16mb";
  int requests = 4000, block_tokens = 16;
  for (const auto& [k, v] : *flags) {
    if (k == "--trace") {
      trace_path = v;
    } else if (k == "--requests") {
      requests = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--maxmemory") {
      maxmemory = v;
    } else if (k == "--block_tokens") {
      block_tokens = std::clamp(std::atoi(v.c_str()), 1, 1024);
    } else if (k == "--out") {
      out_dir = v;
    } else if (k == "--commit") {
      commit = v;
    } else {
      std::fprintf(stderr, "shared_tier_trace_bench: unknown flag %s\n%s", k.c_str(), kUsage);
      return 2;
    }
  }
  if (trace_path.empty()) {
    std::fprintf(stderr, "shared_tier_trace_bench: --trace is required\n%s", kUsage);
    return 2;
  }
  absl::StatusOr<std::vector<TraceRequest>> trace = strata::kvstore::LoadMooncakeTrace(trace_path);
  if (!trace.ok()) {
    std::fprintf(stderr, "shared_tier_trace_bench: %s\n", trace.status().ToString().c_str());
    return 1;
  }
  if (trace->size() > size_t(requests)) trace->resize(requests);
  if (!strata::kvstore::testing::RedisClusterProcess::Installed()) {
    std::fprintf(stderr,
                 "shared_tier_trace_bench: no redis-server (scripts/setup.sh installs it)\n");
    return 1;
  }
  size_t longest = 0;
  for (const TraceRequest& q : *trace) longest = std::max(longest, q.hash_ids.size());
  longest = std::min<size_t>(longest, 256);
  std::vector<AlignedBuffer> blocks;
  for (uint32_t c = 0; c < longest; ++c) blocks.push_back(Block(block_tokens, c));
  const uint64_t codec_fp = strata::BlockView::Parse(blocks[0].span())->header().codec_fingerprint;

  const strata::bench::RunInfo info = strata::bench::CollectRunInfo(commit);
  std::ostringstream txt;
  txt << "shared_tier_trace_bench: " << info.machine << ", " << info.date << ", commit "
      << info.commit << "\ntrace " << trace_path << " (first " << trace->size()
      << " requests), blocks of " << block_tokens << " tokens (" << blocks[0].size() / 1024
      << " KiB, one per hash id); Redis Cluster of 3 masters on loopback, maxmemory " << maxmemory
      << " each, allkeys-lru; a fresh cluster per row\n\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%-12s %9s %9s %9s %9s %9s %9s %8s\n", "renewed", "chunk hit",
                "token hit", "evicted", "present", "orphans", "orphan %", "seconds");
  txt << line;
  std::vector<std::string> rows;
  uint8_t tag = 1;
  for (bool root_last : {false, true}) {
    strata::kvstore::testing::RedisClusterProcess cluster(3, 0);
    std::string why;
    if (!cluster.Start(&why)) {
      std::fprintf(stderr, "shared_tier_trace_bench: %s\n", why.c_str());
      return 1;
    }
    for (const auto& n : cluster.nodes()) {
      cluster.Cli(n.port, {"CONFIG", "SET", "maxmemory", maxmemory});
      cluster.Cli(n.port, {"CONFIG", "SET", "maxmemory-policy", "allkeys-lru"});
    }
    absl::StatusOr<std::unique_ptr<SharedTier>> tier =
        SharedTier::Connect({.redis = {.seeds = {cluster.seed()}}});
    if (!tier.ok()) {
      std::fprintf(stderr, "shared_tier_trace_bench: %s\n", tier.status().ToString().c_str());
      return 1;
    }
    const RunResult r = Run(*trace, blocks, codec_fp, tag++, root_last, cluster, **tier);
    const double chunk_hit = r.chunks ? double(r.chunk_hits) / r.chunks : 0;
    const double token_hit = r.tokens ? double(r.tokens_hit) / r.tokens : 0;
    const double orphan_share = r.present ? double(r.orphans) / r.present : 0;
    const char* order = root_last ? "root last" : "root first";
    std::snprintf(line, sizeof(line), "%-12s %8.1f%% %8.1f%% %9llu %9llu %9llu %8.1f%% %8.1f\n",
                  order, 100 * chunk_hit, 100 * token_hit,
                  static_cast<unsigned long long>(r.evicted),
                  static_cast<unsigned long long>(r.present),
                  static_cast<unsigned long long>(r.orphans), 100 * orphan_share, r.seconds);
    txt << line;
    if (r.get_errors + r.put_errors > 0) {
      txt << "  (" << r.get_errors << " get errors, " << r.put_errors << " put errors)\n";
    }
    rows.push_back(strata::bench::Json()
                       .Str("renewed", order)
                       .Num("requests", static_cast<double>(r.requests))
                       .Num("chunk_hit_rate", chunk_hit)
                       .Num("token_hit_rate", token_hit)
                       .Num("evicted", static_cast<double>(r.evicted))
                       .Num("present", static_cast<double>(r.present))
                       .Num("orphans", static_cast<double>(r.orphans))
                       .Num("get_errors", static_cast<double>(r.get_errors))
                       .Num("put_errors", static_cast<double>(r.put_errors))
                       .Num("seconds", r.seconds)
                       .Done());
  }
  std::fputs(txt.str().c_str(), stdout);
  if (!out_dir.empty()) {
    const std::string path = strata::bench::ResultPath(out_dir, "shared_tier_trace_bench", info);
    strata::bench::WriteResultFile(path + ".txt", txt.str());
    strata::bench::WriteResultFile(path + ".json",
                                   strata::bench::ResultJson("shared_tier_trace_bench", info)
                                       .Str("trace", trace_path)
                                       .Str("maxmemory", maxmemory)
                                       .Num("block_tokens", block_tokens)
                                       .Raw("rows", strata::bench::JsonArray(rows))
                                       .Done());
  }
  return 0;
}
