#include "kernels/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/internal/attention_segment.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels {
namespace {

using testing::HasSubstr;

// A sequence's KV: full-precision sinks and window around compressed chunks.
struct TestSequence {
  std::vector<float> q, sink_k, sink_v, win_k, win_v;
  std::vector<AlignedBuffer> buffers;
  std::vector<BlockView> views;
  std::vector<PreparedBlock> ops;
  std::vector<const BlockOperands*> op_ptrs;
  std::vector<float> out, ref;
  DecodeSequence seq;
  std::shared_ptr<Calibration> calibration;
};

// edit_kv, when set, changes each compressed chunk's synthetic KV before it is encoded.
std::unique_ptr<TestSequence> MakeSequence(
    const std::string& spec, uint32_t q_heads, uint32_t kv_heads, uint32_t dim, uint32_t sinks,
    std::vector<uint32_t> chunk_tokens, uint32_t window, uint64_t seed,
    const std::function<void(SyntheticKv&)>& edit_kv = nullptr) {
  auto s = std::make_unique<TestSequence>();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  s->q.resize(size_t{q_heads} * dim);
  for (float& x : s->q) x = normal(rng);
  uint32_t pos = 0;
  auto full = [&](uint32_t n, std::vector<float>& k, std::vector<float>& v) {
    const SyntheticKv kv = MakeSyntheticKv(n, kv_heads, dim, seed + pos, pos);
    k = kv.k;
    v = kv.v;
    pos += n;
  };
  if (sinks > 0) full(sinks, s->sink_k, s->sink_v);
  const CodecSpec parsed = *CodecSpec::Parse(spec);
  if (parsed.needs_calibration())
    s->calibration = MakeSyntheticCalibration(parsed, kv_heads, dim, seed);
  auto codec = *Codec::Create(spec, s->calibration);
  for (uint32_t n : chunk_tokens) {
    SyntheticKv kv = MakeSyntheticKv(n, kv_heads, dim, seed + pos, pos);
    if (edit_kv) edit_kv(kv);
    pos += n;
    absl::StatusOr<AlignedBuffer> b =
        codec->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, n, kv_heads, dim}, {});
    EXPECT_TRUE(b.ok()) << spec << ": " << b.status();
    s->buffers.push_back(*std::move(b));
  }
  for (const AlignedBuffer& b : s->buffers) s->views.push_back(*BlockView::Parse(b.span()));
  for (const BlockView& v : s->views) {
    absl::StatusOr<PreparedBlock> ops = PrepareBlock(v, s->calibration.get());
    EXPECT_TRUE(ops.ok()) << ops.status();
    s->ops.push_back(*ops);
  }
  for (const PreparedBlock& o : s->ops) {
    for (const BlockOperands& part : o.parts) s->op_ptrs.push_back(&part);
  }
  if (window > 0) full(window, s->win_k, s->win_v);
  s->out.assign(s->q.size(), NAN);
  s->ref.assign(s->q.size(), NAN);
  s->seq.q = s->q.data();
  s->seq.sinks = {s->sink_k.data(), s->sink_v.data(), sinks};
  s->seq.blocks = s->op_ptrs;
  s->seq.window = {s->win_k.data(), s->win_v.data(), window};
  return s;
}

// n new query tokens (chunked prefill when n > 1), random.
void SetQueries(TestSequence& s, uint32_t n, uint32_t q_heads, uint32_t dim, uint64_t seed) {
  s.q.resize(size_t{n} * q_heads * dim);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  for (float& x : s.q) x = normal(rng);
  s.out.assign(s.q.size(), NAN);
  s.ref.assign(s.q.size(), NAN);
  s.seq.q = s.q.data();
  s.seq.query_tokens = n;
}

// Max |out - ref| over the output's RMS.
double NormalizedMaxError(const std::vector<float>& out, const std::vector<float>& ref) {
  double max_err = 0, sq = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    max_err = std::max(max_err, std::fabs(double{out[i]} - ref[i]));
    sq += double{ref[i]} * ref[i];
  }
  return max_err / std::sqrt(sq / out.size());
}

const char* kCodecs[] = {"fp16",
                         "skvq:k2v2:g32",
                         "skvq:k2v2:g32:m8",
                         "kivi:k2v2:g32:m8",
                         "tada:k2v2:g32:sink2",
                         "skvq:k4v4:g16:sink2",
                         "zipcache:k2v2:h4:s10",
                         "kivi:k2v2:g32:sink4",
                         "gear:k2v2:g32:r4:s2:sink2",
                         "bf16",
                         "int8",
                         "fp8e4m3",
                         "kivi:k2v2:g32",
                         "kivi:k3v3:g64",
                         "kivi:k4v4:g32",
                         "kivi:k8v8:g16",
                         "kcvt:k2v2",
                         "gearl:k2v2:g32:r4",
                         "gear:k2v2:g32:r4:s2",
                         "gear:k4v4:kcvt:r2:s1",
                         "gear:k2v2:kcvt:r2:s1",
                         "gear:k2v2:g32:r3:s1",
                         "cq:c4:b6",
                         "cq:c8:b8:sink2",
                         "cq:c2:b4",
                         "cq:c4:b8:norm:sink2"};

struct Shape {
  uint32_t q_heads, kv_heads, dim;
};

// The kernels under test and each one's tolerance (normalized max error against the reference
// on the same dequantized values): the portable and AVX2 kernels with an fp32 query, exact to
// float rounding, and, where the CPU has AVX2, the AVX2 kernels with the integer query on the
// keys and integer weights on the values (DecodeAttentionOptions::integer_dot). Its error on these
// shapes peaks near 1.2e-2 (skvq:k2v2:g32:m8 with 8 query heads on one KV head: SKVQ's per-token
// key groups take one query scale for all channels, and logits up to ~15 are sums of larger terms
// that cancel); a wrong group, scale or plane of codes costs 0.07 or more.
struct Variant {
  AttentionImpl impl;
  bool integer_dot;
  double tolerance;
};
std::vector<Variant> Variants() {
  std::vector<Variant> v = {{AttentionImpl::kPortable, false, 2e-4}};
  if (DecodeAttentionUsesAvx2()) {
    v.push_back({AttentionImpl::kAvx2, false, 2e-4});
    v.push_back({AttentionImpl::kAvx2, true, 2e-2});
  }
  return v;
}

// One test per codec, so that ctest spreads them over the cores (under a sanitizer the whole
// sweep took 50-90 s in one process).
class FusedDecodeTest : public ::testing::TestWithParam<size_t> {};

TEST_P(FusedDecodeTest, MatchesReferenceForEveryShapeAndImpl) {
  const Shape shapes[] = {{4, 4, 64},  {8, 2, 128}, {8, 2, 64},
                          {16, 2, 64}, {8, 1, 128}, {6, 2, 64}};
  ThreadPool pool(2);
  const char* spec = kCodecs[GetParam()];
  uint64_t seed = 1 + 3 * std::size(shapes) * GetParam();  // as when one test swept them all
  {
    for (const Shape& sh : shapes) {
      // Two sequences of different lengths: odd chunk sizes, with and without sinks/window.
      std::vector<std::unique_ptr<TestSequence>> seqs;
      seqs.push_back(
          MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 4, {64, 37, 5}, 3, ++seed));
      seqs.push_back(MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 0, {33}, 0, ++seed));
      // A long odd block: the 8-bit value kernels' int32 sums end every 256 tokens.
      seqs.push_back(MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 0, {517}, 0, ++seed));
      std::vector<DecodeSequence> batch;
      for (auto& s : seqs) {
        s->seq.out = s->ref.data();
        batch.push_back(s->seq);
      }
      const DecodeAttentionParams params{sh.q_heads, sh.kv_heads, sh.dim};
      ASSERT_TRUE(DecodeAttentionRef(params, batch).ok());
      for (const Variant& var : Variants()) {
        for (uint32_t split : {4096u, 40u}) {
          for (size_t i = 0; i < seqs.size(); ++i) batch[i].out = seqs[i]->out.data();
          const absl::Status st =
              DecodeAttention(params, batch, {var.impl, split, &pool, var.integer_dot});
          ASSERT_TRUE(st.ok()) << st;
          for (auto& s : seqs) {
            bool nonzero = false;
            for (float x : s->out) nonzero |= x != 0;
            EXPECT_TRUE(nonzero);
            EXPECT_LT(NormalizedMaxError(s->out, s->ref), var.tolerance)
                << spec << " q=" << sh.q_heads << " kv=" << sh.kv_heads << " d=" << sh.dim
                << " impl=" << static_cast<int>(var.impl) << " int8=" << var.integer_dot
                << " split=" << split;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryCodec, FusedDecodeTest,
                         ::testing::Range<size_t>(0, std::size(kCodecs)),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           std::string name = kCodecs[info.param];
                           for (char& c : name) {
                             if (!absl::ascii_isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

double RelativeL2(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    num += (double{out[i]} - ref[i]) * (double{out[i]} - ref[i]);
    den += double{ref[i]} * ref[i];
  }
  return std::sqrt(num / den);
}

TEST(DecodeAttentionTest, CompressedAttentionIsCloseToFullPrecisionAndGearBeatsKivi) {
  // The same KV through fp16, KIVI and GEAR: outputs differ by the codec's error only.
  const DecodeAttentionParams params{8, 2, 128};
  auto run = [&](const char* spec) {
    auto s = MakeSequence(spec, 8, 2, 128, 0, {256, 256}, 0, 77);
    s->seq.out = s->out.data();
    EXPECT_TRUE(DecodeAttention(params, {&s->seq, 1}).ok());
    return s->out;
  };
  const std::vector<float> fp = run("fp16");
  const double kivi = RelativeL2(run("kivi:k2v2:g32"), fp);
  const double gear = RelativeL2(run("gear:k2v2:g32:r4:s2"), fp);
  const double gear4 = RelativeL2(run("gear:k4v4:g32:r4:s2"), fp);
  EXPECT_LT(gear4, 0.1);
  EXPECT_LT(gear, kivi);
  EXPECT_LT(gear4, gear);
}

// One sequence through the reference, then through the fp32-query kernels (the portable one, and
// AVX2's where the CPU has it; CQ takes no integer path), each within its tolerance of it.
void ExpectFloatKernelsMatchReference(TestSequence& s, const DecodeAttentionParams& params,
                                      const std::string& what) {
  s.seq.out = s.ref.data();
  ASSERT_TRUE(DecodeAttentionRef(params, {&s.seq, 1}).ok());
  for (const Variant& var : Variants()) {
    if (var.integer_dot) continue;
    s.seq.out = s.out.data();
    ASSERT_TRUE(DecodeAttention(params, {&s.seq, 1}, {var.impl, 4096, nullptr, false}).ok());
    EXPECT_LT(NormalizedMaxError(s.out, s.ref), var.tolerance)
        << what << " impl=" << static_cast<int>(var.impl);
  }
}

// CQ's values keep each row's probability mass in stored units times a per-row scale, and
// rescale the stored mass for real only when the scale falls below 2^-60 (a maximum that rose by
// 42 or more since). Keys that grow 12-fold from block to block raise the maximum by far more
// than that at every block, and the output still matches the reference.
TEST(DecodeAttentionTest, CodebookMassHoldsWhenTheMaximumJumpsFarBetweenBlocks) {
  for (const char* spec : {"cq:c4:b8:norm", "cq:c2:b4:norm"}) {
    int chunk = 0;
    auto grow = [&chunk](SyntheticKv& kv) {
      const float f = std::pow(12.0f, static_cast<float>(chunk++));
      for (float& x : kv.k) x *= f;
    };
    auto s = MakeSequence(spec, 8, 2, 64, 0, {32, 32, 32}, 0, 7, grow);
    ExpectFloatKernelsMatchReference(*s, {8, 2, 64}, spec);
  }
}

// CQ's tables hold a KV head's rows in chunks of 8, 4 and 1: 12, 16 and 24 rows per KV head (and
// chunked prefill's several query tokens) put chunks after the first at every offset.
TEST(DecodeAttentionTest, CodebookTablesHoldEveryChunkOfManyRowsPerKvHead) {
  const Shape shapes[] = {{12, 1, 64}, {16, 1, 64}, {48, 2, 64}};
  for (const char* spec : {"cq:c4:b8:norm", "cq:c2:b4"}) {
    for (const Shape& sh : shapes) {
      for (uint32_t queries : {1u, 3u}) {
        auto s = MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 0, {40, 40}, 8, 11);
        SetQueries(*s, queries, sh.q_heads, sh.dim, 12);
        ExpectFloatKernelsMatchReference(
            *s, {sh.q_heads, sh.kv_heads, sh.dim},
            absl::StrCat(spec, " q=", sh.q_heads, " kv=", sh.kv_heads, " queries=", queries));
      }
    }
  }
}

TEST(DecodeAttentionTest, EightBitValueSumsHoldUnderUniformAttentionOverLongBlocks) {
  // The 8-bit value kernels' worst case: every weight the largest (a zero query: uniform
  // attention) times codes at both ends of their range (channels alternating -1 and +1 in every
  // token: KIVI codes 0 and 255, int8 codes -127 and 127) over a 4096-token block in one
  // segment (one thread: the parts are not split finer). Their int32 sums, taken over more than
  // 256 tokens at a time, would overflow.
  ThreadPool pool(1);
  const DecodeAttentionParams params{8, 2, 128};
  for (const char* spec : {"kivi:k8v8:g32", "int8"}) {
    auto s = MakeSequence(spec, 8, 2, 128, 0, {4096}, 0, 7, [](SyntheticKv& kv) {
      for (size_t i = 0; i < kv.v.size(); ++i) kv.v[i] = i % 2 == 0 ? 1.0f : -1.0f;
    });
    std::fill(s->q.begin(), s->q.end(), 0.0f);
    s->seq.out = s->ref.data();
    ASSERT_TRUE(DecodeAttentionRef(params, {&s->seq, 1}).ok());
    for (const Variant& var : Variants()) {
      s->seq.out = s->out.data();
      ASSERT_TRUE(
          DecodeAttention(params, {&s->seq, 1}, {var.impl, 4096, &pool, var.integer_dot}).ok());
      EXPECT_LT(NormalizedMaxError(s->out, s->ref), 1e-3)
          << spec << " impl=" << static_cast<int>(var.impl) << " int8=" << var.integer_dot;
      EXPECT_NEAR(s->out[0], 1.0f, 1e-2) << spec;  // the mean of +1 over every token
    }
  }
}

TEST(DecodeAttentionTest, ChunkedPrefillOverACompressedPrefixIsCausalInTheWindow) {
  // Five new tokens (the last five of a nine-token window) over sinks and compressed blocks.
  ThreadPool pool(2);
  const Shape shapes[] = {{8, 2, 64}, {4, 4, 128}, {16, 2, 64}, {6, 2, 64}};
  uint64_t seed = 100;
  for (const char* spec : {"fp16", "kivi:k2v2:g32", "gear:k2v2:g32:r4:s2", "int8"}) {
    for (const Shape& sh : shapes) {
      for (uint32_t n : {1u, 3u, 5u}) {
        auto s = MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 4, {64, 37}, 9, ++seed);
        SetQueries(*s, n, sh.q_heads, sh.dim, seed);
        const DecodeAttentionParams params{sh.q_heads, sh.kv_heads, sh.dim};
        DecodeSequence ref = s->seq;
        ref.out = s->ref.data();
        ASSERT_TRUE(DecodeAttentionRef(params, {&ref, 1}).ok());
        for (const Variant& var : Variants()) {
          for (uint32_t split : {4096u, 50u}) {
            DecodeSequence seq = s->seq;
            seq.out = s->out.data();
            ASSERT_TRUE(
                DecodeAttention(params, {&seq, 1}, {var.impl, split, &pool, var.integer_dot}).ok());
            EXPECT_LT(NormalizedMaxError(s->out, s->ref), var.tolerance)
                << spec << " n=" << n << " q=" << sh.q_heads << " kv=" << sh.kv_heads
                << " impl=" << static_cast<int>(var.impl) << " int8=" << var.integer_dot
                << " split=" << split;
          }
        }
        // The last new token sees everything: it equals decode of that token alone (with the
        // fp32 query: the int8 one applies to 1, 2, 4 or 8 rows at once, which a batch of rows
        // and a single token need not both be).
        const DecodeAttentionOptions exact{.pool = &pool, .integer_dot = false};
        DecodeSequence all = s->seq;
        all.out = s->out.data();
        ASSERT_TRUE(DecodeAttention(params, {&all, 1}, exact).ok());
        DecodeSequence last = s->seq;
        last.q = s->q.data() + size_t{n - 1} * sh.q_heads * sh.dim;
        last.query_tokens = 1;
        std::vector<float> one(size_t{sh.q_heads} * sh.dim);
        last.out = one.data();
        ASSERT_TRUE(DecodeAttention(params, {&last, 1}, exact).ok());
        const std::vector<float> tail(s->out.end() - one.size(), s->out.end());
        EXPECT_LT(NormalizedMaxError(one, tail), 1e-4)
            << spec;  // other row batching, other rounding
      }
    }
  }
}

TEST(DecodeAttentionTest, SequencesSharingAPrefixReadItOnceAndEachMatchesTheReference) {
  // Six sequences over one cached prefix of three blocks: four hold the prefix's operands, one
  // its own operands over the same bytes (as each decode-node cache parses what it adopts), one
  // only the first two blocks; each then has blocks, sinks and a window of its own, and two are
  // chunked prefill (3 new tokens). A seventh shares nothing.
  ThreadPool pool(2);
  const Shape shapes[] = {{8, 2, 64}, {4, 4, 128}, {16, 2, 64}, {6, 2, 64}, {2, 2, 64}};
  uint64_t seed = 500;
  for (const char* spec : {"fp16", "kivi:k2v2:g32", "kcvt:k4v4", "gear:k2v2:g32:r4:s2",
                           "skvq:k2v2:g32", "tada:k2v2:g32", "zipcache:k2v2:h4:s10", "int8"}) {
    for (const Shape& sh : shapes) {
      auto prefix = MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 0, {64, 32, 37}, 0, ++seed);
      std::vector<std::unique_ptr<TestSequence>> seqs;
      std::vector<std::vector<const BlockOperands*>> blocks;
      std::vector<PreparedBlock> reparsed;
      for (const BlockView& v : prefix->views) {
        reparsed.push_back(*PrepareBlock(v, prefix->calibration.get()));
      }
      for (int i = 0; i < 7; ++i) {
        const uint32_t n = (i == 1 || i == 4) ? 3 : 1;  // query tokens
        auto s = MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, i % 2 ? 4 : 0,
                              i % 3 ? std::vector<uint32_t>{33} : std::vector<uint32_t>{},
                              i == 4 ? 5 : 3 + i % 2, ++seed);
        std::vector<const BlockOperands*> b;
        if (i == 5) {
          for (const PreparedBlock& o : reparsed) {
            for (const BlockOperands& part : o.parts) b.push_back(&part);
          }
        } else if (i == 3) {
          for (size_t k = 0; k < 2; ++k) {
            for (const BlockOperands& part : prefix->ops[k].parts) b.push_back(&part);
          }
        } else if (i != 6) {
          b = prefix->op_ptrs;
        }
        b.insert(b.end(), s->op_ptrs.begin(), s->op_ptrs.end());
        blocks.push_back(b);
        SetQueries(*s, n, sh.q_heads, sh.dim, seed);
        seqs.push_back(std::move(s));
      }
      std::vector<DecodeSequence> batch;
      for (size_t i = 0; i < seqs.size(); ++i) {
        seqs[i]->seq.blocks = blocks[i];
        batch.push_back(seqs[i]->seq);
        batch.back().out = seqs[i]->ref.data();
      }
      const DecodeAttentionParams params{sh.q_heads, sh.kv_heads, sh.dim};
      ASSERT_TRUE(DecodeAttentionRef(params, batch).ok());
      for (const Variant& var : Variants()) {
        for (uint32_t split : {4096u, 50u}) {
          for (size_t i = 0; i < seqs.size(); ++i) batch[i].out = seqs[i]->out.data();
          DecodeAttentionStats stats;
          const absl::Status st = DecodeAttention(params, batch,
                                                  {.impl = var.impl,
                                                   .tokens_per_split = split,
                                                   .pool = &pool,
                                                   .integer_dot = var.integer_dot,
                                                   .stats = &stats});
          ASSERT_TRUE(st.ok()) << st;
          for (size_t i = 0; i < seqs.size(); ++i) {
            // Each sequence's output is what it gets alone (up to the order of the merge), and
            // with the fp32 kernels the reference's. (The integer kernels' error against the
            // reference, normalized by the output's RMS, grows with the tokens averaged; the
            // test above holds it on shorter sequences.)
            std::vector<float> alone(seqs[i]->out.size());
            DecodeSequence one = batch[i];
            one.out = alone.data();
            ASSERT_TRUE(
                DecodeAttention(params, {&one, 1}, {var.impl, split, &pool, var.integer_dot}).ok());
            EXPECT_LT(NormalizedMaxError(seqs[i]->out, alone), 1e-5)
                << spec << " sequence " << i << " q=" << sh.q_heads << " kv=" << sh.kv_heads
                << " impl=" << static_cast<int>(var.impl) << " int8=" << var.integer_dot
                << " split=" << split;
            if (var.integer_dot) continue;
            EXPECT_LT(NormalizedMaxError(seqs[i]->out, seqs[i]->ref), var.tolerance)
                << spec << " sequence " << i << " q=" << sh.q_heads << " kv=" << sh.kv_heads
                << " impl=" << static_cast<int>(var.impl) << " split=" << split;
          }
          // Every (rows, block, head) is attended; the prefix's blocks are read far fewer times.
          uint64_t attended = 0;
          for (size_t i = 0; i < seqs.size(); ++i) {
            const uint32_t rows_per_batch = std::max<uint32_t>(1, 8 / (sh.q_heads / sh.kv_heads));
            const uint32_t batches = (batch[i].query_tokens + rows_per_batch - 1) / rows_per_batch;
            attended += uint64_t{batches} * blocks[i].size() * sh.kv_heads;
          }
          EXPECT_EQ(stats.blocks_attended, attended) << spec;
          // Six sequences share the first two blocks (the one with two takes the third out of
          // the shared prefix); each task reads a shared block once for all its rows, and the
          // rows of one head go to at most two tasks here (two threads).
          const uint64_t shared = prefix->ops[0].parts.size() + prefix->ops[1].parts.size();
          EXPECT_LE(stats.blocks_read + 3 * shared * sh.kv_heads, attended)
              << spec << " q=" << sh.q_heads << " kv=" << sh.kv_heads;
          // Apart, every sequence reads every block it attends (with TaDA's head means, once
          // for all of its query tokens' rows: one task takes every KV head's groups).
          DecodeAttentionStats apart;
          ASSERT_TRUE(DecodeAttention(params, batch,
                                      {.impl = var.impl,
                                       .tokens_per_split = split,
                                       .pool = &pool,
                                       .integer_dot = var.integer_dot,
                                       .share_prefixes = false,
                                       .stats = &apart})
                          .ok());
          uint64_t own_blocks = 0;
          for (size_t i = 0; i < seqs.size(); ++i) own_blocks += blocks[i].size() * sh.kv_heads;
          const bool tada = std::string(spec).rfind("tada", 0) == 0;
          EXPECT_EQ(apart.blocks_read, tada ? own_blocks : attended) << spec;
          EXPECT_EQ(apart.blocks_attended, attended);
        }
      }
    }
  }
}

TEST(DecodeAttentionTest, ShortContextsAreSplitFinerToKeepEveryThreadBusy) {
  // 2048 tokens over 2 KV heads are two 4096-token parts, one per head: on 8 threads the parts
  // shrink until there is a task per thread (8), not below 256 tokens, and never grow past
  // tokens_per_split. The output is the reference's either way.
  auto s = MakeSequence("kivi:k2v2:g32", 8, 2, 64, 0, std::vector<uint32_t>(8, 256), 0, 77);
  const DecodeAttentionParams params{8, 2, 64};
  s->seq.out = s->ref.data();
  ASSERT_TRUE(DecodeAttentionRef(params, {&s->seq, 1}).ok());
  struct Case {
    int threads;
    uint32_t split;
    uint64_t tasks;
  };
  for (const Case& c : {Case{8, 4096, 8}, Case{1, 4096, 2}, Case{4, 4096, 4}, Case{64, 4096, 16},
                        Case{8, 512, 8}, Case{16, 512, 16}, Case{2, 100, 16}}) {
    ThreadPool pool(c.threads);
    DecodeSequence seq = s->seq;
    seq.out = s->out.data();
    DecodeAttentionStats stats;
    ASSERT_TRUE(DecodeAttention(params, {&seq, 1},
                                {.tokens_per_split = c.split, .pool = &pool, .stats = &stats})
                    .ok());
    EXPECT_EQ(stats.tasks, c.tasks) << c.threads << " threads, split " << c.split;
    EXPECT_LT(NormalizedMaxError(s->out, s->ref), 2e-2) << c.threads << " threads";
  }
}

TEST(DecodeAttentionTest, TadaHeadMeansAreReadOncePerBlockForAllKvHeads) {
  // TaDA's head means are one fp16 block shared by every KV head: a task takes all KV heads of
  // a part in turn, so each block's means are read once (not once per KV head), whatever the
  // threads and the part size, and the output is still the reference's.
  uint64_t seed = 900;
  for (const Shape& sh : {Shape{8, 4, 64}, Shape{32, 8, 128}, Shape{4, 2, 64}}) {
    auto s = MakeSequence("tada:k2v2:g32:sink2", sh.q_heads, sh.kv_heads, sh.dim, 2,
                          {64, 64, 37, 64, 5}, 3, ++seed);
    uint64_t with_means = 0;
    for (const BlockOperands* b : s->op_ptrs) with_means += b->mean_ops != nullptr;
    ASSERT_GE(with_means, 5u);  // every chunk's TaDA part (sink parts carry none)
    const DecodeAttentionParams params{sh.q_heads, sh.kv_heads, sh.dim};
    s->seq.out = s->ref.data();
    ASSERT_TRUE(DecodeAttentionRef(params, {&s->seq, 1}).ok());
    for (int threads : {1, 2, 5}) {
      ThreadPool pool(threads);
      for (uint32_t split : {4096u, 100u, 1u}) {
        for (const Variant& var : Variants()) {
          DecodeSequence seq = s->seq;
          seq.out = s->out.data();
          DecodeAttentionStats stats;
          ASSERT_TRUE(DecodeAttention(params, {&seq, 1},
                                      {.impl = var.impl,
                                       .tokens_per_split = split,
                                       .pool = &pool,
                                       .integer_dot = var.integer_dot,
                                       .stats = &stats})
                          .ok());
          EXPECT_EQ(stats.head_means_read, with_means) << threads << " threads, split " << split;
          EXPECT_EQ(stats.blocks_read, s->op_ptrs.size() * sh.kv_heads);
          EXPECT_EQ(stats.blocks_attended, s->op_ptrs.size() * sh.kv_heads);
          EXPECT_LT(NormalizedMaxError(s->out, s->ref), var.tolerance)
              << "kv=" << sh.kv_heads << " impl=" << static_cast<int>(var.impl)
              << " int8=" << var.integer_dot << " split=" << split << " threads=" << threads;
        }
      }
    }
  }
}

// Under a cap on the CPU's features (the CTest entry kernels.decode_attention_avx2_only runs
// these tests with --strata_isa=avx2) the kernels are the capped ones; as dispatched, never the
// 512-bit integer kernels unless selected. SelectIntegerDot takes the paths' names.
TEST(DecodeAttentionTest, TheKernelsFollowTheCapAndTheSelection) {
  const std::string_view path = DecodeAttentionPath();
  if (CpuFeaturesCap() == IsaCap::kAvx2) {
    EXPECT_TRUE(path == "avx2+vpmaddubsw" || path == "portable") << path;
  }
  if (CpuFeaturesCap() == IsaCap::kPortable) {
    EXPECT_EQ(path, "portable");
  }
  EXPECT_NE(path, "avx512-vnni-zmm");
  EXPECT_FALSE(SelectIntegerDot("vnni"));
  EXPECT_EQ(DecodeAttentionPath(), path);
  if (path != "portable") {
    ASSERT_TRUE(SelectIntegerDot("avx2+vpmaddubsw"));
    EXPECT_EQ(std::string_view(DecodeAttentionPath()), "avx2+vpmaddubsw");
    EXPECT_TRUE(SelectIntegerDot("auto"));
    EXPECT_EQ(DecodeAttentionPath(), path);
  }
}

TEST(DecodeAttentionTest, IntegerKernelsAreTheSameBitsOnEveryInstructionSet) {
  // The integer kernels sum the same integers with vpmaddubsw (AVX2), with vpdpbusd / vpdpwssd
  // (VNNI) and in 512-bit registers, then take the same float steps: their outputs are the same
  // bits. The VNNI kernels run here with those two instructions emulated exactly in AVX2, the
  // 512-bit ones with their operations done exactly on two AVX2 registers (zmm_ops.h), so every
  // machine tests their code, and each with the instructions themselves where the CPU has them.
  if (!DecodeAttentionUsesAvx2()) GTEST_SKIP() << "no AVX2: no integer kernels on this CPU";
  struct Reset {
    ~Reset() { internal::SetIntegerIsa(std::nullopt); }
  } reset;
  using internal::IntegerIsa;
  std::vector<IntegerIsa> isas = {IntegerIsa::kEmulatedVnni, IntegerIsa::kEmulatedZmm};
  for (IntegerIsa isa : {IntegerIsa::kAvxVnni, IntegerIsa::kAvx512Vnni, IntegerIsa::kAvx512Zmm}) {
    if (internal::IntegerIsaRuns(isa)) isas.push_back(isa);
  }
  std::printf("integer kernels compared with AVX2's: emulated vnni, emulated zmm%s%s\n",
              internal::IntegerIsaRuns(IntegerIsa::kAvxVnni) ? ", avx-vnni" : "",
              internal::IntegerIsaRuns(IntegerIsa::kAvx512Vnni) ? ", avx512-vnni, avx512 zmm" : "");
  const Shape shapes[] = {{4, 4, 64}, {8, 2, 128}, {16, 2, 64}, {4, 2, 256}, {8, 1, 64}};
  ThreadPool pool(2);
  uint64_t seed = 900;
  for (const char* spec :
       {"kivi:k2v2:g32", "kivi:k3v3:g64", "kivi:k4v4:g32", "kivi:k2v2:g32:m8", "kivi:k8v8:g16",
        "int8", "kcvt:k2v2", "kcvt:k4v4", "skvq:k2v2:g32", "skvq:k4v4:g16:sink2",
        "gear:k2v2:g32:r4:s2:sink2", "tada:k2v2:g32", "zipcache:k2v2:h4:s10"}) {
    for (const Shape& sh : shapes) {
      // Tails of every kind, sinks and a window; the third sequence is chunked prefill.
      std::vector<std::unique_ptr<TestSequence>> seqs;
      seqs.push_back(
          MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 4, {64, 37, 5}, 3, ++seed));
      seqs.push_back(MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 0, {33, 300}, 0, ++seed));
      seqs.push_back(MakeSequence(spec, sh.q_heads, sh.kv_heads, sh.dim, 0, {96}, 4, ++seed));
      SetQueries(*seqs.back(), 3, sh.q_heads, sh.dim, ++seed);
      const DecodeAttentionParams params{sh.q_heads, sh.kv_heads, sh.dim};
      // Every sequence's output under one integer dot product (or none: fp32 query).
      auto run = [&](std::optional<IntegerIsa> isa) {
        std::vector<std::vector<float>> outs;
        std::vector<DecodeSequence> batch;
        for (auto& s : seqs) {
          outs.emplace_back(s->out.size(), NAN);
          batch.push_back(s->seq);
          batch.back().out = outs.back().data();
        }
        EXPECT_TRUE(internal::SetIntegerIsa(isa.value_or(IntegerIsa::kAvx2)));
        const absl::Status st = DecodeAttention(
            params, batch, {AttentionImpl::kAvx2, 40, &pool, /*integer_dot=*/isa.has_value()});
        EXPECT_TRUE(st.ok()) << st;
        return outs;
      };
      const auto avx2 = run(IntegerIsa::kAvx2);
      // The integer kernels ran: the int8 query moves the outputs off the fp32 query's.
      EXPECT_NE(avx2, run(std::nullopt)) << spec << " d=" << sh.dim;
      for (IntegerIsa isa : isas) {
        const auto other = run(isa);
        for (size_t i = 0; i < seqs.size(); ++i) {
          size_t differ = 0;
          for (size_t k = 0; k < other[i].size(); ++k) {
            differ += std::memcmp(&other[i][k], &avx2[i][k], sizeof(float)) != 0;
          }
          EXPECT_EQ(differ, 0u) << spec << " q=" << sh.q_heads << " kv=" << sh.kv_heads
                                << " d=" << sh.dim << " sequence " << i << " isa "
                                << static_cast<int>(isa);
        }
      }
    }
  }
}

TEST(DecodeAttentionTest, BadShapesAreInvalidArgument) {
  auto s = MakeSequence("kivi:k2v2:g32", 8, 2, 64, 0, {32}, 0, 5);
  s->seq.out = s->out.data();
  EXPECT_EQ(DecodeAttention({8, 3, 64}, {&s->seq, 1}).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status st = DecodeAttention({8, 4, 64}, {&s->seq, 1});
  EXPECT_THAT(std::string(st.message()), HasSubstr("has 2 KV heads x 64 dims"));
  DecodeSequence empty = s->seq;
  empty.blocks = {};
  EXPECT_THAT(std::string(DecodeAttention({8, 2, 64}, {&empty, 1}).message()),
              HasSubstr("no tokens"));
  DecodeSequence too_many = s->seq;
  too_many.query_tokens = 2;  // no window to hold the new tokens
  EXPECT_THAT(std::string(DecodeAttention({8, 2, 64}, {&too_many, 1}).message()),
              HasSubstr("2 query tokens but a window of 0"));
  DecodeSequence no_q = s->seq;
  no_q.q = nullptr;
  EXPECT_EQ(DecodeAttentionRef({8, 2, 64}, {&no_q, 1}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kernels
