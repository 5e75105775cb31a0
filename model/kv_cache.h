// SequenceKvCache: one sequence's KV cache across all layers, the way a decode node keeps it:
// compressed blocks (one per full chunk of C tokens and layer, in the Strata block format) and a
// full-precision window of the newest tokens. When the window holds a full chunk beyond its
// minimum size (`window_tokens`), the codec compresses the oldest chunk into a block (GEAR's
// streaming buffer, SKVQ's sliding window, KIVI's residual). Attention sinks — the first tokens
// of the sequence at full precision — are the codec's `sinkN` option: they travel inside chunk
// 0's block (as its fp16 part), so a store or a peer gets them with the prefix.
//
// A cached prefix can be adopted as blocks (AdoptBlock) — prefix reuse — and the model then
// prefills only the suffix on top of it.
//
// Serving hooks: a prefill node compresses each layer's new full chunks as soon as that layer
// is computed (CompressLayer, from the model's per-layer hook) and ships them while later layers
// still compute; Commit then takes those blocks instead of encoding again. A sequence moves
// between nodes as its blocks (SharedBytes, never copied) plus its window (ExportWindow /
// ImportWindow: the partial last chunk at full precision, so the receiving node continues
// exactly where the sender stopped).
//
// The CPU backend's KvCache (compute_backend.h). Not thread-safe; one cache per sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/aligned_buffer.h"
#include "common/block_reader.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "kernels/block_operands.h"
#include "kernels/codec.h"
#include "kernels/decode_attention.h"
#include "kernels/rotation.h"
#include "model/compute_backend.h"

namespace strata::model {

struct KvCacheOptions {
  std::string codec = "fp16";   // codec spec for the blocks
  uint32_t chunk_tokens = 256;  // tokens per block
  uint32_t window_tokens = 0;   // newest tokens always kept at full precision (besides the
                                // partial chunk), as SKVQ's sliding window
  uint64_t model_fingerprint = 0;
  // For codecs that need one (SKVQ); blocks made with it are read back with it.
  std::shared_ptr<const kernels::Calibration> calibration = nullptr;
  absl::Status Validate() const;
};

class SequenceKvCache final : public KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<SequenceKvCache>> Create(const KvCacheOptions& options,
                                                                 uint32_t layers, uint32_t kv_heads,
                                                                 uint32_t head_dim);

  Device device() const override { return Device{}; }
  uint32_t tokens() const override { return tokens_; }  // every token cached, blocks + window
  uint32_t window_tokens() const override { return window_tokens_; }
  size_t blocks_per_layer() const override { return layers_.empty() ? 0 : layers_[0].ops.size(); }
  // Bytes of all blocks (every layer), as a store would hold them.
  size_t block_bytes() const override;
  // Seconds spent compressing chunks into blocks (the codec's Encode), over the cache's life.
  double encode_seconds() const override { return encode_seconds_; }

  // Appends `n` tokens of one layer to its window: k, v [n, kv_heads, head_dim], and their
  // queries q [n, q_heads, head_dim] (kept only when the codec uses them: ZipCache's probes; may
  // be null), all rotated first when the layer's codec rotates (rotation()). Every layer must
  // receive the same tokens before Commit.
  void AppendWindow(uint32_t layer, const float* k, const float* v, uint32_t n,
                    const float* q = nullptr, uint32_t q_heads = 0);
  // Accounts the appended tokens and compresses every full chunk of the window into blocks.
  // All or nothing: on an error the appended tokens are discarded and the cache is as before.
  absl::Status Commit(uint32_t n);
  // Drops tokens appended since the last Commit (a failed step), and blocks CompressLayer made
  // for them.
  void DiscardUncommitted();

  // Compresses now the full chunks that the next Commit would make for `layer` (every token
  // appended to it since the last Commit counted) and returns them, oldest first; Commit then
  // adopts these instead of encoding them again. Call once per layer per step, after the
  // layer's AppendWindow. Returns no blocks when no chunk fills. Errors are the codec's.
  absl::StatusOr<std::vector<SharedBytes>> CompressLayer(uint32_t layer) override;

  // Adds an already-compressed block for the next chunk of `layer` (a cached prefix). The
  // block must be that layer's next chunk, of chunk_tokens tokens, made by the cache's codec for
  // this model (when the cache has a model fingerprint); kInvalidArgument / kDataLoss otherwise.
  // `checksum_verified`: the bytes' CRC was verified where they arrived in this process (the
  // transport's receiver, the store's Get): the structure is still checked, the CRC is not
  // computed again. All layers of a chunk must be adopted before CommitAdopted.
  absl::Status AdoptBlock(uint32_t layer, SharedBytes block,
                          bool checksum_verified = false) override;
  absl::Status AdoptBlock(uint32_t layer, AlignedBuffer block) {
    return AdoptBlock(layer, SharedBytes::FromBuffer(std::move(block)));
  }
  absl::Status CommitAdopted() override;

  // The window of `layer` (the committed tokens not in blocks) as bytes, for another node's
  // ImportWindow: a 32-byte header (magic "SKVW", version, layer, tokens, kv heads, head dim,
  // query heads) then K, V [tokens, kv_heads, head_dim] and the queries [tokens, q_heads,
  // head_dim] when the codec keeps them, fp32 little-endian.
  std::string ExportWindow(uint32_t layer) const override;
  // Installs an exported window for `layer` after the adopted blocks (no window yet, every
  // layer's the same length); then CommitWindow accounts its tokens. kInvalidArgument naming
  // the field for bytes that are not a window of this cache's shape; kFailedPrecondition when
  // the cache already has a window or uncommitted tokens.
  absl::Status ImportWindow(uint32_t layer, absl::Span<const uint8_t> bytes) override;
  absl::Status CommitWindow() override;
  // Forgets every block and window: the cache is empty again (a sequence preempted to the
  // store, resumed later by adoption).
  void Clear() override;

  // The attention input for `layer`: blocks + window (the window's last query_tokens are new).
  kernels::DecodeSequence View(uint32_t layer) const;

  // The rotation stage of `layer` (its codec spec's `rot`, kernels/rotation.h), or null. A rotated
  // layer holds K and V rotated, window and blocks: AppendWindow rotates what it is given, and
  // whoever attends over View must rotate the queries and invert the rotation of the output.
  const kernels::HadamardRotation* rotation(uint32_t layer) const {
    return layers_[layer].rotation.has_value() ? &*layers_[layer].rotation : nullptr;
  }

  // The blocks of one layer, for a store or the transport.
  const std::vector<SharedBytes>& layer_blocks(uint32_t layer) const override {
    return layers_[layer].buffers;
  }
  uint32_t layers() const override { return static_cast<uint32_t>(layers_.size()); }
  // What a store names layer `layer`'s block of the chunk keyed `key`: this model's and the
  // calibration's fingerprints, and the codec fingerprint that layer's blocks carry (per-layer
  // codecs such as the Strata mix carry their layer's own).
  BlockName NameOf(uint32_t layer, const BlockHash& key) const override;
  // Every layer's codec fingerprint, in layer order (for a store's Lookup).
  std::vector<uint64_t> LayerCodecFingerprints() const override;
  const KvCacheOptions& options() const override { return options_; }

 private:
  struct Layer {
    std::vector<SharedBytes> buffers;
    std::vector<BlockView> views;
    std::vector<std::unique_ptr<kernels::PreparedBlock>> ops;
    std::vector<const kernels::BlockOperands*> blocks;  // every part of every block
    std::vector<float> window_k, window_v;              // [window, kv_heads, head_dim]
    std::vector<float> window_q;  // [window, q_heads, head_dim] when the codec wants it
    uint32_t q_heads = 0;
    std::vector<SharedBytes> pending;  // CompressLayer's blocks for the next Commit
    std::optional<kernels::HadamardRotation> rotation;  // the layer's codec rotates (`rot`)
  };
  SequenceKvCache() = default;
  absl::Status AddBlock(Layer& l, SharedBytes block, bool checksum_verified);
  // Encodes the full chunks of layer `li`'s window (its first `window` tokens) from token 0.
  absl::StatusOr<std::vector<SharedBytes>> EncodeChunks(uint32_t li, uint32_t window) const;

  KvCacheOptions options_;
  std::unique_ptr<kernels::Codec> codec_;
  uint32_t kv_heads_ = 0, head_dim_ = 0;
  uint32_t tokens_ = 0, window_tokens_ = 0;
  std::vector<Layer> layers_;
  mutable double encode_seconds_ = 0;
};

}  // namespace strata::model
