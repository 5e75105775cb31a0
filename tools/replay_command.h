// `strata replay`: offload-capacity experiments — a Mooncake trace replayed against the store's
// tiers for a sweep of RAM sizes, with and without a disk tier, fp16 vs compressed blocks, LRU vs
// S3-FIFO, and where the stores are (one for the cluster, one per host, one per host with a shared
// tier behind them); a table on stdout and JSON for the chart (tools/replay_chart.py).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace strata::tools {

struct ReplayOptions {
  std::string trace_file;
  std::vector<std::string> codecs = {"fp16", "kivi:k2v2:g32"};
  uint32_t layers = 32, kv_heads = 8, head_dim = 128;  // an 8B-class model
  uint32_t block_tokens = 512;                         // Mooncake's hash block
  std::vector<uint64_t> ram_bytes;                     // the sweep
  uint64_t disk_bytes = 0;                             // the disk tier of the "with disk" runs
  std::vector<std::string> policies = {"lru", "s3fifo"};
  // The store's --durable_puts (its default with a disk): every chunk written to disk on arrival.
  bool durable_puts = true;
  // Where the stores are (kvstore/replay.h StoreLayout): each run repeated per layout.
  std::vector<std::string> layouts = {"central"};
  uint32_t hosts = 4;               // per-host and shared-tier layouts
  uint64_t shared_bytes = 0;        // the shared tier's memory
  // Its Redis masters, each one's memory before any key, keys sampled per eviction (0: exact
  // LRU): kvstore/replay.h ClusterReplayConfig.
  uint32_t shared_masters = 3;
  uint64_t shared_baseline_bytes = 3 << 20;
  uint32_t shared_lru_samples = 5;
  double prefill_tokens_per_s = 0;  // each host's, for the router's load term
  uint64_t seed = 1;                // the router's ties, broken at random
  bool in_flight = false;           // with it: chunks stored once prefilled (ClusterReplayConfig)
  bool decode_puts = true;          // decode nodes store their chunks (ClusterReplayConfig)
  std::string json_out;
};

absl::Status RunReplay(const ReplayOptions& o, std::ostream& out);

}  // namespace strata::tools
