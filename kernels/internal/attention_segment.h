// Internal to kernels/: the per-segment work of fused decode attention, shared by the portable
// and AVX2 implementations. A segment is the sinks, one block, or the window.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/block_operands.h"
#include "kernels/decode_attention.h"

namespace strata::kernels::internal {

// One KV head's slice of a segment, either full precision or a compressed block.
struct Segment {
  // Full precision: rows at k + t * stride (stride = kv_heads * head_dim).
  const float* k = nullptr;
  const float* v = nullptr;
  uint32_t stride = 0;
  // Compressed: the block and this KV head.
  const BlockOperands* block = nullptr;
  uint32_t head = 0;
  uint32_t tokens = 0;
};

// Running online-softmax state of the G query heads of one KV head.
struct HeadGroupState {
  uint32_t g = 0, d = 0;
  std::vector<float> q;       // [G, D], pre-scaled by the softmax scale
  std::vector<float> m;       // [G] running max
  std::vector<float> l;       // [G] running sum of exp
  std::vector<float> acc;     // [G, D] unnormalized output
  std::vector<float> scores;  // [G, tokens of the current segment] scratch
  std::vector<float> work;    // scratch for the kernels: take it with Work
  bool integer_dot = false;    // DecodeAttentionOptions::integer_dot (AVX2 kernels)
  // CQ (codebook) blocks. Every block of a layer is coded against the same codebook, so the
  // work that depends on it, not on the tokens, is done once per call, not once per block:
  // k_lut: the query rows' dot products with every centroid of the keys' codebook k_lut_book
  // (one float per row, run and centroid, in chunks of rows: decode_attention.cc, "CQ's tables"),
  // made by the first block and reused by the rest; v_mass: the probability mass each centroid of
  // the values' codebook v_mass_book has received so far (laid out as k_lut),
  // rescaled with acc at each softmax step and added to acc as centroids once
  // (FlushCodebookMass), when the codebook changes or the rows are done.
  const uint16_t* k_lut_book = nullptr;
  std::vector<float> k_lut;
  const uint16_t* v_mass_book = nullptr;
  uint32_t v_runs = 0, v_group = 0, v_bits = 0;
  std::vector<float> v_mass;
  std::vector<float>
      v_mass_scale;  // [G]: row j's mass is v_mass's times this (RescaleCodebookMass)

  // The first n floats of work, unspecified values. Grown, never shrunk: the kernels of one
  // segment ask for different sizes, and a resize up would zero-fill at every segment.
  float* Work(size_t n) {
    if (work.size() < n) work.resize(n);
    return work.data();
  }
};

// Scores of every token of the segment for the G query heads, into state.scores ([G, T]).
using ScoreFn = void (*)(const Segment& seg, HeadGroupState& st);
// Adds sum_t p[j][t] * v_t to state.acc, with p in state.scores ([G, T]).
using AccumulateFn = void (*)(const Segment& seg, HeadGroupState& st);

// Online-softmax step for a segment of T tokens: updates m, l, rescales acc, and turns
// state.scores into probabilities exp(s - m).
using SoftmaxFn = void (*)(uint32_t tokens, HeadGroupState& st);

void SoftmaxPortable(uint32_t tokens, HeadGroupState& st);
void SoftmaxAvx2(uint32_t tokens, HeadGroupState& st);

void ScoresPortable(const Segment& seg, HeadGroupState& st);
// Adds the values' codebook mass gathered so far (HeadGroupState::v_mass) to acc as centroids.
void FlushCodebookMass(HeadGroupState& st);
// Multiplies row j of the values' codebook mass by alpha[j] (the softmax step's rescale of acc).
void RescaleCodebookMass(HeadGroupState& st, const float* alpha);
void AccumulatePortable(const Segment& seg, HeadGroupState& st);

// AVX2 versions; nullptr-equivalent fallbacks to the portable ones for layouts they do not
// specialize. Defined in decode_attention_avx2.cc (compiled with -mavx2 -mfma -mf16c).
void ScoresAvx2(const Segment& seg, HeadGroupState& st);

// Which integer dot product the AVX2 kernels' integer paths (keys and values) use on this CPU.
// kAvx512Vnni runs the VNNI kernels on 256-bit registers; kAvx512Zmm the 2- and 4-bit keys and
// values on 512-bit ones (the rest as kAvx512Vnni), picked only when asked for
// (SelectIntegerDot, codec_bench --integer_dot avx512-vnni-zmm) until a machine with AVX-512 has
// measured it against kAvx512Vnni.
// kEmulatedVnni and kEmulatedZmm are never picked: they run the VNNI kernels with vpdpbusd /
// vpdpwssd done exactly in AVX2, and the 512-bit ones with each AVX-512 operation done exactly on
// two AVX2 registers (zmm_ops.h), so that machines without VNNI or AVX-512 test their code
// (SetIntegerIsa).
enum class IntegerIsa { kAvx2, kAvxVnni, kAvx512Vnni, kEmulatedVnni, kAvx512Zmm, kEmulatedZmm };
IntegerIsa IntegerDotIsa();
// Whether this CPU runs `isa`'s kernels.
bool IntegerIsaRuns(IntegerIsa isa);
// Makes IntegerDotIsa return `isa` (nullopt: the CPU's best again), for tests and
// SelectIntegerDot; false, changing nothing, when the CPU cannot run it. Not for use while
// attention runs on other threads.
bool SetIntegerIsa(std::optional<IntegerIsa> isa);
void AccumulateAvx2(const Segment& seg, HeadGroupState& st);

struct Kernels {
  ScoreFn scores;
  SoftmaxFn softmax;
  AccumulateFn accumulate;
};

// Shape checks and the softmax scale, shared by the fused kernels and the reference.
absl::Status ValidateAttention(const DecodeAttentionParams& p,
                               absl::Span<const DecodeSequence> batch);
float SoftmaxScale(const DecodeAttentionParams& p);

// Low-rank and outlier corrections, common to both implementations.
void AddScoreCorrections(const Segment& seg, HeadGroupState& st);
void AddValueCorrections(const Segment& seg, HeadGroupState& st);

}  // namespace strata::kernels::internal
