#include "kernels/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/fp8.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kernels/bit_pack.h"
#include "kernels/internal/attention_segment.h"

namespace strata::kernels {
namespace {

using internal::HeadGroupState;
using internal::Segment;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

namespace internal {

absl::Status ValidateAttention(const DecodeAttentionParams& p,
                               absl::Span<const DecodeSequence> batch) {
  if (p.q_heads == 0 || p.kv_heads == 0 || p.head_dim == 0 || p.q_heads % p.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: q_heads ", p.q_heads, " must be a positive multiple of kv_heads ",
                     p.kv_heads, ", head_dim ", p.head_dim, " positive"));
  }
  for (size_t s = 0; s < batch.size(); ++s) {
    const DecodeSequence& seq = batch[s];
    if (seq.q == nullptr || seq.out == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("attention: sequence ", s, " has no q/out"));
    }
    if (seq.query_tokens < 1 || (seq.query_tokens > 1 && seq.query_tokens > seq.window.tokens)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention: sequence ", s, " has ", seq.query_tokens, " query tokens but a window of ",
          seq.window.tokens, " (the new tokens' K and V end the window)"));
    }
    uint64_t tokens = seq.sinks.tokens + seq.window.tokens;
    for (const FullPrecisionKv* fp : {&seq.sinks, &seq.window}) {
      if (fp->tokens > 0 && (fp->k == nullptr || fp->v == nullptr)) {
        return absl::InvalidArgumentError(
            absl::StrCat("attention: sequence ", s, " has sink/window tokens without K/V"));
      }
    }
    for (size_t b = 0; b < seq.blocks.size(); ++b) {
      const BlockOperands* ops = seq.blocks[b];
      if (ops == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("attention: sequence ", s, " block ", b, " is null"));
      }
      if (ops->kv_heads != p.kv_heads || ops->head_dim != p.head_dim) {
        return absl::InvalidArgumentError(absl::StrCat(
            "attention: sequence ", s, " block ", b, " has ", ops->kv_heads, " KV heads x ",
            ops->head_dim, " dims, the attention ", p.kv_heads, " x ", p.head_dim));
      }
      tokens += ops->tokens;
    }
    if (tokens == 0) {
      return absl::InvalidArgumentError(absl::StrCat("attention: sequence ", s, " has no tokens"));
    }
  }
  return absl::OkStatus();
}

float SoftmaxScale(const DecodeAttentionParams& p) {
  return p.scale != 0 ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
}

}  // namespace internal

namespace {

using internal::SoftmaxScale;
using internal::ValidateAttention;

// KV head `head` of a compressed block.
Segment BlockSegment(const BlockOperands* block, uint32_t head) {
  Segment s;
  s.block = block;
  s.head = head;
  s.tokens = block->tokens;
  return s;
}

// Segments of one sequence for one KV head, in order, leaving out its first `skip_blocks`
// blocks (a shared prefix, computed apart).
std::vector<Segment> Segments(const DecodeAttentionParams& p, const DecodeSequence& seq,
                              uint32_t head, size_t skip_blocks = 0) {
  std::vector<Segment> out;
  const uint32_t stride = p.kv_heads * p.head_dim;
  auto full = [&](const FullPrecisionKv& fp) {
    if (fp.tokens == 0) return;
    Segment s;
    s.k = fp.k + size_t{head} * p.head_dim;
    s.v = fp.v + size_t{head} * p.head_dim;
    s.stride = stride;
    s.tokens = fp.tokens;
    out.push_back(s);
  };
  full(seq.sinks);
  for (size_t i = skip_blocks; i < seq.blocks.size(); ++i) {
    out.push_back(BlockSegment(seq.blocks[i], head));
  }
  full(seq.window);
  return out;
}

// The same block in two sequences: the same object, or operands over the same bytes (each
// sequence's cache parses the blocks it holds, so a prefix adopted from one buffer gives equal
// code pointers behind different objects).
bool SameBlock(const BlockOperands* a, const BlockOperands* b) {
  return a == b || (a->tokens == b->tokens && a->k.codes != nullptr && a->k.codes == b->k.codes &&
                    a->v.codes == b->v.codes && a->k.kind == b->k.kind && a->v.kind == b->v.kind);
}

// Sequences of the batch that begin with the same blocks (a cached prefix), each cluster of two
// or more with the number of leading blocks all of its sequences share.
struct SharedPrefix {
  std::vector<size_t> seqs;
  size_t blocks = 0;
};

std::vector<SharedPrefix> SharedPrefixes(absl::Span<const DecodeSequence> batch) {
  std::vector<SharedPrefix> out;
  std::vector<bool> taken(batch.size(), false);
  for (size_t s = 0; s < batch.size(); ++s) {
    if (taken[s] || batch[s].blocks.empty()) continue;
    SharedPrefix c;
    c.seqs.push_back(s);
    c.blocks = batch[s].blocks.size();
    for (size_t o = s + 1; o < batch.size(); ++o) {
      if (taken[o] || batch[o].blocks.empty() ||
          !SameBlock(batch[s].blocks[0], batch[o].blocks[0])) {
        continue;
      }
      size_t n = 1;
      const size_t limit = std::min(c.blocks, batch[o].blocks.size());
      while (n < limit && SameBlock(batch[s].blocks[n], batch[o].blocks[n])) ++n;
      c.blocks = n;
      c.seqs.push_back(o);
    }
    if (c.seqs.size() < 2) continue;
    for (size_t t : c.seqs) taken[t] = true;
    out.push_back(std::move(c));
  }
  return out;
}

// Runs segments [begin, end) through the online softmax. The window segment is the last one;
// rows whose query token is among the window's last tokens see only the window up to it.
void RunSegments(const std::vector<Segment>& segs, size_t begin, size_t end, bool last_is_window,
                 const std::vector<uint32_t>& window_limit, HeadGroupState& st,
                 const internal::Kernels& kernels) {
  for (size_t i = begin; i < end; ++i) {
    const Segment& seg = segs[i];
    st.scores.resize(size_t{st.g} * seg.tokens);
    // Per-channel transforms of a block (multipliers, channel order): K's fold into q, V's
    // apply to the block's share of the output, accumulated apart (after the softmax step has
    // rescaled acc). Stored channel c of head h is original channel perm[c], times norm[c].
    const TensorOperands* kt = seg.block != nullptr ? &seg.block->k : nullptr;
    const TensorOperands* vt = seg.block != nullptr ? &seg.block->v : nullptr;
    const bool k_tf = kt != nullptr && (kt->channel_norm != nullptr || kt->channel_perm != nullptr);
    const bool v_tf = vt != nullptr && (vt->channel_norm != nullptr || vt->channel_perm != nullptr);
    const size_t hd = size_t{seg.head} * st.d;
    thread_local std::vector<float> saved;
    if (k_tf) {
      saved = st.q;
      for (uint32_t r = 0; r < st.g; ++r) {
        const float* src = &saved[size_t{r} * st.d];
        float* dst = &st.q[size_t{r} * st.d];
        for (uint32_t c = 0; c < st.d; ++c) {
          const float q = src[kt->channel_perm != nullptr ? kt->channel_perm[hd + c] : c];
          dst[c] = kt->channel_norm != nullptr ? q * HalfBitsToFloat(kt->channel_norm[hd + c]) : q;
        }
      }
    }
    if (k_tf) st.k_lut_book = nullptr;  // a table made from these rows is for this block only
    kernels.scores(seg, st);
    if (k_tf) {
      st.q.swap(saved);
      st.k_lut_book = nullptr;
    }
    // TaDA: the head means, an fp16 one-head block over the same tokens, add their scores.
    Segment mean_seg;
    if (seg.block != nullptr && seg.block->mean_ops != nullptr) {
      mean_seg.block = seg.block->mean_ops.get();
      mean_seg.head = 0;
      mean_seg.tokens = seg.tokens;
      saved = st.scores;
      kernels.scores(mean_seg, st);
      for (size_t e = 0; e < saved.size(); ++e) st.scores[e] += saved[e];
    }
    if (last_is_window && i + 1 == segs.size()) {
      for (uint32_t r = 0; r < st.g; ++r) {
        float* s = &st.scores[size_t{r} * seg.tokens];
        for (uint32_t t = window_limit[r]; t < seg.tokens; ++t) s[t] = kNegInf;
      }
    }
    // The values' codebook mass waiting to join acc is rescaled as acc is (the softmax step
    // rescales acc by exp(m_old - m_new) per row).
    thread_local std::vector<float> m_old;
    if (st.v_mass_book != nullptr) m_old = st.m;
    kernels.softmax(seg.tokens, st);
    if (st.v_mass_book != nullptr) {
      thread_local std::vector<float> alpha;
      alpha.assign(st.g, 1.0f);
      bool changed = false;
      for (uint32_t r = 0; r < st.g; ++r) {
        if (st.m[r] == m_old[r]) continue;
        alpha[r] = m_old[r] == kNegInf ? 0.0f : std::exp(m_old[r] - st.m[r]);
        changed = true;
      }
      if (changed) RescaleCodebookMass(st, alpha.data());
    }
    if (mean_seg.block != nullptr) kernels.accumulate(mean_seg, st);
    if (!v_tf) {
      kernels.accumulate(seg, st);
      continue;
    }
    FlushCodebookMass(st);  // what earlier blocks left belongs to acc as it is
    saved.assign(st.acc.size(), 0.0f);
    st.acc.swap(saved);
    kernels.accumulate(seg, st);
    FlushCodebookMass(st);  // this block's, into its share, before its channels are mapped back
    for (uint32_t r = 0; r < st.g; ++r) {
      const float* part = &st.acc[size_t{r} * st.d];
      float* acc = &saved[size_t{r} * st.d];
      for (uint32_t c = 0; c < st.d; ++c) {
        const float x = vt->channel_norm != nullptr
                            ? part[c] * HalfBitsToFloat(vt->channel_norm[hd + c])
                            : part[c];
        acc[vt->channel_perm != nullptr ? vt->channel_perm[hd + c] : c] += x;
      }
    }
    st.acc.swap(saved);
  }
}

// The rows of one KV head that share an output: query tokens [token0, token0 + tokens) of a
// sequence times the G query heads of the KV head.
struct Group {
  size_t seq;
  uint32_t head;
  uint32_t token0, tokens;
};

// One group's rows through segments [begin, end) of its KV head's `segs`, written to a partial
// result.
struct Unit {
  size_t group;
  const std::vector<Segment>* segs;
  size_t part = 0;
};

// Segments [begin, end) for several units, every unit in turn per segment: a block read for the
// first unit is still in the caches for the others. The units share the segments (groups of one
// KV head over a shared prefix), or their segments are the same blocks' other KV heads (a
// sequence with TaDA's head means, which every KV head's pass reads: one task takes all heads so
// the means come from memory once). Stacking two groups' rows into one state (8 rows where G is 4)
// measured slower: the 8-row kernels keep more accumulators than AVX2 has registers.
struct Task {
  size_t begin, end;
  bool last_is_window;
  std::vector<Unit> units;
};

// True when some of `blocks` carry TaDA head means (which every KV head's pass reads).
bool HasHeadMeans(absl::Span<const BlockOperands* const> blocks) {
  for (const BlockOperands* b : blocks) {
    if (b->mean_ops != nullptr) return true;
  }
  return false;
}

// The work of one call, planned before any of it runs: the groups of rows, the tasks that run
// them (segments [begin, end) for some groups' units, each unit written to a part) and the
// segments the units point into. Move-only: units point into shared_segs' and segs' elements,
// which a move keeps where they are and a copy would not.
struct Plan {
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  Plan(Plan&&) = default;
  Plan& operator=(Plan&&) = default;

  ThreadPool* pool = nullptr;  // runs the tasks; its size sets how finely they are split
  // The rows of one KV head are (query token, query head of the group) pairs. They are run in
  // batches of whole tokens, up to 8 rows, so the kernels' GQA specializations apply.
  uint32_t tokens_per_batch = 1;
  size_t rows_max = 0;  // tokens_per_batch * G: the rows of a part
  std::vector<Group> groups;
  std::vector<size_t> first_group;  // [sequences * kv_heads + 1]: per (seq, head), then the end
  std::vector<std::vector<size_t>> group_parts;  // per group, the parts to merge
  size_t parts = 0;
  std::vector<Task> tasks;
  std::vector<std::vector<Segment>> shared_segs;  // per (shared prefix, KV head)
  std::vector<std::vector<Segment>> segs;         // per (sequence, KV head): its own segments
};

uint64_t TokensOf(const std::vector<Segment>& segs) {
  uint64_t n = 0;
  for (const Segment& sg : segs) n += sg.tokens;
  return n;
}

// Tasks for `units`, whose segments have the boundaries of `segs`, in parts of about
// `per_split` tokens (flash-decoding).
void AddTasks(const std::vector<Segment>& segs, bool last_is_window, const std::vector<Unit>& units,
              uint64_t per_split, Plan& plan) {
  size_t begin = 0;
  uint64_t acc_tokens = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    acc_tokens += segs[i].tokens;
    if (acc_tokens >= per_split || i + 1 == segs.size()) {
      Task t{begin, i + 1, last_is_window, units};
      for (Unit& u : t.units) {
        u.part = plan.parts++;
        plan.group_parts[u.group].push_back(u.part);
      }
      plan.tasks.push_back(std::move(t));
      begin = i + 1;
      acc_tokens = 0;
    }
  }
}

// The groups of rows of every (sequence, KV head), in order.
void PlanGroups(const DecodeAttentionParams& p, absl::Span<const DecodeSequence> batch,
                Plan& plan) {
  plan.first_group.resize(batch.size() * p.kv_heads + 1);
  for (size_t s = 0; s < batch.size(); ++s) {
    for (uint32_t h = 0; h < p.kv_heads; ++h) {
      plan.first_group[s * p.kv_heads + h] = plan.groups.size();
      for (uint32_t t0 = 0; t0 < batch[s].query_tokens; t0 += plan.tokens_per_batch) {
        plan.groups.push_back(
            {s, h, t0, std::min(plan.tokens_per_batch, batch[s].query_tokens - t0)});
      }
    }
  }
  plan.first_group.back() = plan.groups.size();
  plan.group_parts.resize(plan.groups.size());
}

// A prefix of blocks that several sequences share is read once per KV head for all of their
// rows: a task takes each block in turn for all of their groups. (Taking every KV head in one
// task, as sequences with TaDA's head means do in PlanOwnSegments, measured slower here: a batch
// has enough rows per head to keep the means in cache, and fewer, larger tasks balance worse.)
// Returns per sequence the blocks of its shared prefix, which its own segments leave out.
std::vector<size_t> PlanSharedPrefixes(const DecodeAttentionParams& p,
                                       absl::Span<const DecodeSequence> batch,
                                       const DecodeAttentionOptions& o, size_t want, Plan& plan) {
  const std::vector<SharedPrefix> shared =
      o.share_prefixes ? SharedPrefixes(batch) : std::vector<SharedPrefix>{};
  std::vector<size_t> skip(batch.size(), 0);
  plan.shared_segs.resize(shared.size() * p.kv_heads);
  for (const SharedPrefix& c : shared) {
    for (size_t s : c.seqs) skip[s] = c.blocks;
  }
  for (size_t ci = 0; ci < shared.size(); ++ci) {
    const SharedPrefix& c = shared[ci];
    const DecodeSequence& first = batch[c.seqs[0]];
    for (uint32_t h = 0; h < p.kv_heads; ++h) {
      std::vector<Segment>& segs = plan.shared_segs[ci * p.kv_heads + h];
      for (size_t b = 0; b < c.blocks; ++b) segs.push_back(BlockSegment(first.blocks[b], h));
      std::vector<Unit> units;
      for (size_t s : c.seqs) {
        const size_t sh = s * p.kv_heads + h;
        for (size_t g = plan.first_group[sh]; g < plan.first_group[sh + 1]; ++g) {
          units.push_back({g, &segs});
        }
      }
      const size_t splits =
          std::max<uint64_t>(1, (TokensOf(segs) + o.tokens_per_split - 1) / o.tokens_per_split);
      // Units are dealt to several tasks when there would be fewer than two tasks per thread
      // over all prefixes and heads.
      const size_t have = splits * p.kv_heads * shared.size();
      const size_t chunks = std::min(units.size(), std::max<size_t>(1, (want + have - 1) / have));
      const size_t per = (units.size() + chunks - 1) / chunks;
      for (size_t u0 = 0; u0 < units.size(); u0 += per) {
        AddTasks(
            segs, false,
            std::vector<Unit>(units.begin() + u0, units.begin() + std::min(units.size(), u0 + per)),
            o.tokens_per_split, plan);
      }
    }
  }
  return skip;
}

// Every sequence's own segments: sinks, the blocks after a shared prefix (`skip` of them), the
// window. With TaDA's head means, one task takes every KV head's groups over a part, so each
// part's means come from memory once (then from L2 for the other heads), not once per KV head;
// the parts are made smaller (down to a block) so that there are still two tasks per thread.
void PlanOwnSegments(const DecodeAttentionParams& p, absl::Span<const DecodeSequence> batch,
                     const DecodeAttentionOptions& o, const std::vector<size_t>& skip, size_t want,
                     Plan& plan) {
  plan.segs.resize(batch.size() * p.kv_heads);
  std::vector<bool> all_heads(batch.size());
  uint64_t own_tokens = 0;  // over every group that takes one KV head per task
  for (size_t s = 0; s < batch.size(); ++s) {
    all_heads[s] = p.kv_heads > 1 && HasHeadMeans(batch[s].blocks.subspan(skip[s]));
    for (uint32_t h = 0; h < p.kv_heads; ++h) {
      const size_t sh = s * p.kv_heads + h;
      plan.segs[sh] = Segments(p, batch[s], h, skip[s]);
      if (!all_heads[s])
        own_tokens += TokensOf(plan.segs[sh]) * (plan.first_group[sh + 1] - plan.first_group[sh]);
    }
  }
  // Short contexts on many threads: parts of tokens_per_split would leave threads idle (2k tokens
  // and 8 KV heads are 8 tasks), so parts shrink until there is a task per thread, down to
  // kMinSplit tokens. (On 16 threads, 2k tokens in 1024-token parts took 0.14-0.17 ms for fp16
  // against 0.25-0.28 in 4096-token ones; at 32k, parts below 4096 were slower: per-task work.)
  constexpr uint64_t kMinSplit = 256;
  const uint64_t threads = static_cast<uint64_t>(plan.pool->size());
  const uint64_t per_split = std::min<uint64_t>(
      o.tokens_per_split, std::max<uint64_t>(kMinSplit, (own_tokens + threads - 1) / threads));
  for (size_t s = 0; s < batch.size(); ++s) {
    const bool window = batch[s].window.tokens > 0;
    std::vector<Unit> units;
    for (uint32_t h = 0; h < p.kv_heads; ++h) {
      const size_t sh = s * p.kv_heads + h;
      for (size_t g = plan.first_group[sh]; g < plan.first_group[sh + 1]; ++g) {
        if (all_heads[s]) {
          units.push_back({g, &plan.segs[sh]});
        } else {
          AddTasks(plan.segs[sh], window, {Unit{g, &plan.segs[sh]}}, per_split, plan);
        }
      }
    }
    if (all_heads[s]) {
      const std::vector<Segment>& segs0 = plan.segs[s * p.kv_heads];
      const uint64_t per_seq = (want + batch.size() - 1) / batch.size();
      AddTasks(segs0, window, units,
               std::clamp<uint64_t>(TokensOf(segs0) / per_seq, 1, o.tokens_per_split), plan);
    }
  }
}

// Plans a call (the batch is validated already): kInvalidArgument for options it cannot run.
absl::StatusOr<Plan> PlanAttention(const DecodeAttentionParams& p,
                                   absl::Span<const DecodeSequence> batch,
                                   const DecodeAttentionOptions& o) {
  if (o.tokens_per_split == 0) {
    return absl::InvalidArgumentError("attention: tokens_per_split must be >= 1");
  }
  const uint32_t G = p.q_heads / p.kv_heads;
  Plan plan;
  plan.pool = o.pool != nullptr ? o.pool : &ThreadPool::Default();
  plan.tokens_per_batch = std::max<uint32_t>(1, 8 / G);
  plan.rows_max = size_t{plan.tokens_per_batch} * G;
  PlanGroups(p, batch, plan);
  // Two tasks per thread keep the pool busy.
  const size_t want = 2 * static_cast<size_t>(plan.pool->size());
  const std::vector<size_t> skip = PlanSharedPrefixes(p, batch, o, want, plan);
  PlanOwnSegments(p, batch, o, skip, want, plan);
  return plan;
}

// What running a plan reads.
DecodeAttentionStats CountReads(const Plan& plan) {
  DecodeAttentionStats stats;
  stats.tasks = plan.tasks.size();
  for (const Task& t : plan.tasks) {
    for (size_t i = t.begin; i < t.end; ++i) {
      bool means = false;
      for (size_t ui = 0; ui < t.units.size(); ++ui) {
        const std::vector<Segment>& us = *t.units[ui].segs;
        means |= us[i].block != nullptr && us[i].block->mean_ops != nullptr;
        if (us[i].block == nullptr) continue;
        // Units of one KV head are consecutive and share its segments.
        if (ui == 0 || t.units[ui - 1].segs != &us) ++stats.blocks_read;
        ++stats.blocks_attended;
      }
      stats.head_means_read += means;
    }
  }
  return stats;
}

// Every unit's partial result, at its part: the online softmax's running max and sum and the
// unnormalized output of each of its rows (a part holds rows_max rows; smaller groups use fewer).
struct PartResults {
  std::vector<float> m, l;  // [parts, rows_max]
  std::vector<float> acc;   // [parts, rows_max, head_dim]
};

// Runs one task: each of its segments for every unit in turn, each unit's result to its part.
void RunTask(const Plan& plan, const Task& t, const DecodeAttentionParams& p,
             absl::Span<const DecodeSequence> batch, bool integer_dot,
             const internal::Kernels& kernels, PartResults& out) {
  const uint32_t G = p.q_heads / p.kv_heads, D = p.head_dim;
  const float scale = SoftmaxScale(p);
  const size_t rows_max = plan.rows_max;
  std::vector<HeadGroupState> states(t.units.size());
  std::vector<std::vector<uint32_t>> window_limit(t.units.size());
  for (size_t ui = 0; ui < t.units.size(); ++ui) {
    const Group& gr = plan.groups[t.units[ui].group];
    const DecodeSequence& seq = batch[gr.seq];
    const uint32_t rows = gr.tokens * G;
    HeadGroupState& st = states[ui];
    st.g = rows;
    st.d = D;
    st.integer_dot = integer_dot;
    st.q.resize(size_t{rows} * D);
    window_limit[ui].resize(rows);
    for (uint32_t r = 0; r < rows; ++r) {
      const uint32_t token = gr.token0 + r / G, j = r % G;
      const float* q = seq.q + (size_t{token} * p.q_heads + size_t{gr.head} * G + j) * D;
      for (uint32_t d = 0; d < D; ++d) st.q[size_t{r} * D + d] = q[d] * scale;
      window_limit[ui][r] = seq.window.tokens - (seq.query_tokens - 1 - token);
    }
    st.m.assign(rows, kNegInf);
    st.l.assign(rows, 0.0f);
    st.acc.assign(size_t{rows} * D, 0.0f);
  }
  // Block by block for every unit: each block read from memory once for all of them. CQ blocks
  // are read through each unit's tables of the codebook (runs x 2^b x rows floats: 128 KiB for
  // cq:c4:b8 and 4 rows), which that order would cycle through the cache at every block, while
  // their codes are small: unit by unit there, each unit's tables staying in cache.
  bool tables = false;
  for (size_t ui = 0; ui < t.units.size() && !tables; ++ui) {
    for (size_t i = t.begin; i < t.end && !tables; ++i) {
      const BlockOperands* b = (*t.units[ui].segs)[i].block;
      tables =
          b != nullptr && (b->k.kind == CodeKind::kCodebook || b->v.kind == CodeKind::kCodebook);
    }
  }
  if (tables) {
    for (size_t ui = 0; ui < t.units.size(); ++ui) {
      RunSegments(*t.units[ui].segs, t.begin, t.end, t.last_is_window, window_limit[ui], states[ui],
                  kernels);
    }
  } else {
    for (size_t i = t.begin; i < t.end; ++i) {
      for (size_t ui = 0; ui < t.units.size(); ++ui) {
        RunSegments(*t.units[ui].segs, i, i + 1, t.last_is_window, window_limit[ui], states[ui],
                    kernels);
      }
    }
  }
  for (size_t ui = 0; ui < t.units.size(); ++ui) {
    HeadGroupState& st = states[ui];
    FlushCodebookMass(st);
    const size_t part = t.units[ui].part;
    std::memcpy(&out.m[part * rows_max], st.m.data(), st.g * sizeof(float));
    std::memcpy(&out.l[part * rows_max], st.l.data(), st.g * sizeof(float));
    std::memcpy(&out.acc[part * rows_max * D], st.acc.data(), size_t{st.g} * D * sizeof(float));
  }
}

// Log-sum-exp merge of the parts of each group, into its rows of the outputs.
void MergeParts(const Plan& plan, const DecodeAttentionParams& p,
                absl::Span<const DecodeSequence> batch, const PartResults& parts) {
  const uint32_t G = p.q_heads / p.kv_heads, D = p.head_dim;
  const size_t rows_max = plan.rows_max;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const Group& gr = plan.groups[g];
    const DecodeSequence& seq = batch[gr.seq];
    for (uint32_t r = 0; r < gr.tokens * G; ++r) {
      const uint32_t token = gr.token0 + r / G, j = r % G;
      float m = kNegInf;
      for (size_t part : plan.group_parts[g]) m = std::max(m, parts.m[part * rows_max + r]);
      float l = 0;
      float* out = seq.out + (size_t{token} * p.q_heads + size_t{gr.head} * G + j) * D;
      std::fill(out, out + D, 0.0f);
      for (size_t part : plan.group_parts[g]) {
        const float pm = parts.m[part * rows_max + r];
        const float w = pm == kNegInf ? 0.0f : std::exp(pm - m);
        l += parts.l[part * rows_max + r] * w;
        const float* acc = &parts.acc[(part * rows_max + r) * D];
        for (uint32_t d = 0; d < D; ++d) out[d] += acc[d] * w;
      }
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      for (uint32_t d = 0; d < D; ++d) out[d] *= inv;
    }
  }
}

// Runs a plan's tasks in parallel, then merges each group's parts into the outputs.
void RunPlan(const Plan& plan, const DecodeAttentionParams& p,
             absl::Span<const DecodeSequence> batch, const DecodeAttentionOptions& o,
             const internal::Kernels& kernels) {
  PartResults parts;
  parts.m.resize(plan.parts * plan.rows_max);
  parts.l.resize(plan.parts * plan.rows_max);
  parts.acc.resize(plan.parts * plan.rows_max * p.head_dim);
  plan.pool->ParallelFor(plan.tasks.size(), [&](size_t ti) {
    RunTask(plan, plan.tasks[ti], p, batch, o.integer_dot, kernels, parts);
  });
  MergeParts(plan, p, batch, parts);
}

// Plans the call, then runs the plan.
absl::Status Run(const DecodeAttentionParams& p, absl::Span<const DecodeSequence> batch,
                 const DecodeAttentionOptions& o, const internal::Kernels& kernels) {
  STRATA_ASSIGN_OR_RETURN(const Plan plan, PlanAttention(p, batch, o));
  if (o.stats != nullptr) *o.stats = CountReads(plan);
  RunPlan(plan, p, batch, o, kernels);
  return absl::OkStatus();
}

bool HaveAvx2() {
  const CpuFeatures& f = GetCpuFeatures();
  return f.avx2 && f.fma && f.f16c;
}

}  // namespace

namespace internal {

// ---- portable kernels ----

void SoftmaxPortable(uint32_t T, HeadGroupState& st) {
  for (uint32_t j = 0; j < st.g; ++j) {
    float* s = &st.scores[size_t{j} * T];
    float mx = kNegInf;
    for (uint32_t t = 0; t < T; ++t) mx = std::max(mx, s[t]);
    const float m_new = std::max(st.m[j], mx);
    if (m_new == kNegInf) {  // nothing visible yet: no weight
      std::fill(s, s + T, 0.0f);
      continue;
    }
    const float alpha = st.m[j] == kNegInf ? 0.0f : std::exp(st.m[j] - m_new);
    float* acc = &st.acc[size_t{j} * st.d];
    for (uint32_t d = 0; d < st.d; ++d) acc[d] *= alpha;
    float l = st.l[j] * alpha;
    for (uint32_t t = 0; t < T; ++t) {
      s[t] = std::exp(s[t] - m_new);
      l += s[t];
    }
    st.l[j] = l;
    st.m[j] = m_new;
  }
}

// Decodes one token's row of a block tensor (backbone only) into `row` [D], in float.
// Affine codes come out as raw code values; the caller applies the scales.
static void UnpackRow(const TensorOperands& t, size_t row_index, uint32_t D, float* row) {
  const uint8_t* c = t.codes + row_index * t.row_bytes;
  switch (t.kind) {
    case CodeKind::kFloat16:
      for (uint32_t d = 0; d < D; ++d) {
        uint16_t b;
        std::memcpy(&b, c + 2 * d, 2);
        row[d] = HalfBitsToFloat(b);
      }
      return;
    case CodeKind::kBFloat16:
      for (uint32_t d = 0; d < D; ++d) {
        uint16_t b;
        std::memcpy(&b, c + 2 * d, 2);
        row[d] = BFloat16BitsToFloat(b);
      }
      return;
    case CodeKind::kInt8:
      for (uint32_t d = 0; d < D; ++d) row[d] = static_cast<int8_t>(c[d]);
      return;
    case CodeKind::kFp8E4M3:
      for (uint32_t d = 0; d < D; ++d) row[d] = Fp8E4M3ToFloat(c[d]);
      return;
    case CodeKind::kAffine:
      for (uint32_t d = 0; d < D; ++d) row[d] = static_cast<float>(UnpackBit(c, d, t.bits));
      return;
    case CodeKind::kCodebook:  // read through tables (ScoresCodebook, AccumulateCodebook)
      std::fill(row, row + D, 0.0f);
      return;
  }
}

// CQ's tables (HeadGroupState::k_lut, v_mass) hold one float per query row, run and centroid.
// The G rows are taken in chunks, 8 at a time while 8 remain, then 4, then 1 (ForEachRowChunk);
// chunk [j0, j0 + W) owns the table's floats [j0, j0 + W) x runs x 2^b, laid out [runs][2^b][W]:
// for one run and code, the chunk's W entries are adjacent, so a token's lookup or scattered add
// for W rows is one short vector operation (the rows share the token's code), and a chunk's
// table stays in L2 however many rows share the blocks (a batch over one prefix).
template <typename Fn>
static void ForEachRowChunk(uint32_t G, Fn&& fn) {
  uint32_t j = 0;
  for (; j + 8 <= G; j += 8) fn(j, 8u);
  for (; j + 4 <= G; j += 4) fn(j, 4u);
  for (; j < G; ++j) fn(j, 1u);
}

// Where run g's [2^b][W] entries of the chunk of rows from j0 begin in a table laid out as above:
// every writer and reader of k_lut and v_mass takes its offsets from here.
static inline size_t ChunkRun(uint32_t j0, uint32_t W, uint32_t g, uint32_t runs, size_t E) {
  return size_t{j0} * runs * E + size_t{g} * E * W;
}

// Four floats as one vector (GCC's and Clang's vector extension: SSE on x86-64's baseline, NEON
// on arm64), for the codebook kernels' rows of a table.
using F4 = float __attribute__((vector_size(16)));
static inline F4 LoadF4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void StoreF4(float* p, F4 v) { std::memcpy(p, &v, sizeof v); }

// W/4 vectors of rows (W a multiple of 4), or one row (W = 1).
template <uint32_t W>
struct RowVec {
  static constexpr uint32_t kN = W / 4;
  F4 v[kN];
  static RowVec Zero() {
    RowVec r;
    for (uint32_t i = 0; i < kN; ++i) r.v[i] = F4{0, 0, 0, 0};
    return r;
  }
  static RowVec Load(const float* p) {
    RowVec r;
    for (uint32_t i = 0; i < kN; ++i) r.v[i] = LoadF4(p + 4 * i);
    return r;
  }
  void Store(float* p) const {
    for (uint32_t i = 0; i < kN; ++i) StoreF4(p + 4 * i, v[i]);
  }
  void Add(const RowVec& o) {
    for (uint32_t i = 0; i < kN; ++i) v[i] += o.v[i];
  }
  void Scale(float s) {
    for (uint32_t i = 0; i < kN; ++i) v[i] *= s;
  }
  float operator[](uint32_t w) const { return v[w / 4][w % 4]; }
};
template <>
struct RowVec<1> {
  float v;
  static RowVec Zero() { return {0.0f}; }
  static RowVec Load(const float* p) { return {*p}; }
  void Store(float* p) const { *p = v; }
  void Add(const RowVec& o) { v += o.v; }
  void Scale(float s) { v *= s; }
  float operator[](uint32_t) const { return v; }
};

template <bool kByteCodes>
static inline size_t CodeAt(const uint8_t* codes, uint32_t g, int bits) {
  return kByteCodes ? codes[g] : UnpackBit(codes, g, bits);
}

template <uint32_t W, bool kByteCodes>
static void CodebookScoreRows(const TensorOperands& k, const Segment& seg, const float* lut,
                              uint32_t j0, float* scores) {
  using V = RowVec<W>;
  const uint32_t T = seg.tokens, runs = k.groups;
  const int bits = k.bits;
  const size_t E = size_t{1} << bits;
  for (uint32_t t = 0; t < T; ++t) {
    const uint8_t* codes = k.codes + (size_t{seg.head} * T + t) * k.row_bytes;
    // Four chains of adds, a quarter of the runs each: the lookups miss L1 (the table of 8-bit
    // codes is 2^8 x runs x G floats), and one chain would wait on each.
    V a = V::Zero(), b = V::Zero(), c = V::Zero(), d = V::Zero();
    uint32_t g = 0;
    for (; g + 4 <= runs; g += 4) {
      a.Add(V::Load(lut + ChunkRun(j0, W, g, runs, E) + CodeAt<kByteCodes>(codes, g, bits) * W));
      b.Add(V::Load(lut + ChunkRun(j0, W, g + 1, runs, E) +
                    CodeAt<kByteCodes>(codes, g + 1, bits) * W));
      c.Add(V::Load(lut + ChunkRun(j0, W, g + 2, runs, E) +
                    CodeAt<kByteCodes>(codes, g + 2, bits) * W));
      d.Add(V::Load(lut + ChunkRun(j0, W, g + 3, runs, E) +
                    CodeAt<kByteCodes>(codes, g + 3, bits) * W));
    }
    for (; g < runs; ++g) {
      a.Add(V::Load(lut + ChunkRun(j0, W, g, runs, E) + CodeAt<kByteCodes>(codes, g, bits) * W));
    }
    a.Add(b);
    c.Add(d);
    a.Add(c);
    if (k.scales != nullptr) a.Scale(HalfBitsToFloat(k.scales[size_t{seg.head} * T + t]));  // norm
    for (uint32_t w = 0; w < W; ++w) scores[size_t{j0 + w} * T + t] = a[w];
  }
}

template <uint32_t W, bool kByteCodes>
static void CodebookMassRows(const TensorOperands& v, const Segment& seg, const float* p_by_token,
                             uint32_t G, uint32_t j0, float* mass) {
  using V = RowVec<W>;
  const uint32_t T = seg.tokens, runs = v.groups;
  const int bits = v.bits;
  const size_t E = size_t{1} << bits;
  for (uint32_t t = 0; t < T; ++t) {
    const uint8_t* codes = v.codes + (size_t{seg.head} * T + t) * v.row_bytes;
    V p = V::Load(p_by_token + size_t{t} * G + j0);
    if (v.scales != nullptr) p.Scale(HalfBitsToFloat(v.scales[size_t{seg.head} * T + t]));  // norm
    for (uint32_t g = 0; g < runs; ++g) {
      float* m = mass + ChunkRun(j0, W, g, runs, E) + CodeAt<kByteCodes>(codes, g, bits) * W;
      V x = V::Load(m);
      x.Add(p);
      x.Store(m);
    }
  }
}

// Runs `Op<W, byte codes>::Run(args..., j0)` over the chunks of the G rows.
template <template <uint32_t, bool> class Op, typename... Args>
static void ForRowChunks(uint32_t G, int bits, Args&&... args) {
  const bool byte = bits == 8;
  ForEachRowChunk(G, [&](uint32_t j, uint32_t W) {
    switch (W) {
      case 8:
        return byte ? Op<8, true>::Run(args..., j) : Op<8, false>::Run(args..., j);
      case 4:
        return byte ? Op<4, true>::Run(args..., j) : Op<4, false>::Run(args..., j);
      default:
        return byte ? Op<1, true>::Run(args..., j) : Op<1, false>::Run(args..., j);
    }
  });
}
template <uint32_t W, bool kByte>
struct ScoreRowsOp {
  static void Run(const TensorOperands& k, const Segment& seg, const float* lut, float* scores,
                  uint32_t j0) {
    CodebookScoreRows<W, kByte>(k, seg, lut, j0, scores);
  }
};
template <uint32_t W, bool kByte>
struct MassRowsOp {
  static void Run(const TensorOperands& v, const Segment& seg, const float* p, uint32_t G,
                  float* mass, uint32_t j0) {
    CodebookMassRows<W, kByte>(v, seg, p, G, j0, mass);
  }
};

// CQ's keys (codebook.h): per query row, a table of its dot products with every centroid of
// every channel run; a token's score is the sum of its runs' entries (times its row's RMS with
// cq's norm). 2^b x D multiply-adds per row for the table, made once per codebook and call
// (HeadGroupState::k_lut), then one lookup per run and token for all rows together.
static void ScoresCodebook(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& k = seg.block->k;
  const uint32_t G = st.g, D = st.d;
  const uint32_t runs = k.groups, c = k.group_size, E = 1u << k.bits;
  const uint16_t* head_book = k.codebook + size_t{seg.head} * runs * E * c;
  if (st.k_lut_book != head_book || st.k_lut.size() != size_t{G} * runs * E) {
    st.k_lut.resize(size_t{G} * runs * E);
    float* cent = st.Work(size_t{E} * c + size_t{c} * G);
    float* qt = cent + size_t{E} * c;  // run g's query channels by channel: [c][G]
    for (uint32_t g = 0; g < runs; ++g) {
      HalfToFloat(reinterpret_cast<const Half*>(head_book + size_t{g} * E * c), cent,
                  size_t{E} * c);
      for (uint32_t i = 0; i < c; ++i) {
        for (uint32_t j = 0; j < G; ++j) qt[size_t{i} * G + j] = st.q[size_t{j} * D + g * c + i];
      }
      ForEachRowChunk(G, [&](uint32_t j0, uint32_t W) {
        float* chunk = &st.k_lut[ChunkRun(j0, W, g, runs, E)];
        for (uint32_t e = 0; e < E; ++e) {
          float* dst = chunk + size_t{e} * W;
          const float* centroid = cent + size_t{e} * c;
          const float* qj = qt + j0;
          if (W >= 4) {
            for (uint32_t w = 0; w < W; w += 4) {
              F4 s = LoadF4(qj + w) * centroid[0];
              for (uint32_t i = 1; i < c; ++i) s += LoadF4(qj + size_t{i} * G + w) * centroid[i];
              StoreF4(dst + w, s);
            }
          } else {
            float s = qj[0] * centroid[0];
            for (uint32_t i = 1; i < c; ++i) s += qj[size_t{i} * G] * centroid[i];
            dst[0] = s;
          }
        }
      });
    }
    st.k_lut_book = head_book;
  }
  ForRowChunks<ScoreRowsOp>(G, k.bits, k, seg, st.k_lut.data(), st.scores.data());
}

// Multiplies row j of the stored mass by v_mass_scale[j] and makes the scales 1.
static void ApplyMassScale(HeadGroupState& st) {
  const uint32_t G = st.g;
  bool all_one = true;
  for (uint32_t j = 0; j < G; ++j) all_one = all_one && st.v_mass_scale[j] == 1.0f;
  if (all_one) return;
  const size_t entries = size_t{st.v_runs} << st.v_bits;
  ForEachRowChunk(G, [&](uint32_t j0, uint32_t W) {
    float* mass = &st.v_mass[ChunkRun(j0, W, 0, st.v_runs, size_t{1} << st.v_bits)];
    const float* scale = &st.v_mass_scale[j0];
    for (size_t n = 0; n < entries; ++n, mass += W) {
      for (uint32_t w = 0; w < W; ++w) mass[w] *= scale[w];
    }
  });
  std::fill(st.v_mass_scale.begin(), st.v_mass_scale.end(), 1.0f);
}

// acc[j0 + w] (run g's c channels) += sum_e mass[e][w] * centroid[e], for a chunk's W rows
// (mass: the chunk's [2^b][W] of run g).
template <uint32_t C>
static void FlushRun(const float* mass, const float* cent, uint32_t E, uint32_t W, float* acc,
                     uint32_t D) {
  for (uint32_t w = 0; w < W; ++w) {
    float* out_row = acc + size_t{w} * D;
    if constexpr (C % 4 == 0) {
      RowVec<C> out = RowVec<C>::Load(out_row);
      for (uint32_t e = 0; e < E; ++e) {
        RowVec<C> x = RowVec<C>::Load(cent + size_t{e} * C);
        x.Scale(mass[size_t{e} * W + w]);
        out.Add(x);
      }
      out.Store(out_row);
    } else {
      float out[C];
      for (uint32_t i = 0; i < C; ++i) out[i] = out_row[i];
      for (uint32_t e = 0; e < E; ++e) {
        const float m = mass[size_t{e} * W + w];
        for (uint32_t i = 0; i < C; ++i) out[i] += m * cent[size_t{e} * C + i];
      }
      for (uint32_t i = 0; i < C; ++i) out_row[i] = out[i];
    }
  }
}

void FlushCodebookMass(HeadGroupState& st) {
  if (st.v_mass_book == nullptr) return;
  ApplyMassScale(st);
  const uint32_t G = st.g, D = st.d, runs = st.v_runs, c = st.v_group, E = 1u << st.v_bits;
  float* cent = st.Work(size_t{E} * c);
  for (uint32_t g = 0; g < runs; ++g) {
    HalfToFloat(reinterpret_cast<const Half*>(st.v_mass_book + size_t{g} * E * c), cent,
                size_t{E} * c);
    ForEachRowChunk(G, [&](uint32_t j0, uint32_t W) {
      const float* mass = &st.v_mass[ChunkRun(j0, W, g, runs, E)];
      float* acc = &st.acc[size_t{j0} * D + size_t{g} * c];
      switch (c) {
        case 2:
          return FlushRun<2>(mass, cent, E, W, acc, D);
        case 4:
          return FlushRun<4>(mass, cent, E, W, acc, D);
        case 8:
          return FlushRun<8>(mass, cent, E, W, acc, D);
        default:  // codec_spec allows no other; the plain loop all the same
          for (uint32_t w = 0; w < W; ++w) {
            for (uint32_t e = 0; e < E; ++e) {
              for (uint32_t i = 0; i < c; ++i) {
                acc[size_t{w} * D + i] += mass[size_t{e} * W + w] * cent[size_t{e} * c + i];
              }
            }
          }
      }
    });
  }
  st.v_mass_book = nullptr;
}

void RescaleCodebookMass(HeadGroupState& st, const float* alpha) {
  if (st.v_mass_book == nullptr) return;
  // The mass is kept as stored x v_mass_scale[row]: a rescale multiplies the row's scale, and
  // later probabilities are stored divided by it (AccumulateCodebook), so a block whose maximum
  // moved costs G multiplies, not one per entry. The stored mass is rescaled for real only when a
  // scale gets so small that stored probabilities could overflow (2^60 x each).
  constexpr float kLeast = 0x1p-60f;
  bool apply = false;
  for (uint32_t j = 0; j < st.g; ++j) {
    st.v_mass_scale[j] *= alpha[j];
    apply = apply || st.v_mass_scale[j] < kLeast;
  }
  if (apply) ApplyMassScale(st);  // zeroes a row whose alpha was 0, as its mass must be
}

// CQ's values: per query row, the probability mass each centroid of each run receives, summed
// over every block of the codebook (HeadGroupState::v_mass); the centroids weighted by it join
// acc once (FlushCodebookMass).
static void AccumulateCodebook(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& v = seg.block->v;
  const uint32_t G = st.g, T = seg.tokens;
  const uint32_t runs = v.groups, c = v.group_size, E = 1u << v.bits;
  const uint16_t* head_book = v.codebook + size_t{seg.head} * runs * E * c;
  if (st.v_mass_book != head_book) {
    FlushCodebookMass(st);
    st.v_mass.assign(size_t{G} * runs * E, 0.0f);
    st.v_mass_scale.assign(G, 1.0f);
    st.v_mass_book = head_book;
    st.v_runs = runs;
    st.v_group = c;
    st.v_bits = v.bits;
  }
  float* p = st.Work(size_t{G} * T);  // the probabilities by token, in stored units: [T][G]
  for (uint32_t j = 0; j < G; ++j) {
    const float unit = 1.0f / st.v_mass_scale[j];
    for (uint32_t t = 0; t < T; ++t) p[size_t{t} * G + j] = st.scores[size_t{j} * T + t] * unit;
  }
  ForRowChunks<MassRowsOp>(G, v.bits, v, seg, static_cast<const float*>(p), G, st.v_mass.data());
}

void ScoresPortable(const Segment& seg, HeadGroupState& st) {
  const uint32_t G = st.g, D = st.d, T = seg.tokens;
  if (seg.block == nullptr) {
    for (uint32_t t = 0; t < T; ++t) {
      const float* k = seg.k + size_t{t} * seg.stride;
      for (uint32_t j = 0; j < G; ++j) {
        const float* q = &st.q[size_t{j} * D];
        float s = 0;
        for (uint32_t d = 0; d < D; ++d) s += q[d] * k[d];
        st.scores[size_t{j} * T + t] = s;
      }
    }
    return;
  }
  const TensorOperands& k = seg.block->k;
  if (k.kind == CodeKind::kCodebook) return ScoresCodebook(seg, st);  // no corrections
  float* row = st.Work(size_t{D} + size_t{G} * D + G);
  float* qf = row + D;               // [G, D] q with this token group's scales folded in
  float* bias = qf + size_t{G} * D;  // [G]
  if (k.kind == CodeKind::kAffine && k.token_groups) {
    // Per-token channel groups (SKVQ): s = sum_g scale_g (q_g . c_g) + zero_g sum(q_g).
    const uint32_t Gn = k.groups, gs = k.group_size;
    row = st.Work(size_t{D} + size_t{G} * Gn);
    float* qsum = row + D;  // [G, groups]
    for (uint32_t j = 0; j < G; ++j) {
      for (uint32_t g = 0; g < Gn; ++g) {
        float sum = 0;
        for (uint32_t d = g * gs; d < std::min(D, (g + 1) * gs); ++d)
          sum += st.q[size_t{j} * D + d];
        qsum[j * Gn + g] = sum;
      }
    }
    for (uint32_t t = 0; t < T; ++t) {
      const size_t r = size_t{seg.head} * T + t;
      UnpackRow(k, r, D, row);
      for (uint32_t j = 0; j < G; ++j) {
        const float* q = &st.q[size_t{j} * D];
        float s = 0;
        for (uint32_t g = 0; g < Gn; ++g) {
          float dot = 0;
          for (uint32_t d = g * gs; d < std::min(D, (g + 1) * gs); ++d) dot += q[d] * row[d];
          s += HalfBitsToFloat(k.scales[r * Gn + g]) * dot +
               HalfBitsToFloat(k.zeros[r * Gn + g]) * qsum[j * Gn + g];
        }
        st.scores[size_t{j} * T + t] = s;
      }
    }
    AddScoreCorrections(seg, st);
    return;
  }
  for (uint32_t t = 0; t < T; ++t) {
    const size_t r = size_t{seg.head} * T + t;
    if (k.kind == CodeKind::kAffine && (t % k.group_size == 0)) {
      const size_t p0 = (size_t{seg.head} * k.groups + t / k.group_size) * D;
      for (uint32_t j = 0; j < G; ++j) {
        const float* q = &st.q[size_t{j} * D];
        float b = 0;
        for (uint32_t d = 0; d < D; ++d) {
          qf[j * D + d] = q[d] * HalfBitsToFloat(k.scales[p0 + d]);
          b += q[d] * HalfBitsToFloat(k.zeros[p0 + d]);
        }
        bias[j] = b;
      }
    }
    UnpackRow(k, r, D, row);
    for (uint32_t j = 0; j < G; ++j) {
      const float* q = k.kind == CodeKind::kAffine ? &qf[j * D] : &st.q[size_t{j} * D];
      float s = 0;
      for (uint32_t d = 0; d < D; ++d) s += q[d] * row[d];
      switch (k.kind) {
        case CodeKind::kAffine:
          s += bias[j];
          break;
        case CodeKind::kInt8:
          s *= HalfBitsToFloat(k.scales[r]);
          break;
        case CodeKind::kFp8E4M3:
          s *= k.tensor_scale;
          break;
        default:
          break;
      }
      st.scores[size_t{j} * T + t] = s;
    }
  }
  AddScoreCorrections(seg, st);
}

void AccumulatePortable(const Segment& seg, HeadGroupState& st) {
  const uint32_t G = st.g, D = st.d, T = seg.tokens;
  if (seg.block == nullptr) {
    for (uint32_t t = 0; t < T; ++t) {
      const float* v = seg.v + size_t{t} * seg.stride;
      for (uint32_t j = 0; j < G; ++j) {
        const float p = st.scores[size_t{j} * T + t];
        float* acc = &st.acc[size_t{j} * D];
        for (uint32_t d = 0; d < D; ++d) acc[d] += p * v[d];
      }
    }
    return;
  }
  const TensorOperands& v = seg.block->v;
  if (v.kind == CodeKind::kCodebook) return AccumulateCodebook(seg, st);
  float* row = st.Work(D);
  for (uint32_t t = 0; t < T; ++t) {
    const size_t r = size_t{seg.head} * T + t;
    UnpackRow(v, r, D, row);
    for (uint32_t j = 0; j < G; ++j) {
      const float p = st.scores[size_t{j} * T + t];
      float* acc = &st.acc[size_t{j} * D];
      switch (v.kind) {
        case CodeKind::kAffine:
          for (uint32_t g = 0; g < v.groups; ++g) {
            const float w = p * HalfBitsToFloat(v.scales[r * v.groups + g]);
            const float z = p * HalfBitsToFloat(v.zeros[r * v.groups + g]);
            const uint32_t d1 = std::min(D, (g + 1) * v.group_size);
            for (uint32_t d = g * v.group_size; d < d1; ++d) acc[d] += w * row[d] + z;
          }
          break;
        case CodeKind::kInt8: {
          const float w = p * HalfBitsToFloat(v.scales[r]);
          for (uint32_t d = 0; d < D; ++d) acc[d] += w * row[d];
          break;
        }
        case CodeKind::kFp8E4M3: {
          const float w = p * v.tensor_scale;
          for (uint32_t d = 0; d < D; ++d) acc[d] += w * row[d];
          break;
        }
        default:
          for (uint32_t d = 0; d < D; ++d) acc[d] += p * row[d];
          break;
      }
    }
  }
  AddValueCorrections(seg, st);
}

// Converts n fp16 values to float (F16C where available) into a scratch vector.
static const float* Widen(const uint16_t* src, size_t n, std::vector<float>& dst) {
  dst.resize(n);
  HalfToFloat(reinterpret_cast<const Half*>(src), dst.data(), n);
  return dst.data();
}

void AddScoreCorrections(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& k = seg.block->k;
  const uint32_t G = st.g, D = st.d, T = seg.tokens, h = seg.head;
  thread_local std::vector<float> fa, fb, fo;
  if (k.rank > 0) {
    const uint32_t R = k.rank;
    const float* a = Widen(k.lowrank_a + size_t{h} * T * R, size_t{T} * R, fa);
    const float* b = Widen(k.lowrank_b + size_t{h} * D * R, size_t{D} * R, fb);
    float qb[8 * 64];  // (q . B) per query head; G <= 8 here, else computed per head below
    for (uint32_t j0 = 0; j0 < G; j0 += 8) {
      const uint32_t gn = std::min<uint32_t>(8, G - j0);
      std::fill(qb, qb + gn * R, 0.0f);
      for (uint32_t d = 0; d < D; ++d) {
        for (uint32_t j = 0; j < gn; ++j) {
          const float q = st.q[size_t{j0 + j} * D + d];
          for (uint32_t r = 0; r < R; ++r) qb[j * R + r] += q * b[d * R + r];
        }
      }
      for (uint32_t j = 0; j < gn; ++j) {
        float* s = &st.scores[size_t{j0 + j} * T];
        for (uint32_t t = 0; t < T; ++t) {
          float sum = 0;
          for (uint32_t r = 0; r < R; ++r) sum += a[t * R + r] * qb[j * R + r];
          s[t] += sum;
        }
      }
    }
  }
  const uint32_t n = k.outliers_per_vector;
  if (n > 0) {
    const float* vals = Widen(k.outlier_values + size_t{h} * D * n, size_t{D} * n, fo);
    for (uint32_t d = 0; d < D; ++d) {
      for (uint32_t e = 0; e < n; ++e) {
        const uint32_t t = k.OutlierIndex((size_t{h} * D + d) * n + e);
        const float val = vals[d * n + e];
        for (uint32_t j = 0; j < G; ++j) {
          st.scores[size_t{j} * T + t] += st.q[size_t{j} * D + d] * val;
        }
      }
    }
  }
}

void AddValueCorrections(const Segment& seg, HeadGroupState& st) {
  const TensorOperands& v = seg.block->v;
  const uint32_t G = st.g, D = st.d, T = seg.tokens, h = seg.head;
  thread_local std::vector<float> fa, fb, fo;
  if (v.rank > 0) {
    const uint32_t R = v.rank;
    const float* a = Widen(v.lowrank_a + size_t{h} * T * R, size_t{T} * R, fa);
    const float* b = Widen(v.lowrank_b + size_t{h} * D * R, size_t{D} * R, fb);
    float pa[64];  // sum_t p_t A_t for one query head
    for (uint32_t j = 0; j < G; ++j) {
      std::fill(pa, pa + R, 0.0f);
      const float* p = &st.scores[size_t{j} * T];
      for (uint32_t t = 0; t < T; ++t) {
        for (uint32_t r = 0; r < R; ++r) pa[r] += p[t] * a[t * R + r];
      }
      float* acc = &st.acc[size_t{j} * D];
      for (uint32_t d = 0; d < D; ++d) {
        float sum = 0;
        for (uint32_t r = 0; r < R; ++r) sum += b[d * R + r] * pa[r];
        acc[d] += sum;
      }
    }
  }
  const uint32_t n = v.outliers_per_vector;
  if (n > 0) {
    const float* vals = Widen(v.outlier_values + size_t{h} * T * n, size_t{T} * n, fo);
    for (uint32_t t = 0; t < T; ++t) {
      for (uint32_t e = 0; e < n; ++e) {
        const uint32_t d = v.OutlierIndex((size_t{h} * T + t) * n + e);
        const float val = vals[t * n + e];
        for (uint32_t j = 0; j < G; ++j) {
          st.acc[size_t{j} * D + d] += st.scores[size_t{j} * T + t] * val;
        }
      }
    }
  }
}

}  // namespace internal

bool DecodeAttentionUsesAvx2() { return HaveAvx2(); }

const char* DecodeAttentionPath() {
  if (!HaveAvx2()) return "portable";
  switch (internal::IntegerDotIsa()) {
    case internal::IntegerIsa::kAvx512Vnni:
      return "avx2+avx512-vnni";
    case internal::IntegerIsa::kAvxVnni:
      return "avx2+avx-vnni";
    case internal::IntegerIsa::kEmulatedVnni:
      return "avx2+emulated-vnni";
    case internal::IntegerIsa::kAvx512Zmm:
      return "avx512-vnni-zmm";
    case internal::IntegerIsa::kEmulatedZmm:
      return "avx2+emulated-avx512-zmm";
    case internal::IntegerIsa::kAvx2:
      break;
  }
  return "avx2+vpmaddubsw";
}

bool SelectIntegerDot(std::string_view name) {
  using internal::IntegerIsa;
  if (name == "auto") return internal::SetIntegerIsa(std::nullopt);
  const std::pair<std::string_view, IntegerIsa> names[] = {
      {"avx2+vpmaddubsw", IntegerIsa::kAvx2},
      {"avx2+avx-vnni", IntegerIsa::kAvxVnni},
      {"avx2+avx512-vnni", IntegerIsa::kAvx512Vnni},
      {"avx512-vnni-zmm", IntegerIsa::kAvx512Zmm}};
  for (const auto& [n, isa] : names) {
    if (n == name) return HaveAvx2() && internal::SetIntegerIsa(isa);
  }
  return false;
}

absl::Status DecodeAttention(const DecodeAttentionParams& params,
                             absl::Span<const DecodeSequence> batch,
                             const DecodeAttentionOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateAttention(params, batch));
  bool avx2 =
      options.impl == AttentionImpl::kAvx2 || (options.impl == AttentionImpl::kAuto && HaveAvx2());
  if (avx2 && !HaveAvx2()) {
    return absl::UnimplementedError("attention: AVX2+FMA+F16C requested but not available");
  }
  static constexpr internal::Kernels kAvx2{internal::ScoresAvx2, internal::SoftmaxAvx2,
                                           internal::AccumulateAvx2};
  static constexpr internal::Kernels kPortable{internal::ScoresPortable, internal::SoftmaxPortable,
                                               internal::AccumulatePortable};
  return Run(params, batch, options, avx2 ? kAvx2 : kPortable);
}

}  // namespace strata::kernels
