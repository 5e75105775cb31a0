// SharedTierProbe: how many leading chunks of a prompt the shared tier (kvstore/shared_tier.h)
// holds, asked of Redis when the router routes the prompt. The stores write every block through
// to the shared tier, which therefore also holds what other hosts' stores computed and what this
// host's store has evicted since; Redis evicts and expires on its own and says nothing of it, so
// the router asks rather than keeping a copy that would drift (a routed "hit" that is gone costs
// a recompute, never a wrong byte: the store verifies what it reads).
//
//   SharedTierProbe probe(std::move(tier), layer_names);
//   uint32_t n = probe.LeadingChunks(chain, /*known=*/0);
//
// One call asks, in one pipelined round trip, whether the blocks of chunks [known, known + max)
// are there, and answers `known` plus the run of present chunks after it. A chunk counts when
// the block of its LAST layer is there: a prefill node puts a chunk's layers in layer order, the
// store writes them through in that order, and a chunk's layers share one TTL and are renewed
// together, so its last layer present means the whole chunk was written and lives on. (A layer
// evicted on its own is met when the store promotes the chunk: a miss there, and the node
// computes from that chunk on.) Asking every layer would cost `layers` times the keys per chunk.
//
// A tier that does not answer (down, a failover, the deadline) adds only the chunks it answered
// before the error: routing goes on as if the tier held nothing more, and the error is counted.
//
// Thread-safe (SharedTier is).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "common/prefix_key.h"
#include "kvstore/shared_tier.h"

namespace strata::router {

// One call's figures (the caller counts them: ClusterBackend's metrics).
struct SharedTierProbeStats {
  uint64_t probes = 0;        // 1 when the call asked Redis
  uint64_t chunks_found = 0;  // chunks beyond `known` found
  uint64_t errors = 0;        // 1 when the tier did not answer in full
  double seconds = 0;         // the ask's duration
};

class SharedTierProbe {
 public:
  // `layer_names[l]`: this model's layer-l block name (its key is ignored), as the stores name
  // the blocks. At most `max_chunks` chunks are asked per call (>= 1).
  SharedTierProbe(std::unique_ptr<kvstore::SharedTier> tier, std::vector<BlockName> layer_names,
                  uint32_t max_chunks = 64);

  // `known` (<= chain.size()) plus the number of consecutive chunks from chain[known] on that
  // the tier holds. Asks nothing (and answers `known`) when known == chain.size(). `call`, when
  // given, receives this call's own figures (probes 0 or 1, errors 0 or 1).
  uint32_t LeadingChunks(absl::Span<const BlockHash> chain, uint32_t known,
                         SharedTierProbeStats* call = nullptr);

 private:
  const std::unique_ptr<kvstore::SharedTier> tier_;
  const std::vector<BlockName> layer_names_;
  const uint32_t max_chunks_;
};

}  // namespace strata::router
