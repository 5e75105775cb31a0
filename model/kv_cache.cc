#include "model/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace strata::model {

absl::Status KvCacheOptions::Validate() const {
  if (chunk_tokens < 1 || chunk_tokens > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: chunk_tokens ", chunk_tokens, " outside [1, 65536]"));
  }
  if (window_tokens > 1u << 20) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: window_tokens ", window_tokens, " beyond 2^20"));
  }
  return kernels::CodecSpec::Parse(codec).status();
}

absl::StatusOr<std::unique_ptr<SequenceKvCache>> SequenceKvCache::Create(
    const KvCacheOptions& options, uint32_t layers, uint32_t kv_heads, uint32_t head_dim) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (layers == 0 || kv_heads == 0 || head_dim == 0) {
    return absl::InvalidArgumentError("kv cache: layers, kv_heads and head_dim must be positive");
  }
  std::unique_ptr<SequenceKvCache> c(new SequenceKvCache());
  c->options_ = options;
  STRATA_ASSIGN_OR_RETURN(c->codec_, kernels::Codec::Create(options.codec, options.calibration));
  c->kv_heads_ = kv_heads;
  c->head_dim_ = head_dim;
  c->layers_.resize(layers);
  return c;
}

size_t SequenceKvCache::block_bytes() const {
  size_t n = 0;
  for (const Layer& l : layers_) {
    for (const AlignedBuffer& b : l.buffers) n += b.size();
  }
  return n;
}

void SequenceKvCache::AppendWindow(uint32_t layer, const float* k, const float* v, uint32_t n,
                                   const float* q, uint32_t q_heads) {
  Layer& l = layers_[layer];
  const size_t row = size_t{kv_heads_} * head_dim_;
  l.window_k.insert(l.window_k.end(), k, k + n * row);
  l.window_v.insert(l.window_v.end(), v, v + n * row);
  if (codec_->wants_queries() && q != nullptr && q_heads > 0 &&
      (l.window_q.empty() || q_heads == l.q_heads)) {
    l.q_heads = q_heads;
    l.window_q.insert(l.window_q.end(), q, q + size_t{n} * q_heads * head_dim_);
  }
}

absl::Status SequenceKvCache::AddBlock(Layer& l, AlignedBuffer block) {
  STRATA_ASSIGN_OR_RETURN(BlockView view, BlockView::Parse(block.span()));
  STRATA_ASSIGN_OR_RETURN(kernels::PreparedBlock ops,
                          kernels::PrepareBlock(view, options_.calibration.get()));
  if (ops.kv_heads != kv_heads_ || ops.head_dim != head_dim_) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: block of ", ops.kv_heads, "x",
                                                   ops.head_dim, ", cache is ", kv_heads_, "x",
                                                   head_dim_));
  }
  l.buffers.push_back(std::move(block));
  l.views.push_back(view);
  l.ops.push_back(std::make_unique<kernels::PreparedBlock>(std::move(ops)));
  for (const kernels::BlockOperands& part : l.ops.back()->parts) l.blocks.push_back(&part);
  return absl::OkStatus();
}

void SequenceKvCache::DiscardUncommitted() {
  const size_t keep = size_t{window_tokens_} * kv_heads_ * head_dim_;
  for (Layer& l : layers_) {
    l.window_k.resize(keep);
    l.window_v.resize(keep);
    if (!l.window_q.empty()) {
      l.window_q.resize(std::min(l.window_q.size(), size_t{window_tokens_} * l.q_heads * head_dim_));
    }
  }
}

absl::Status SequenceKvCache::Commit(uint32_t n) {
  const uint32_t c = options_.chunk_tokens;
  const size_t row = size_t{kv_heads_} * head_dim_;
  for (const Layer& l : layers_) {
    if (l.window_k.size() != (size_t{window_tokens_} + n) * row) {
      DiscardUncommitted();
      return absl::FailedPreconditionError(
          "kv cache: every layer must receive the same new tokens before Commit");
    }
  }
  // Encode every full chunk of every layer first; the cache changes only if all succeed.
  uint32_t window = window_tokens_ + n;
  std::vector<std::vector<AlignedBuffer>> encoded(layers_.size());
  for (uint32_t done = 0; window - done >= c + options_.window_tokens; done += c) {
    const uint32_t chunk = static_cast<uint32_t>(layers_[0].ops.size() + done / c);
    for (uint32_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      kernels::KvChunkView view{l.window_k.data() + done * row, l.window_v.data() + done * row,
                                SourceDType::kFloat32, c, kv_heads_, head_dim_};
      const size_t q_row = size_t{l.q_heads} * head_dim_;
      if (l.q_heads > 0 && l.window_q.size() >= (done + c) * q_row) {
        view.q = l.window_q.data() + done * q_row;
        view.q_heads = l.q_heads;
      }
      absl::StatusOr<AlignedBuffer> block = codec_->Encode(
          view,
          {.layer = li, .chunk_index = chunk, .model_fingerprint = options_.model_fingerprint});
      if (!block.ok()) {
        DiscardUncommitted();
        return block.status();
      }
      encoded[li].push_back(*std::move(block));
    }
  }
  const uint32_t consumed = static_cast<uint32_t>(encoded[0].size()) * c;
  for (uint32_t li = 0; li < layers_.size(); ++li) {
    Layer& l = layers_[li];
    for (AlignedBuffer& b : encoded[li]) {
      absl::Status s = AddBlock(l, std::move(b));
      if (!s.ok()) return s;  // our own codec's output failed to parse: a bug, not bad input
    }
    l.window_k.erase(l.window_k.begin(), l.window_k.begin() + consumed * row);
    l.window_v.erase(l.window_v.begin(), l.window_v.begin() + consumed * row);
    const size_t q_consumed = std::min(l.window_q.size(), consumed * size_t{l.q_heads} * head_dim_);
    l.window_q.erase(l.window_q.begin(), l.window_q.begin() + q_consumed);
  }
  tokens_ += n;
  window_tokens_ = window - consumed;
  return absl::OkStatus();
}

absl::Status SequenceKvCache::AdoptBlock(uint32_t layer, AlignedBuffer block) {
  if (window_tokens_ != 0) {
    return absl::FailedPreconditionError("kv cache: blocks can only be adopted before any window");
  }
  if (layer >= layers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: layer ", layer, " of ", layers_.size()));
  }
  STRATA_ASSIGN_OR_RETURN(BlockView view, BlockView::Parse(block.span()));
  const BlockHeader& h = view.header();
  const Layer& l = layers_[layer];
  const std::string want = codec_->LayerSpec(layer);
  if (h.codec_spec != want) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: block of codec '", h.codec_spec,
                                                   "', the cache uses '", want, "'"));
  }
  if (h.layer != layer || h.chunk_index != l.ops.size() || h.token_count != options_.chunk_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: block is layer ", h.layer, " chunk ", h.chunk_index, " of ", h.token_count,
        " tokens; expected layer ", layer, " chunk ", l.ops.size(), " of ", options_.chunk_tokens));
  }
  if (options_.model_fingerprint != 0 && h.model_fingerprint != options_.model_fingerprint) {
    return absl::InvalidArgumentError("kv cache: block was made by another model");
  }
  return AddBlock(layers_[layer], std::move(block));
}

absl::Status SequenceKvCache::CommitAdopted() {
  const size_t n = layers_[0].ops.size();
  for (const Layer& l : layers_) {
    if (l.ops.size() != n) {
      return absl::FailedPreconditionError("kv cache: layers adopted different numbers of blocks");
    }
  }
  uint32_t tokens = 0;
  for (const auto& b : layers_[0].ops) tokens += b->tokens;
  tokens_ = tokens;
  return absl::OkStatus();
}

kernels::DecodeSequence SequenceKvCache::View(uint32_t layer) const {
  const Layer& l = layers_[layer];
  kernels::DecodeSequence s;
  s.blocks = l.blocks;
  // The window as appended so far (it may hold tokens not yet committed: the new ones).
  s.window = {l.window_k.data(), l.window_v.data(),
              static_cast<uint32_t>(l.window_k.size() / (size_t{kv_heads_} * head_dim_))};
  return s;
}

}  // namespace strata::model
