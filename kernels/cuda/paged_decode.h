// Fused decode attention on the GPU over paged KV: one new query token per sequence, a batch of
// sequences, each with a block table of pages. A page is a block of the Strata block format, read
// in place (PagedKvLayout). Two codings share one kernel structure:
//
//   fp16   the baseline (what fp16 users get): K and V as fp16 [page_tokens][head_dim] per KV head.
//   general  any other codec (PageFormat::kGeneral): see PageFormat.
//   affine KIVI-style codes of 2 or 4 bits, streamed as they are stored and dequantized in
//          registers: K per channel over groups of `k_group` tokens (an fp16 scale and zero per
//          channel and group), V per token over groups of `v_group` channels (an fp16 scale and
//          zero per token and group). Per-channel key scales are folded into the query once per
//          group (q'_c = q_c * scale_c, plus one bias Σ q_c * zero_c), value scales into the
//          probabilities once per token and group: no per-element conversion with a scale.
//
// Each sequence may also have a full-precision window (its newest tokens, fp16, [window][head_dim]
// per KV head), attended after its pages, as the CPU kernels do.
//
// GQA: one thread block per (sequence, KV head, split) streams the split's pages through shared
// memory (cp.async, several tiles in flight), each page's bytes read from device memory once for
// all the group's query heads; splits along the sequence (flash-decoding) are merged by their
// log-sum-exp in a second kernel. Two kernels: on the tensor cores (paged_decode_mma.cuh: four
// warps over 16-token slices, the group's heads as rows of mma.sync products) for tiles of
// 16-token multiples, key groups of 16-token multiples and value groups of 32-channel multiples;
// otherwise, or when asked (PagedDecodeArgs::kernel), one warp per query head.
//
// Device memory is the caller's: every pointer below is a device pointer. Launches go on `stream`
// and report launch errors (cudaGetLastError) as absl::Status; they do not synchronize.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

#ifdef __CUDACC__
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata::kernels::cuda {

STRATA_HOST_DEVICE inline size_t Align16(size_t n) { return (n + 15) / 16 * 16; }

// kGeneral: any codec's block (page_desc.h), each page read through its descriptor and decoded
// element by element into shared memory by the CPU reference's arithmetic, then attended at fp32
// (one kernel for every codec; the fp16 and affine kernels are the fast paths).
enum class PageFormat { kFp16, kAffine, kGeneral };

struct PageDesc;

// A page is one block of the Strata block format (common/block_format.h) copied into device memory
// as it is: the kernels read its sections in place, and a block moves between host and device by a
// plain copy. block_pages.h derives the layout from a block. Each section holds every KV head, head
// h's part at the section's offset plus h times the part's bytes (T = page_tokens, D = head_dim):
//
//   affine  key codes [H][T][D * key_bits / 8], key scales and key zeros [H][T / k_group][D] half,
//           value codes [H][T][D * value_bits / 8], value scales and zeros [H][T][D / v_group] half
//   fp16    key codes: the keys [H][T][D] half; value codes: the values [H][T][D] half
//
// The kernels stream a page through shared memory TileTokens() tokens at a time (the whole page up
// to 128 tokens, 64-token slices of longer ones), each KV head's parts of a slice packed one after
// another there.
struct PagedKvLayout {
  PageFormat format = PageFormat::kFp16;
  int kv_heads = 8;
  int head_dim = 128;     // 64 or 128
  int page_tokens = 64;   // tokens per page: a multiple of 8 up to 128, or of 64 up to 512
  int key_bits = 4;       // affine: 2 or 4
  int value_bits = 4;     // affine: 2 or 4
  int k_group = 32;       // affine: tokens per key scale group (divides page_tokens)
  int v_group = 32;       // affine: channels per value scale group (divides head_dim)
  // Where the sections start, in bytes from the page's first byte (multiples of 16; fp16 pages use
  // key_codes and value_codes only), and the pages' stride in the pool (a multiple of 16 that holds
  // every section).
  uint32_t key_codes = 0, key_scales = 0, key_zeros = 0;
  uint32_t value_codes = 0, value_scales = 0, value_zeros = 0;
  uint32_t page_bytes = 0;
  // kGeneral pools whose every page is CQ (block_pages.h sets these; CheckPage holds every page
  // to them): K and V as codes of `codebook_bits` (4..8) over runs of `codebook_group` (2, 4 or 8)
  // channels, with or without a per-token norm, no other term; parts of plain fp16 (attention
  // sinks) beside them. The codebook kernel reads such pools (PagedKernel::kAuto): scores by
  // table lookups, values by centroid sums, no element decoded. 0: any general pool.
  int codebook_group = 0;
  int codebook_bits = 0;

  absl::Status Validate() const;

  // Bytes of one KV head's part of each section.
  STRATA_HOST_DEVICE size_t KeyCodeBytes() const {
    return static_cast<size_t>(page_tokens) * head_dim *
           (format == PageFormat::kFp16 ? 16 : key_bits) / 8;
  }
  STRATA_HOST_DEVICE size_t ValueCodeBytes() const {
    return static_cast<size_t>(page_tokens) * head_dim *
           (format == PageFormat::kFp16 ? 16 : value_bits) / 8;
  }
  STRATA_HOST_DEVICE size_t KeyMetaBytes() const {  // scales, and zeros
    return static_cast<size_t>(page_tokens / k_group) * head_dim * 2;
  }
  STRATA_HOST_DEVICE size_t ValueMetaBytes() const {
    return static_cast<size_t>(page_tokens) * (head_dim / v_group) * 2;
  }
  // Where KV head h's part of each section starts, from the page's first byte.
  STRATA_HOST_DEVICE size_t KeyCodesOf(int h) const { return key_codes + h * KeyCodeBytes(); }
  STRATA_HOST_DEVICE size_t KeyScalesOf(int h) const { return key_scales + h * KeyMetaBytes(); }
  STRATA_HOST_DEVICE size_t KeyZerosOf(int h) const { return key_zeros + h * KeyMetaBytes(); }
  STRATA_HOST_DEVICE size_t ValueCodesOf(int h) const { return value_codes + h * ValueCodeBytes(); }
  STRATA_HOST_DEVICE size_t ValueScalesOf(int h) const {
    return value_scales + h * ValueMetaBytes();
  }
  STRATA_HOST_DEVICE size_t ValueZerosOf(int h) const { return value_zeros + h * ValueMetaBytes(); }
  STRATA_HOST_DEVICE size_t PageBytes() const { return page_bytes; }
  // Tokens staged at a time: the page up to 128 tokens, else 64.
  STRATA_HOST_DEVICE int TileTokens() const { return page_tokens <= 128 ? page_tokens : 64; }
};

// Codes pack low bits first: code i of a row sits in byte i * bits / 8 at bit (i * bits) % 8.
// A dequantized key is k = scale * code + zero (fp32 arithmetic on the fp16 scale and zero).

// Which kernel runs: the tensor cores' where the layout allows (kAuto), or the one-warp-per-query-
// head kernel everywhere (kSimt: the tests run both; benchmarks compare them). On a codebook pool
// (PagedKvLayout::codebook_group), kAuto runs the codebook kernel and kSimt the general one.
// kMmaFourBlocks: kAuto with the tensor-core kernel's registers capped for four blocks per
// multiprocessor instead of three on affine pages (more warps, some spills), for benchmarks to
// compare.
enum class PagedKernel { kAuto, kSimt, kMmaFourBlocks };

struct PagedDecodeArgs {
  const uint8_t* pages = nullptr;      // the page pool: page p at pages + p * PageBytes()
  const int32_t* block_table = nullptr;  // [batch][max_pages]: page ids
  int max_pages = 0;                     // block_table's row length
  const int32_t* page_counts = nullptr;  // [batch]: full pages of each sequence
  // [batch][kv_heads][max_window][head_dim], or null; with window_slots, sequence i's window is
  // row window_slots[i] of a pool [slots][kv_heads][max_window][head_dim].
  const __half* window_k = nullptr;
  const __half* window_v = nullptr;
  const int32_t* window_lens = nullptr;  // [batch], or null (no window)
  int max_window = 0;
  const int32_t* window_slots = nullptr;  // [batch], or null (sequence i: row i)
  const float* q = nullptr;              // [batch][q_heads][head_dim]
  int batch = 0;
  int q_heads = 32;                      // a multiple of kv_heads; q_heads / kv_heads <= 8
  float scale = 0;                       // softmax scale; 0: 1 / sqrt(head_dim)
  float* out = nullptr;                  // [batch][q_heads][head_dim]
  // Flash-decoding: each sequence's pages split across up to `splits` blocks (0: chosen from the
  // batch size and the device's multiprocessors). The merge needs `workspace` of
  // WorkspaceBytes(batch, q_heads, head_dim, splits) bytes.
  int splits = 0;
  void* workspace = nullptr;
  PagedKernel kernel = PagedKernel::kAuto;
  // PageFormat::kGeneral: the pool's distinct descriptors, the descriptor of each page (by page
  // id), and the calibration constants they address (block_pages.h PageConstants; may be null
  // when no descriptor addresses any).
  const PageDesc* page_descs = nullptr;
  const uint16_t* page_desc_ids = nullptr;
  const uint8_t* constants = nullptr;
};

size_t WorkspaceBytes(int batch, int q_heads, int head_dim, int splits);
// Whether PagedDecode runs the codebook kernel for `layout` and `args` on the current device (a
// codebook pool, PagedKernel::kAuto, and shared memory for at least one query head's table).
bool RunsCodebookKernel(const PagedKvLayout& layout, const PagedDecodeArgs& args);
// The split count PagedDecode uses for `args` (splits == 0) on the current device.
int ChooseSplits(const PagedKvLayout& layout, const PagedDecodeArgs& args, int max_pages_in_batch);

// Runs the decode attention. INVALID_ARGUMENT for an unsupported layout or arguments, INTERNAL
// for a CUDA launch error.
absl::Status PagedDecode(const PagedKvLayout& layout, const PagedDecodeArgs& args,
                         int max_pages_in_batch, cudaStream_t stream);

}  // namespace strata::kernels::cuda
