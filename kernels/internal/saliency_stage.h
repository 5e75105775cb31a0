// Internal to kernels/: the precision policy stage, which splits a chunk's tokens into the parts
// of a spec with parts (CodecSpec::PartSpecs): attention sinks (`:sinkN`, any codec) and
// ZipCache's salient tokens, kept at higher precision. codec.cc encodes each part apart and
// writes the token map into the block.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/codec.h"
#include "kernels/codec_spec.h"

namespace strata::kernels::internal {

// The part of each token of chunk `c` (indices into s.PartSpecs()): the first s.sink_tokens
// tokens of chunk 0 are sinks; then, for ZipCache, the s.SalientTokens() most salient of the rest
// (ties to the earlier token). Saliency is the normalized attention score of each token under
// probe queries (the p % most recent tokens' queries plus p % drawn at random from the rest,
// deterministic per layer and chunk); without queries (c.q null), how far each token lies from
// the chunk's per-channel means of K and V, in channel standard deviations. The rest go to the
// main part. Precondition: c.q_heads is a multiple of c.kv_heads when c.q is set.
std::vector<uint8_t> AssignParts(const CodecSpec& s, const KvChunkView& c, const BlockContext& ctx);

}  // namespace strata::kernels::internal
