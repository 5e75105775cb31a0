// Attention over compressed blocks: each sequence's new query tokens attend over
//   sinks (full precision) + compressed blocks + window (full precision),
// in that order, for a batch of sequences. With one query token this is decode; with several it
// is chunked prefill over a cached, compressed prefix: the new tokens' K and V are the last
// `query_tokens` tokens of the window, and new token i sees the window only up to itself
// (causal), everything before the window entirely. Grouped-query attention: query head j uses
// KV head j / (q_heads / kv_heads), and one pass over a KV head's bytes serves all its query
// heads (and all new tokens, up to 8 rows at a time). Sequences of a batch that begin with the
// same blocks (a cached prefix) have those blocks read once per KV head for all of their rows:
// each sequence's rows take the block in turn while it is in cache.
//
// Nothing is decompressed to memory: codes are dequantized a row at a time as they are read,
// per-channel key scales are folded into q, per-token value scales into the probabilities, the
// low-rank term enters as (q.B).A^T for scores and (sum_t p_t A_t).B^T for outputs, and sparse
// outliers are added per token. Each (sequence, KV head) is split along the sequence into parts
// of about `tokens_per_split` tokens (flash-decoding), computed in parallel with an online
// softmax, and merged by log-sum-exp.
//
// DecodeAttentionRef is the specification: every block decoded to fp32 (DecodeOperandsRef), then
// textbook softmax attention in double. DecodeAttention is the fused implementation (portable
// C++, and AVX2+FMA where the CPU has it) and is held to the reference by the tests.
//
// Errors: kInvalidArgument when shapes disagree (a block's heads or head dim differ from the
// params, q_heads not a multiple of kv_heads, a sequence with no tokens, null pointers).
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/block_operands.h"

namespace strata {
class ThreadPool;
}

namespace strata::kernels {

// Tokens kept at full precision (sinks or window).
struct FullPrecisionKv {
  const float* k = nullptr;  // [tokens, kv_heads, head_dim]
  const float* v = nullptr;  // [tokens, kv_heads, head_dim]
  uint32_t tokens = 0;
};

struct DecodeSequence {
  const float* q = nullptr;                       // [query_tokens, q_heads, head_dim]
  FullPrecisionKv sinks;                          // first tokens of the sequence
  absl::Span<const BlockOperands* const> blocks;  // then these, in sequence order
  FullPrecisionKv window;                         // then the newest tokens
  float* out = nullptr;                           // [query_tokens, q_heads, head_dim]
  uint32_t query_tokens = 1;  // > 1: chunked prefill; the window's last query_tokens tokens
};

struct DecodeAttentionParams {
  uint32_t q_heads = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  float scale = 0;  // softmax scale; 0 means 1/sqrt(head_dim)
};

enum class AttentionImpl { kAuto, kPortable, kAvx2 };

// Blocks read and attended, counted per KV head. A block that several sequences of the batch
// share (the same operands, or operands over the same bytes: a cached prefix adopted from one
// buffer) is read once for all of their query rows, so blocks_read < blocks_attended when the
// batch shares a prefix.
struct DecodeAttentionStats {
  uint64_t blocks_read = 0;      // passes over a (block, KV head)'s codes
  uint64_t blocks_attended = 0;  // (rows, block, KV head) attended, rows: a sequence's query
                                 // token (up to 8 rows of query heads x tokens at a time)
  // Passes over a block's TaDA head means (which every KV head's scores and outputs take): once
  // per task that attends the block. A task over a sequence's own blocks takes every KV head in
  // turn while the means are in cache (one pass per block); a shared prefix's tasks take one KV
  // head each.
  uint64_t head_means_read = 0;
  // Tasks run in parallel: (rows, flash-decoding part) pairs, or several rows' groups over a
  // shared prefix's part, or all KV heads' groups of a TaDA sequence's part.
  uint64_t tasks = 0;
};

struct DecodeAttentionOptions {
  AttentionImpl impl = AttentionImpl::kAuto;  // kAvx2 fails with kUnimplemented without AVX2
  // Flash-decoding part size (the largest), >= 1. When the batch would give fewer tasks than the
  // pool has threads (a short context on many threads), parts are made smaller, down to 256
  // tokens. Sequences with TaDA head means take every KV head in one task per part, and their
  // parts are made smaller (down to a block) to keep two tasks per thread.
  uint32_t tokens_per_split = 4096;
  ThreadPool* pool = nullptr;  // nullptr: ThreadPool::Default()
  // AVX2 kernels, affine codecs at 2, 3, 4 and 8 bits (KIVI's and KCVT's K and V, the backbone
  // of GEAR and ZipCache's) and int8: dot products over the packed codes in integers. At 2 and 4
  // bits q.k takes the query (key scales folded in) as two int8 terms per query head and token
  // group, so a score errs by at most s/512 * sum_d code_d with s = max_d |q_d * scale_d| / 127;
  // at 3 and 8 bits and int8, as one int16 term (s/2 * sum_d |code_d|, s = max_d |.| / 32767).
  // p.v takes the weights p * scale as int16 per query head and channel group (1/65534 of the
  // largest per token). false keeps fp32 throughout (exact to float rounding).
  bool integer_dot = true;
  // Read the blocks that sequences share (a cached prefix) once for all of them; false runs
  // every sequence apart (for measuring what sharing buys).
  bool share_prefixes = true;
  // When set, receives what the call read (on success).
  DecodeAttentionStats* stats = nullptr;
};

absl::Status DecodeAttentionRef(const DecodeAttentionParams& params,
                                absl::Span<const DecodeSequence> batch);

absl::Status DecodeAttention(const DecodeAttentionParams& params,
                             absl::Span<const DecodeSequence> batch,
                             const DecodeAttentionOptions& options = {});

// True when DecodeAttention's kAuto picks the AVX2 kernels on this CPU.
bool DecodeAttentionUsesAvx2();

// The kernels kAuto runs on this CPU, for benchmarks to record: "portable", or "avx2" and the
// integer dot product of the int8-query key scores ("avx2+vpmaddubsw", "avx2+avx-vnni",
// "avx2+avx512-vnni", or where selected on such a CPU "avx512-vnni-zmm": the 2- and 4-bit integer
// kernels in 512-bit registers). A cap on the CPU's features (CapCpuFeatures, IsaCap::kAvx2)
// makes it "avx2+vpmaddubsw".
const char* DecodeAttentionPath();

// The integer dot product the kernels use from now on, by DecodeAttentionPath's name of it
// ("avx2+vpmaddubsw", "avx2+avx-vnni", "avx2+avx512-vnni", "avx512-vnni-zmm"), or "auto" for the
// CPU's best: benchmarks compare the paths (codec_bench --integer_dot). False, changing nothing,
// for a name this CPU cannot run or that is none of these. Not while attention runs elsewhere.
bool SelectIntegerDot(std::string_view name);

}  // namespace strata::kernels
