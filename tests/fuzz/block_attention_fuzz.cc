// libFuzzer target for everything a decode node does with a block it received: parse it,
// prepare its operands (codec-level validation), decode it, and attend over it with the
// portable and the AVX2 kernels (the integer ones with every integer dot product the CPU runs,
// emulated VNNI and AVX-512 included). Whatever the bytes, no step may crash or read out of bounds;
// a block PrepareBlock accepts must be safe to hand to the kernels.
//
// The custom mutator reseals the CRC-32C so the fuzzer gets past the checksum and into the
// codec-specific checks.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/block_reader.h"
#include "common/crc32c.h"
#include "common/endian.h"
#include "common/thread_pool.h"
#include "kernels/block_operands.h"
#include "kernels/decode_attention.h"
#include "kernels/internal/attention_segment.h"
#include "tests/fuzz/fuzz_calibration.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if ((seed & 3) != 0 && size >= 16) {
    strata::StoreLE<uint32_t>(data + 4, strata::Crc32c(data + 8, size - 8));
  }
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::kernels;
  absl::StatusOr<strata::BlockView> view =
      strata::BlockView::Parse(absl::MakeConstSpan(data, size));
  if (!view.ok()) return 0;
  // Blocks made with the seeds' calibration (CQ's codebooks) reach the codec checks and kernels.
  const Calibration* cal = &strata::fuzz::CqCalibration();
  absl::StatusOr<PreparedBlock> ops = PrepareBlock(*view, cal);
  if (!ops.ok()) {
    if (ops.status().message().empty()) __builtin_trap();
    return 0;
  }
  const uint64_t n = uint64_t{ops->tokens} * ops->kv_heads * ops->head_dim;
  if (n > (1u << 20)) return 0;  // keep each run fast; larger blocks add nothing new
  std::vector<float> k(n), v(n);
  if (!DecodePreparedRef(*ops, k.data(), v.data()).ok()) __builtin_trap();
  if (ops->parts.empty()) return 0;
  static strata::ThreadPool pool(1);
  const uint32_t q_heads = ops->kv_heads * 2;
  std::vector<float> q(size_t{q_heads} * ops->head_dim, 0.5f), out(q.size());
  std::vector<const BlockOperands*> ptrs;
  for (const BlockOperands& p : ops->parts) ptrs.push_back(&p);
  DecodeSequence seq;
  seq.q = q.data();
  seq.blocks = ptrs;
  seq.out = out.data();
  const DecodeAttentionParams params{q_heads, ops->kv_heads, ops->head_dim};
  // A second sequence over the same bytes (its own operands, as another cache would parse
  // them) then the block again: the batch shares a prefix, which is read once for both.
  absl::StatusOr<PreparedBlock> again = PrepareBlock(*view, cal);
  if (!again.ok()) __builtin_trap();
  std::vector<const BlockOperands*> ptrs2;
  for (const BlockOperands& p : again->parts) ptrs2.push_back(&p);
  for (const BlockOperands& p : ops->parts) ptrs2.push_back(&p);
  std::vector<float> out2(q.size());
  DecodeSequence seq2 = seq;
  seq2.blocks = ptrs2;
  seq2.out = out2.data();
  const DecodeSequence batch[] = {seq, seq2};
  auto attend = [&](AttentionImpl impl, bool integer_dot) {
    if (!DecodeAttention(params, {&seq, 1}, {impl, 4096, &pool, integer_dot}).ok()) {
      __builtin_trap();
    }
    if (!DecodeAttention(params, batch, {impl, 4096, &pool, integer_dot}).ok()) __builtin_trap();
  };
  attend(AttentionImpl::kPortable, false);
  if (!DecodeAttentionUsesAvx2()) return 0;
  attend(AttentionImpl::kAvx2, false);  // the fp32 kernels
  // The integer kernels of every instruction set this CPU runs, emulated ones included.
  using internal::IntegerIsa;
  for (IntegerIsa isa :
       {IntegerIsa::kAvx2, IntegerIsa::kAvxVnni, IntegerIsa::kAvx512Vnni, IntegerIsa::kAvx512Zmm,
        IntegerIsa::kEmulatedVnni, IntegerIsa::kEmulatedZmm}) {
    if (internal::SetIntegerIsa(isa)) attend(AttentionImpl::kAvx2, true);
  }
  internal::SetIntegerIsa(std::nullopt);
  return 0;
}
