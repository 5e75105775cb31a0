#include "model/kv_cache.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "kernels/codec_spec.h"

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
  for (uint32_t l = 0; l < layers; ++l) {
    const std::string spec = c->codec_->LayerSpec(l);
    STRATA_ASSIGN_OR_RETURN(const kernels::CodecSpec parsed, kernels::CodecSpec::Parse(spec));
    if (!parsed.rotate) continue;
    absl::StatusOr<kernels::HadamardRotation> r = kernels::HadamardRotation::Make(head_dim, l);
    if (!r.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv cache: codec ", spec, " rotates: ", r.status().message()));
    }
    c->layers_[l].rotation = *std::move(r);
  }
  return c;
}

BlockName SequenceKvCache::NameOf(uint32_t layer, const BlockHash& key) const {
  BlockName n;
  n.model_fingerprint = options_.model_fingerprint;
  n.codec_fingerprint = Fingerprint64(codec_->LayerSpec(layer));
  n.calibration_fingerprint =
      codec_->calibration() != nullptr ? codec_->calibration()->fingerprint() : 0;
  n.key = key;
  n.layer = layer;
  return n;
}

std::vector<uint64_t> SequenceKvCache::LayerCodecFingerprints() const {
  std::vector<uint64_t> out;
  for (uint32_t l = 0; l < layers_.size(); ++l) out.push_back(Fingerprint64(codec_->LayerSpec(l)));
  return out;
}

size_t SequenceKvCache::block_bytes() const {
  size_t n = 0;
  for (const Layer& l : layers_) {
    for (const SharedBytes& b : l.buffers) n += b.size();
  }
  return n;
}

void SequenceKvCache::AppendWindow(uint32_t layer, const float* k, const float* v, uint32_t n,
                                   const float* q, uint32_t q_heads) {
  Layer& l = layers_[layer];
  const size_t row = size_t{kv_heads_} * head_dim_;
  l.window_k.insert(l.window_k.end(), k, k + n * row);
  l.window_v.insert(l.window_v.end(), v, v + n * row);
  if (l.rotation.has_value()) {
    const size_t rows = size_t{n} * kv_heads_;
    l.rotation->Apply(l.window_k.data() + l.window_k.size() - rows * head_dim_, rows);
    l.rotation->Apply(l.window_v.data() + l.window_v.size() - rows * head_dim_, rows);
  }
  if (codec_->wants_queries() && q != nullptr && q_heads > 0 &&
      (l.window_q.empty() || q_heads == l.q_heads)) {
    l.q_heads = q_heads;
    l.window_q.insert(l.window_q.end(), q, q + size_t{n} * q_heads * head_dim_);
    if (l.rotation.has_value()) {
      const size_t rows = size_t{n} * q_heads;
      l.rotation->Apply(l.window_q.data() + l.window_q.size() - rows * head_dim_, rows);
    }
  }
}

absl::Status SequenceKvCache::AddBlock(Layer& l, SharedBytes block, bool checksum_verified) {
  STRATA_ASSIGN_OR_RETURN(BlockView view,
                          BlockView::Parse(block.span(), {.verify_checksum = !checksum_verified}));
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
      l.window_q.resize(
          std::min(l.window_q.size(), size_t{window_tokens_} * l.q_heads * head_dim_));
    }
    l.pending.clear();
  }
}

absl::StatusOr<std::vector<SharedBytes>> SequenceKvCache::EncodeChunks(uint32_t li,
                                                                       uint32_t window) const {
  const uint32_t c = options_.chunk_tokens;
  const size_t row = size_t{kv_heads_} * head_dim_;
  const Layer& l = layers_[li];
  std::vector<SharedBytes> out;
  for (uint32_t done = 0; window - done >= c + options_.window_tokens; done += c) {
    const uint32_t chunk = static_cast<uint32_t>(l.ops.size() + done / c);
    kernels::KvChunkView view{l.window_k.data() + done * row,
                              l.window_v.data() + done * row,
                              SourceDType::kFloat32,
                              c,
                              kv_heads_,
                              head_dim_};
    const size_t q_row = size_t{l.q_heads} * head_dim_;
    if (l.q_heads > 0 && l.window_q.size() >= (done + c) * q_row) {
      view.q = l.window_q.data() + done * q_row;
      view.q_heads = l.q_heads;
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<AlignedBuffer> block = codec_->Encode(
        view, {.layer = li, .chunk_index = chunk, .model_fingerprint = options_.model_fingerprint});
    encode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!block.ok()) return block.status();
    out.push_back(SharedBytes::FromBuffer(*std::move(block)));
  }
  return out;
}

absl::StatusOr<std::vector<SharedBytes>> SequenceKvCache::CompressLayer(uint32_t layer) {
  if (layer >= layers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: layer ", layer, " of ", layers_.size()));
  }
  Layer& l = layers_[layer];
  const uint32_t window =
      static_cast<uint32_t>(l.window_k.size() / (size_t{kv_heads_} * head_dim_));
  STRATA_ASSIGN_OR_RETURN(l.pending, EncodeChunks(layer, window));
  return l.pending;
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
  // Encode every full chunk of every layer first (or take what CompressLayer made); the cache
  // changes only if all succeed.
  const uint32_t window = window_tokens_ + n;
  uint32_t chunks = 0;
  for (uint32_t done = 0; window - done >= c + options_.window_tokens; done += c) ++chunks;
  std::vector<std::vector<SharedBytes>> encoded(layers_.size());
  for (uint32_t li = 0; li < layers_.size(); ++li) {
    if (layers_[li].pending.size() == chunks) {
      encoded[li] = std::move(layers_[li].pending);
      continue;
    }
    absl::StatusOr<std::vector<SharedBytes>> blocks = EncodeChunks(li, window);
    if (!blocks.ok()) {
      DiscardUncommitted();
      return blocks.status();
    }
    encoded[li] = *std::move(blocks);
  }
  const uint32_t consumed = chunks * c;
  for (uint32_t li = 0; li < layers_.size(); ++li) {
    Layer& l = layers_[li];
    l.pending.clear();
    for (SharedBytes& b : encoded[li]) {
      // Our own codec's output, just written: its structure is checked, not its CRC.
      absl::Status s = AddBlock(l, std::move(b), /*checksum_verified=*/true);
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

absl::Status SequenceKvCache::AdoptBlock(uint32_t layer, SharedBytes block,
                                         bool checksum_verified) {
  if (window_tokens_ != 0) {
    return absl::FailedPreconditionError("kv cache: blocks can only be adopted before any window");
  }
  if (layer >= layers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: layer ", layer, " of ", layers_.size()));
  }
  STRATA_ASSIGN_OR_RETURN(BlockView view,
                          BlockView::Parse(block.span(), {.verify_checksum = !checksum_verified}));
  const BlockHeader& h = view.header();
  const Layer& l = layers_[layer];
  const std::string want = codec_->LayerSpec(layer);
  if (h.codec_spec != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: block of codec '", h.codec_spec, "', the cache uses '", want, "'"));
  }
  if (h.layer != layer || h.chunk_index != l.ops.size() || h.token_count != options_.chunk_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: block is layer ", h.layer, " chunk ", h.chunk_index, " of ", h.token_count,
        " tokens; expected layer ", layer, " chunk ", l.ops.size(), " of ", options_.chunk_tokens));
  }
  if (options_.model_fingerprint != 0 && h.model_fingerprint != options_.model_fingerprint) {
    return absl::InvalidArgumentError("kv cache: block was made by another model");
  }
  // The header was just checked in full; AddBlock parses the same bytes again only for the view
  // it keeps, and never recomputes the CRC.
  return AddBlock(layers_[layer], std::move(block), /*checksum_verified=*/true);
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

namespace {

constexpr uint32_t kWindowMagic = 0x57564b53u;  // bytes "SKVW"
constexpr uint16_t kWindowVersion = 1;
constexpr size_t kWindowHeaderBytes = 32;

void PutU32(std::string& out, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint32_t GetU32(absl::Span<const uint8_t> b, size_t at) {
  return uint32_t{b[at]} | uint32_t{b[at + 1]} << 8 | uint32_t{b[at + 2]} << 16 |
         uint32_t{b[at + 3]} << 24;
}

}  // namespace

std::string SequenceKvCache::ExportWindow(uint32_t layer) const {
  const Layer& l = layers_[layer];
  const size_t row = size_t{kv_heads_} * head_dim_;
  const size_t kv_floats = size_t{window_tokens_} * row;
  const size_t q_floats = size_t{window_tokens_} * l.q_heads * head_dim_;
  const uint32_t q_heads = l.q_heads > 0 && l.window_q.size() >= q_floats ? l.q_heads : 0;
  std::string out(kWindowHeaderBytes + 4 * (2 * kv_floats + (q_heads > 0 ? q_floats : 0)), '\0');
  PutU32(out, 0, kWindowMagic);
  PutU32(out, 4, kWindowVersion);
  PutU32(out, 8, layer);
  PutU32(out, 12, window_tokens_);
  PutU32(out, 16, kv_heads_);
  PutU32(out, 20, head_dim_);
  PutU32(out, 24, q_heads);
  // fp32 as the host holds it: little-endian on every machine Strata builds for.
  char* p = out.data() + kWindowHeaderBytes;
  std::memcpy(p, l.window_k.data(), kv_floats * 4);
  std::memcpy(p + kv_floats * 4, l.window_v.data(), kv_floats * 4);
  if (q_heads > 0) std::memcpy(p + 8 * kv_floats, l.window_q.data(), q_floats * 4);
  return out;
}

absl::Status SequenceKvCache::ImportWindow(uint32_t layer, absl::Span<const uint8_t> bytes) {
  if (layer >= layers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv window: layer ", layer, " of ", layers_.size()));
  }
  Layer& l = layers_[layer];
  if (window_tokens_ != 0 || !l.window_k.empty()) {
    return absl::FailedPreconditionError("kv window: the cache already has a window");
  }
  if (bytes.size() < kWindowHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv window: ", bytes.size(), " bytes, shorter than its header"));
  }
  if (GetU32(bytes, 0) != kWindowMagic || GetU32(bytes, 4) != kWindowVersion) {
    return absl::InvalidArgumentError("kv window: bad magic or version");
  }
  const uint32_t got_layer = GetU32(bytes, 8), tokens = GetU32(bytes, 12),
                 heads = GetU32(bytes, 16), dim = GetU32(bytes, 20), q_heads = GetU32(bytes, 24);
  if (got_layer != layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv window: layer field is ", got_layer, ", expected ", layer));
  }
  if (heads != kv_heads_ || dim != head_dim_) {
    return absl::InvalidArgumentError(absl::StrCat("kv window: shape ", heads, "x", dim,
                                                   ", the cache is ", kv_heads_, "x", head_dim_));
  }
  if (tokens > options_.chunk_tokens + options_.window_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv window: tokens field is ", tokens, ", more than a window of this cache holds (",
        options_.chunk_tokens + options_.window_tokens, ")"));
  }
  if (q_heads > kMaxKvHeads * 64 || (q_heads > 0 && q_heads % kv_heads_ != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv window: q_heads field is ", q_heads, ", not a multiple of ", kv_heads_));
  }
  const size_t kv_floats = size_t{tokens} * kv_heads_ * head_dim_;
  const size_t q_floats = size_t{tokens} * q_heads * head_dim_;
  const size_t want = kWindowHeaderBytes + 4 * (2 * kv_floats + q_floats);
  if (bytes.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv window: ", bytes.size(), " bytes, its header implies ", want));
  }
  const uint8_t* p = bytes.data() + kWindowHeaderBytes;
  l.window_k.resize(kv_floats);
  l.window_v.resize(kv_floats);
  std::memcpy(l.window_k.data(), p, kv_floats * 4);
  std::memcpy(l.window_v.data(), p + kv_floats * 4, kv_floats * 4);
  l.window_q.clear();
  if (q_heads > 0 && codec_->wants_queries()) {
    l.q_heads = q_heads;
    l.window_q.resize(q_floats);
    std::memcpy(l.window_q.data(), p + 8 * kv_floats, q_floats * 4);
  }
  return absl::OkStatus();
}

absl::Status SequenceKvCache::CommitWindow() {
  const size_t row = size_t{kv_heads_} * head_dim_;
  const size_t n = layers_[0].window_k.size();
  for (const Layer& l : layers_) {
    if (l.window_k.size() != n) {
      DiscardUncommitted();
      return absl::FailedPreconditionError(
          "kv window: layers imported windows of different lengths");
    }
  }
  window_tokens_ = static_cast<uint32_t>(n / row);
  tokens_ += window_tokens_;
  return absl::OkStatus();
}

void SequenceKvCache::Clear() {
  for (Layer& l : layers_) l = Layer{};
  tokens_ = 0;
  window_tokens_ = 0;
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
