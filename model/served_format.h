// ServedFormat: the one description of what a cluster's blocks are, which every node that makes,
// moves or reads them must agree on: the codec (spec string), the chunk size, the calibration a
// codec may need, and how chunks are keyed (vLLM's prefix keys). The prefill and decode engines
// take one; the cluster file names one (membership::ClusterSpec's codec, chunk and calibration).
//
//   model::ServedFormat f{.codec = "kivi:k4v4:g32", .chunk_tokens = 64};
//   STRATA_RETURN_IF_ERROR(f.Validate());
//   auto cache = model->NewCache(f.CacheOptions());
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/prefix_key.h"
#include "kernels/calibration.h"
#include "model/kv_cache.h"

namespace strata::model {

struct ServedFormat {
  std::string codec = "fp16";   // KV codec spec (kernels::CodecSpec)
  uint32_t chunk_tokens = 256;  // tokens per block; a multiple of keys.block_tokens
  std::shared_ptr<const kernels::Calibration> calibration = nullptr;  // codecs that need one
  // Prefix keys (algorithm, hash block size, seed); chunk_tokens is the field above and the
  // cache salt comes with each request.
  PrefixKeyOptions keys = {};

  // kInvalidArgument: a codec spec that does not parse, or keys that do not fit chunk_tokens.
  absl::Status Validate() const;
  // A sequence cache of this format (no window of its own, as serving runs it).
  KvCacheOptions CacheOptions() const {
    return {.codec = codec, .chunk_tokens = chunk_tokens, .calibration = calibration};
  }
  // The prefix-key options of a request with `cache_salt`.
  PrefixKeyOptions KeysFor(std::string cache_salt) const {
    PrefixKeyOptions k = keys;
    k.chunk_tokens = chunk_tokens;
    k.cache_salt = std::move(cache_salt);
    return k;
  }
};

}  // namespace strata::model
