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
  uint64_t tokens_requested = 0, tokens_saved = 0;  // prompt tokens; those not prefilled
  uint64_t bytes_read_ram = 0, bytes_read_disk = 0, bytes_written_disk = 0;
  uint64_t ram_evictions = 0, disk_evictions = 0, promotions = 0, orphans_dropped = 0;
  double chunk_hit_rate() const {
    return chunks_requested ? double(chunk_hits_ram + chunk_hits_disk) / chunks_requested : 0;
  }
  double token_hit_rate() const {
    return tokens_requested ? double(tokens_saved) / tokens_requested : 0;
  }
};

ReplayResult Replay(const std::vector<TraceRequest>& trace, const ReplayConfig& config);

}  // namespace strata::kvstore
