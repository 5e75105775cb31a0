#include "model/cuda/cuda_backend.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_reader.h"
#include "common/status_macros.h"
#include "kernels/codec_spec.h"
#include "kernels/cuda/block_pages.h"
#include "model/kv_cache.h"

namespace strata::model::cuda {
namespace {

namespace kc = kernels::cuda;

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda backend: ", what, ": ", cudaGetErrorString(e)));
}

class CudaBackend;

cudaStream_t StreamOf(const CudaLlamaModel& m) { return static_cast<cudaStream_t>(m.stream()); }

// Host to device on the model's stream (ordered before the step's kernels; a pageable source is
// staged before the call returns).
absl::Status Upload(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                    absl::string_view what) {
  return CudaError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), what);
}

// One sequence's cache: the CPU's cache on the host, mirrored on the device (cuda_backend.h).
class CudaKvCache final : public KvCache {
 public:
  CudaKvCache(const CudaBackend* backend, std::unique_ptr<SequenceKvCache> host, int slot)
      : backend_(backend),
        host_(std::move(host)),
        slot_(slot),
        pages_(host_->layers()),
        page_src_(host_->layers()) {}
  ~CudaKvCache() override;

  Device device() const override;
  const KvCacheOptions& options() const override { return host_->options(); }
  uint32_t layers() const override { return host_->layers(); }
  uint32_t tokens() const override { return host_->tokens(); }
  uint32_t window_tokens() const override { return host_->window_tokens(); }
  size_t blocks_per_layer() const override { return host_->blocks_per_layer(); }
  size_t block_bytes() const override { return host_->block_bytes(); }
  double encode_seconds() const override { return host_->encode_seconds(); }
  const std::vector<SharedBytes>& layer_blocks(uint32_t layer) const override {
    return host_->layer_blocks(layer);
  }
  BlockName NameOf(uint32_t layer, const BlockHash& key) const override {
    return host_->NameOf(layer, key);
  }
  std::vector<uint64_t> LayerCodecFingerprints() const override {
    return host_->LayerCodecFingerprints();
  }
  absl::StatusOr<std::vector<SharedBytes>> CompressLayer(uint32_t layer) override {
    return host_->CompressLayer(layer);
  }
  absl::Status AdoptBlock(uint32_t layer, SharedBytes block, bool checksum_verified) override;
  absl::Status CommitAdopted() override { return host_->CommitAdopted(); }
  std::string ExportWindow(uint32_t layer) const override { return host_->ExportWindow(layer); }
  absl::Status ImportWindow(uint32_t layer, absl::Span<const uint8_t> bytes) override {
    window_dirty_ = true;
    return host_->ImportWindow(layer, bytes);
  }
  absl::Status CommitWindow() override {
    window_dirty_ = true;
    return host_->CommitWindow();
  }
  void Clear() override;

 private:
  friend class CudaBackend;
  const CudaBackend* backend_;
  std::unique_ptr<SequenceKvCache> host_;
  int slot_;  // its window's row of the backend's window pool
  // Per layer: the pool pages holding its blocks, and which block's bytes each holds.
  std::vector<std::vector<int32_t>> pages_;
  std::vector<std::vector<const uint8_t*>> page_src_;
  uint32_t device_window_ = 0;  // window tokens on the device
  bool window_dirty_ = true;    // the device's window no longer follows the host's
};

class CudaBackend final : public ComputeBackend {
 public:
  // The backend over the model `make` uploads or makes (once the shape is checked), of
  // `config`'s shape, whose blocks are named by `fingerprint`.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Make(
      const ModelConfig& config, uint64_t fingerprint, const CudaBackendOptions& options,
      const std::function<absl::StatusOr<std::unique_ptr<CudaLlamaModel>>()>& make) {
    std::unique_ptr<CudaBackend> b(new CudaBackend());
    b->config_ = config;
    b->fingerprint_ = fingerprint;
    b->options_ = options;
    const ModelConfig& c = b->config_;
    if (c.head_dim != 64 && c.head_dim != 128) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: head_dim ", c.head_dim,
                                                     ": the paged attention takes 64 or 128"));
    }
    if (c.num_kv_heads == 0 || c.num_heads % c.num_kv_heads != 0 ||
        c.num_heads / c.num_kv_heads > 8) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda backend: ", c.num_heads, " query heads over ", c.num_kv_heads,
                       " KV heads: the paged attention takes groups of up to 8"));
    }
    if (options.max_sequences == 0) {
      return absl::InvalidArgumentError("cuda backend: max_sequences must be at least 1");
    }
    STRATA_ASSIGN_OR_RETURN(b->gpu_, make());
    return b;
  }
  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    for (void* p :
         {static_cast<void*>(pool_), static_cast<void*>(window_k_), static_cast<void*>(window_v_),
          static_cast<void*>(tables_), static_cast<void*>(counts_), static_cast<void*>(save_kv_),
          static_cast<void*>(descs_), static_cast<void*>(desc_ids_),
          static_cast<void*>(constants_)}) {
      cudaFree(p);
    }
  }

  Device device() const override {
    return Device{.kind = Device::Kind::kCuda, .index = options_.device};
  }
  const ModelConfig& config() const override { return config_; }
  uint64_t fingerprint() const override { return fingerprint_; }

  absl::StatusOr<std::unique_ptr<KvCache>> NewCache(const KvCacheOptions& options) const override {
    KvCacheOptions o = options;
    o.model_fingerprint = fingerprint_;
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<SequenceKvCache> host,
        SequenceKvCache::Create(o, config_.num_layers, config_.num_kv_heads, config_.head_dim));
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_RETURN_IF_ERROR(EnsurePools(o));
    if (free_slots_.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda backend: all ", options_.max_sequences,
                       " sequence slots are in use (CudaBackendOptions::max_sequences)"));
    }
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    return std::unique_ptr<KvCache>(new CudaKvCache(this, std::move(host), slot));
  }

  absl::StatusOr<std::vector<float>> Prefill(absl::Span<const uint32_t> tokens, KvCache* cache,
                                             const LayerHook& hook,
                                             const PieceLogits& piece_logits) const override {
    STRATA_ASSIGN_OR_RETURN(CudaKvCache * c, AsOurs(cache));
    if (tokens.empty()) return absl::InvalidArgumentError("cuda backend: Prefill of no tokens");
    if (c->options().window_tokens != 0) {
      return absl::InvalidArgumentError(
          "cuda backend: Prefill needs a cache without a full-precision window (window_tokens 0)");
    }
    CudaKvCache* const caches[] = {c};
    return PrefillInPieces(
        tokens, c->tokens(), c->options().chunk_tokens, config_.vocab_size,
        [&](absl::Span<const uint32_t> piece,
            bool last_only) -> absl::StatusOr<std::vector<float>> {
          const absl::Span<const uint32_t> one[] = {piece};
          STRATA_ASSIGN_OR_RETURN(std::vector<std::vector<float>> logits,
                                  Run(one, caches, hook, last_only));
          return std::move(logits[0]);
        },
        piece_logits, "cuda backend");
  }

  absl::StatusOr<std::vector<std::vector<float>>> StepBatch(
      absl::Span<const absl::Span<const uint32_t>> tokens, absl::Span<KvCache* const> caches,
      const LayerHook& hook) const override {
    if (tokens.size() != caches.size() || tokens.empty()) {
      return absl::InvalidArgumentError("cuda backend: StepBatch needs one cache per sequence");
    }
    std::vector<CudaKvCache*> ours;
    for (size_t i = 0; i < caches.size(); ++i) {
      STRATA_ASSIGN_OR_RETURN(CudaKvCache * c, AsOurs(caches[i]));
      for (const CudaKvCache* o : ours) {
        if (o == c) return absl::InvalidArgumentError("cuda backend: a cache twice");
      }
      ours.push_back(c);
    }
    return Run(tokens, ours, hook, /*last_only=*/false);
  }

  // For CudaKvCache::AdoptBlock: OK when `block` can be a page of the pool (or no pool yet).
  absl::Status CheckPage(uint32_t layer, const BlockView& block) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (pool_ == nullptr) return absl::OkStatus();
    if (layer >= layer_layouts_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda backend: no layer ", layer, " (", layer_layouts_.size(), " layers)"));
    }
    return kc::CheckPage(block, layer_layouts_[layer], calibration_.get());
  }

  // For CudaKvCache: pages and slots back to the pools.
  void Release(std::vector<std::vector<int32_t>>* pages, int slot) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::vector<int32_t>& layer : *pages) {
      free_pages_.insert(free_pages_.end(), layer.begin(), layer.end());
      layer.clear();
    }
    if (slot >= 0) free_slots_.push_back(slot);
  }

 private:
  CudaBackend() = default;

  absl::StatusOr<CudaKvCache*> AsOurs(KvCache* cache) const {
    if (cache == nullptr) return absl::InvalidArgumentError("cuda backend: a null cache");
    const Device d = cache->device();
    if (d.kind != Device::Kind::kCuda || d.index != options_.device) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda backend on cuda:", options_.device, ": a cache on ", d.ToString()));
    }
    CudaKvCache* c = static_cast<CudaKvCache*>(cache);
    if (c->backend_ != this) {
      return absl::InvalidArgumentError("cuda backend: a cache of another backend");
    }
    return c;
  }

  // The pools, at the first cache: pages laid out as `o.codec`'s blocks, windows of
  // o.window_tokens + chunk + max_step_tokens rows. One format per backend.
  absl::Status EnsurePools(const KvCacheOptions& o) const {
    const ModelConfig& c = config_;
    if (absl::StatusOr<kernels::CodecSpec> spec = kernels::CodecSpec::Parse(o.codec);
        spec.ok() && spec->rotate) {
      return absl::UnimplementedError(absl::StrCat(
          "cuda backend: codec '", o.codec,
          "' rotates K and V (rot): the CUDA model does not rotate queries and outputs yet; "
          "serve it with --device cpu"));
    }
    std::vector<kc::PagedKvLayout> layer_layouts;
    absl::StatusOr<kc::PagedKvLayout> layout =
        kc::PageLayoutForCodec(o.codec, o.chunk_tokens, c.num_kv_heads, c.head_dim, o.calibration,
                               c.num_layers, &layer_layouts);
    if (!layout.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("cuda backend: codec '", o.codec, "' at ", o.chunk_tokens,
                       "-token chunks has no GPU page layout yet (", layout.status().message(),
                       "); serve it with --device cpu"));
    }
    const int max_window =
        static_cast<int>(o.window_tokens + o.chunk_tokens + options_.max_step_tokens);
    if (pool_ != nullptr) {
      if (o.codec != codec_ || o.chunk_tokens != chunk_tokens_ || max_window != max_window_ ||
          o.calibration != calibration_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cuda backend: its device pools hold '", codec_, "' at ", chunk_tokens_,
            "-token chunks with windows of ", max_window_, " rows; a cache of '", o.codec, "' at ",
            o.chunk_tokens, "-token chunks and window_tokens ", o.window_tokens,
            " (or another calibration) cannot share them (one format per backend)"));
      }
      return absl::OkStatus();
    }
    STRATA_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "set device"));
    const size_t window_bytes = size_t(c.num_layers) * options_.max_sequences * c.num_kv_heads *
                                max_window * c.head_dim * sizeof(__half);
    void *wk = nullptr, *wv = nullptr;
    if (cudaMalloc(&wk, window_bytes) != cudaSuccess ||
        cudaMalloc(&wv, window_bytes) != cudaSuccess) {
      cudaFree(wk);
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda backend: windows for ", options_.max_sequences, " sequences need 2 x ",
                       window_bytes, " bytes of device memory; lower max_sequences"));
    }
    size_t free_bytes = 0, total_bytes = 0;
    if (const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess) {
      cudaFree(wk);
      cudaFree(wv);
      return CudaError(e, "memory info");
    }
    const size_t page = layout->PageBytes();
    const size_t want = options_.kv_pool_bytes > 0 ? options_.kv_pool_bytes : free_bytes / 10 * 9;
    const size_t pages = want / page;
    if (pages < c.num_layers) {
      cudaFree(wk);
      cudaFree(wv);
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda backend: a KV pool of ", want, " bytes holds ", pages, " pages of ",
                       page, " bytes, fewer than one chunk of every layer (", c.num_layers, "); ",
                       free_bytes, " bytes are free on the device"));
    }
    void* pool = nullptr;
    if (cudaMalloc(&pool, pages * page) != cudaSuccess) {
      cudaFree(wk);
      cudaFree(wv);
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("cuda backend: a KV pool of ", pages * page,
                                                       " bytes does not fit (", free_bytes,
                                                       " bytes free)"));
    }
    if (layout->format == kc::PageFormat::kGeneral) {
      // General pages: a table of distinct descriptors, one index per page, and the
      // calibration's channel orders and codebooks, all allocated once (their addresses are part
      // of captured graphs).
      const kc::PageConstants constants = kc::PageConstants::For(o.calibration.get());
      void *descs = nullptr, *ids = nullptr, *consts = nullptr;
      const size_t const_bytes = std::max<size_t>(16, constants.bytes().size());
      if (cudaMalloc(&descs, kMaxPageDescs * sizeof(kc::PageDesc)) != cudaSuccess ||
          cudaMalloc(&ids, pages * sizeof(uint16_t)) != cudaSuccess ||
          cudaMalloc(&consts, const_bytes) != cudaSuccess) {
        for (void* p : {pool, static_cast<void*>(wk), static_cast<void*>(wv), descs, ids, consts}) {
          cudaFree(p);
        }
        cudaGetLastError();
        return absl::ResourceExhaustedError(
            "cuda backend: no device memory for the general pages' descriptors");
      }
      if (!constants.bytes().empty()) {
        if (const cudaError_t e = cudaMemcpy(consts, constants.bytes().data(),
                                             constants.bytes().size(), cudaMemcpyHostToDevice);
            e != cudaSuccess) {
          for (void* p :
               {pool, static_cast<void*>(wk), static_cast<void*>(wv), descs, ids, consts}) {
            cudaFree(p);
          }
          return CudaError(e, "calibration constants");
        }
      }
      descs_ = static_cast<kc::PageDesc*>(descs);
      desc_ids_ = static_cast<uint16_t*>(ids);
      constants_ = static_cast<uint8_t*>(consts);
      page_constants_ = std::make_unique<kc::PageConstants>(constants);
      desc_table_ = std::make_unique<kc::PageDescTable>(kMaxPageDescs);
      desc_ids_host_.assign(pages, 0);
    }
    calibration_ = o.calibration;
    pool_ = static_cast<uint8_t*>(pool);
    pool_pages_ = pages;
    window_k_ = static_cast<__half*>(wk);
    window_v_ = static_cast<__half*>(wv);
    layout_ = *layout;
    layer_layouts_ = std::move(layer_layouts);
    codec_ = o.codec;
    chunk_tokens_ = o.chunk_tokens;
    max_window_ = max_window;
    free_pages_.clear();
    for (size_t i = pages; i > 0; --i) free_pages_.push_back(static_cast<int32_t>(i - 1));
    free_slots_.clear();
    for (int i = static_cast<int>(options_.max_sequences); i > 0; --i) free_slots_.push_back(i - 1);
    return absl::OkStatus();
  }

  // The device's copy of `c` brought up to its host cache: pages for new blocks (freed for
  // dropped ones), the window again when the host's changed other than by our own appends.
  absl::Status Sync(CudaKvCache& c) const {
    const ModelConfig& cfg = config_;
    const cudaStream_t stream = StreamOf(*gpu_);
    const uint32_t L = cfg.num_layers, KH = cfg.num_kv_heads, D = cfg.head_dim;
    for (uint32_t l = 0; l < L; ++l) {
      const std::vector<SharedBytes>& blocks = c.host_->layer_blocks(l);
      std::vector<int32_t>& pages = c.pages_[l];
      std::vector<const uint8_t*>& src = c.page_src_[l];
      size_t same = 0;
      while (same < pages.size() && same < blocks.size() && src[same] == blocks[same].data()) {
        ++same;
      }
      for (size_t i = same; i < pages.size(); ++i) free_pages_.push_back(pages[i]);
      pages.resize(same);
      src.resize(same);
      for (size_t i = same; i < blocks.size(); ++i) {
        if (free_pages_.empty()) {
          return absl::ResourceExhaustedError(
              absl::StrCat("cuda backend: the device KV pool is full (", pool_pages_, " pages of ",
                           layout_.PageBytes(),
                           " bytes); give it more memory (--gpu_kv_bytes) or admit "
                           "fewer sequences"));
        }
        if (blocks[i].size() > layout_.PageBytes()) {
          return absl::InvalidArgumentError(
              absl::StrCat("cuda backend: a block of ", blocks[i].size(), " bytes exceeds a page (",
                           layout_.PageBytes(), ")"));
        }
        // Every block checked against the pool's layout before it becomes a page (adopted ones
        // were at AdoptBlock; the host codec's own are checked here, its CRC not again).
        absl::StatusOr<BlockView> view =
            BlockView::Parse(blocks[i].span(), {.verify_checksum = false});
        if (!view.ok()) return view.status();
        STRATA_ASSIGN_OR_RETURN(
            const std::optional<kc::PageDesc> general,
            kc::CheckAndDescribePage(*view, layer_layouts_[l], calibration_.get(),
                                     page_constants_.get()));
        const int32_t page = free_pages_.back();
        STRATA_RETURN_IF_ERROR(Upload(pool_ + size_t(page) * layout_.PageBytes(), blocks[i].data(),
                                      blocks[i].size(), stream, "block to page"));
        if (general.has_value()) {
          const kc::PageDesc& desc = *general;
          bool added = false;
          STRATA_ASSIGN_OR_RETURN(const uint16_t id, desc_table_->Intern(desc, &added));
          if (added) {  // (a pageable source is staged before the upload returns)
            STRATA_RETURN_IF_ERROR(Upload(descs_ + id, &desc_table_->descs()[id],
                                          sizeof(kc::PageDesc), stream, "page descriptor"));
          }
          desc_ids_host_[page] = id;
          STRATA_RETURN_IF_ERROR(Upload(desc_ids_ + page, &desc_ids_host_[page], sizeof(uint16_t),
                                        stream, "page descriptor index"));
        }
        free_pages_.pop_back();
        pages.push_back(page);
        src.push_back(blocks[i].data());
      }
    }
    const uint32_t window = c.host_->window_tokens();
    if (!c.window_dirty_ && c.device_window_ == window) return absl::OkStatus();
    if (window > static_cast<uint32_t>(max_window_)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: a window of ", window,
                                                     " tokens; the device's holds ", max_window_));
    }
    std::vector<__half> k(size_t(KH) * window * D), v(k.size());
    for (uint32_t l = 0; l < L && window > 0; ++l) {
      // ExportWindow: a 32-byte header, then K and V [tokens][kv_heads][head_dim] fp32.
      const std::string bytes = c.host_->ExportWindow(l);
      const size_t floats = size_t(window) * KH * D;
      if (bytes.size() < 32 + 2 * floats * sizeof(float)) {
        return absl::InternalError("cuda backend: an exported window shorter than its tokens");
      }
      const float* kf = reinterpret_cast<const float*>(bytes.data() + 32);
      const float* vf = kf + floats;
      for (uint32_t t = 0; t < window; ++t) {
        for (uint32_t h = 0; h < KH; ++h) {
          for (uint32_t d = 0; d < D; ++d) {
            const size_t from = (size_t(t) * KH + h) * D + d, to = (size_t(h) * window + t) * D + d;
            k[to] = __float2half_rn(kf[from]);
            v[to] = __float2half_rn(vf[from]);
          }
        }
      }
      for (uint32_t h = 0; h < KH; ++h) {
        const size_t row =
            ((size_t(l) * options_.max_sequences + c.slot_) * KH + h) * max_window_ * D;
        const size_t bytes = size_t(window) * D * sizeof(__half);
        STRATA_RETURN_IF_ERROR(
            Upload(window_k_ + row, &k[size_t(h) * window * D], bytes, stream, "window K"));
        STRATA_RETURN_IF_ERROR(
            Upload(window_v_ + row, &v[size_t(h) * window * D], bytes, stream, "window V"));
      }
    }
    c.device_window_ = window;
    c.window_dirty_ = false;
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status Grow(T** p, size_t* capacity, size_t n, absl::string_view what) const {
    if (*capacity >= n) return absl::OkStatus();
    cudaFree(*p);
    *p = nullptr;
    *capacity = 0;
    STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(reinterpret_cast<void**>(p), n * sizeof(T)), what));
    *capacity = n;
    return absl::OkStatus();
  }

  // One step: every sequence's new tokens as rows of one DecodePaged, each attending to its
  // pages and its window; the new K and V into the host caches, then their Commit.
  absl::StatusOr<std::vector<std::vector<float>>> Run(
      absl::Span<const absl::Span<const uint32_t>> seqs, absl::Span<CudaKvCache* const> caches,
      const LayerHook& hook, bool last_only) const {
    const ModelConfig& c = config_;
    const uint32_t L = c.num_layers, KH = c.num_kv_heads, D = c.head_dim;
    const size_t kvd = size_t(KH) * D;
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "set device"));
    std::vector<uint32_t> row0(seqs.size() + 1, 0);
    for (size_t s = 0; s < seqs.size(); ++s) {
      if (seqs[s].empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda backend: sequence ", s, " has no tokens"));
      }
      const uint64_t end = uint64_t{caches[s]->tokens()} + seqs[s].size();
      if (c.sliding_window != 0 && end > c.sliding_window) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda backend: ", end, " tokens exceed the sliding window of ",
                         c.sliding_window, "; sliding-window attention is not implemented"));
      }
      if (end > c.max_position_embeddings * 4ull) {
        return absl::InvalidArgumentError(absl::StrCat("cuda backend: position ", end,
                                                       " is far beyond the model's context of ",
                                                       c.max_position_embeddings));
      }
      const uint64_t window = uint64_t{caches[s]->window_tokens()} + seqs[s].size();
      if (window > static_cast<uint64_t>(max_window_)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda backend: sequence ", s, " adds ", seqs[s].size(), " tokens to a window of ",
            caches[s]->window_tokens(), "; the device's window holds ", max_window_,
            " (CudaBackendOptions::max_step_tokens)"));
      }
      row0[s + 1] = row0[s] + static_cast<uint32_t>(seqs[s].size());
    }
    for (CudaKvCache* cache : caches) STRATA_RETURN_IF_ERROR(Sync(*cache));
    const int rows = static_cast<int>(row0.back());
    int max_pages_in_batch = 0;
    for (CudaKvCache* cache : caches) {
      max_pages_in_batch = std::max(max_pages_in_batch, static_cast<int>(cache->pages_[0].size()));
    }
    const int max_pages = std::max(1, max_pages_in_batch);
    std::vector<uint32_t> tokens(rows);
    std::vector<int32_t> positions(rows), slots(rows), lens(rows), counts(rows);
    std::vector<int32_t> tables(size_t(L) * rows * max_pages, 0);
    for (size_t s = 0; s < seqs.size(); ++s) {
      const CudaKvCache& cache = *caches[s];
      for (uint32_t i = 0; i < seqs[s].size(); ++i) {
        const uint32_t r = row0[s] + i;
        tokens[r] = seqs[s][i];
        positions[r] = static_cast<int32_t>(cache.tokens() + i);
        slots[r] = cache.slot_;
        lens[r] = static_cast<int32_t>(cache.window_tokens() + i);
        counts[r] = static_cast<int32_t>(cache.pages_[0].size());
        for (uint32_t l = 0; l < L; ++l) {
          std::copy(cache.pages_[l].begin(), cache.pages_[l].end(),
                    tables.begin() + (size_t(l) * rows + r) * max_pages);
        }
      }
    }
    STRATA_RETURN_IF_ERROR(Grow(&tables_, &tables_cap_, tables.size(), "block tables"));
    STRATA_RETURN_IF_ERROR(Grow(&counts_, &counts_cap_, counts.size(), "page counts"));
    STRATA_RETURN_IF_ERROR(Grow(&save_kv_, &save_kv_cap_, size_t(L) * 2 * rows * kvd, "new K, V"));
    const cudaStream_t stream = StreamOf(*gpu_);
    STRATA_RETURN_IF_ERROR(
        Upload(tables_, tables.data(), tables.size() * 4, stream, "block tables"));
    STRATA_RETURN_IF_ERROR(
        Upload(counts_, counts.data(), counts.size() * 4, stream, "page counts"));
    std::vector<const int32_t*> table_ptrs(L);
    for (uint32_t l = 0; l < L; ++l) table_ptrs[l] = tables_ + size_t(l) * rows * max_pages;

    CudaLlamaModel::PagedStep step;
    step.tokens = tokens;
    step.positions = positions;
    step.window_slots = slots;
    step.window_lens = lens;
    step.layout = layout_;
    step.layer_layouts = layer_layouts_;
    step.pages = pool_;
    step.page_descs = descs_;
    step.page_desc_ids = desc_ids_;
    step.constants = constants_;
    step.block_tables = table_ptrs;
    step.max_pages = max_pages;
    step.page_counts = counts_;
    step.max_pages_in_batch = max_pages_in_batch;
    step.window_k = window_k_;
    step.window_v = window_v_;
    step.slots = static_cast<int>(options_.max_sequences);
    step.max_window = max_window_;
    step.save_kv = save_kv_;
    const bool one_row_each = last_only && seqs.size() == 1;
    step.last_row_only = one_row_each;
    // Graphs for decode steps (a token per sequence); a prefill piece's size changes each time.
    step.graph = rows == static_cast<int>(seqs.size());
    // Each layer's new rows to the host caches (what their Commit compresses).
    std::vector<float>& kv_host = kv_host_;  // reused: a prefill piece's rows are ~70 MB at 8B
    kv_host.resize(size_t(L) * 2 * rows * kvd);
    auto to_host = [&](uint32_t first, uint32_t count) -> absl::Status {
      const size_t per_layer = 2 * size_t(rows) * kvd;
      STRATA_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(kv_host.data() + first * per_layer, save_kv_ + first * per_layer,
                          count * per_layer * sizeof(float), cudaMemcpyDeviceToHost, stream),
          "new K, V to the host"));
      STRATA_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), "new K, V to the host"));
      for (uint32_t l = first; l < first + count; ++l) {
        const float* k = kv_host.data() + l * per_layer;
        const float* v = k + size_t(rows) * kvd;
        for (size_t s = 0; s < seqs.size(); ++s) {
          caches[s]->host_->AppendWindow(l, k + row0[s] * kvd, v + row0[s] * kvd,
                                         row0[s + 1] - row0[s]);
        }
      }
      return absl::OkStatus();
    };
    if (hook) {
      step.after_layer = [&](uint32_t l) -> absl::Status {
        STRATA_RETURN_IF_ERROR(to_host(l, 1));
        return hook(l);
      };
    }
    std::vector<float> logits;
    absl::StatusOr<std::vector<uint32_t>> ran = gpu_->DecodePaged(step, &logits);
    absl::Status appended = ran.status();
    if (appended.ok() && !hook) appended = to_host(0, L);
    if (!appended.ok()) {
      for (CudaKvCache* cache : caches) cache->host_->DiscardUncommitted();
      return appended;
    }
    for (size_t s = 0; s < caches.size(); ++s) {
      CudaKvCache& cache = *caches[s];
      const absl::Status st = cache.host_->Commit(row0[s + 1] - row0[s]);
      if (!st.ok()) {  // earlier caches committed; later ones are put back as they were
        for (size_t t = s + 1; t < caches.size(); ++t) caches[t]->host_->DiscardUncommitted();
        return st;
      }
      // The device's window has the new rows; when a chunk became a block, the host's window
      // moved on and the device's is sent again before the next step.
      cache.device_window_ += row0[s + 1] - row0[s];
      if (cache.device_window_ != cache.host_->window_tokens()) cache.window_dirty_ = true;
    }
    const size_t vocab = c.vocab_size;
    std::vector<std::vector<float>> out(seqs.size());
    if (one_row_each) {
      out[0] = std::move(logits);
      return out;
    }
    for (size_t s = 0; s < seqs.size(); ++s) {
      const size_t first = last_only ? row0[s + 1] - 1 : row0[s];
      out[s].assign(logits.begin() + first * vocab, logits.begin() + row0[s + 1] * vocab);
    }
    return out;
  }

  ModelConfig config_;
  uint64_t fingerprint_ = 0;
  CudaBackendOptions options_;
  std::unique_ptr<CudaLlamaModel> gpu_;
  // Everything below: under mu_ (the pools at the first cache, the step's buffers).
  mutable std::mutex mu_;
  mutable kc::PagedKvLayout layout_;
  // Each layer's (PageLayoutForCodec): the pool's, or, for a Strata mix's layers of CQ, a
  // codebook pool's (the codebook kernel's).
  mutable std::vector<kc::PagedKvLayout> layer_layouts_;
  mutable std::string codec_;
  mutable uint32_t chunk_tokens_ = 0;
  mutable int max_window_ = 0;
  mutable uint8_t* pool_ = nullptr;
  mutable size_t pool_pages_ = 0;
  mutable std::vector<int32_t> free_pages_;
  mutable __half* window_k_ = nullptr;
  mutable __half* window_v_ = nullptr;
  mutable std::vector<int> free_slots_;
  mutable int32_t* tables_ = nullptr;
  mutable size_t tables_cap_ = 0;
  mutable int32_t* counts_ = nullptr;
  mutable size_t counts_cap_ = 0;
  mutable float* save_kv_ = nullptr;
  mutable size_t save_kv_cap_ = 0;
  mutable std::vector<float> kv_host_;
  // General pages (layout_.format kGeneral): the calibration the blocks were made with, the
  // distinct descriptors (host table and device copy), each page's descriptor index (device, and
  // the host's copy it is uploaded from), the calibration constants.
  static constexpr size_t kMaxPageDescs = 1024;
  mutable std::shared_ptr<const kernels::Calibration> calibration_;
  mutable std::unique_ptr<kc::PageConstants> page_constants_;
  mutable std::unique_ptr<kc::PageDescTable> desc_table_;
  mutable kc::PageDesc* descs_ = nullptr;
  mutable uint16_t* desc_ids_ = nullptr;
  mutable std::vector<uint16_t> desc_ids_host_;
  mutable uint8_t* constants_ = nullptr;
};

CudaKvCache::~CudaKvCache() { backend_->Release(&pages_, slot_); }

Device CudaKvCache::device() const { return backend_->device(); }

absl::Status CudaKvCache::AdoptBlock(uint32_t layer, SharedBytes block, bool checksum_verified) {
  // A block whose sections are not where the pool's pages have them cannot be a page: refused
  // here, before the host cache takes it.
  absl::StatusOr<BlockView> view =
      BlockView::Parse(block.span(), {.verify_checksum = !checksum_verified});
  if (!view.ok()) return view.status();
  STRATA_RETURN_IF_ERROR(backend_->CheckPage(layer, *view));
  return host_->AdoptBlock(layer, std::move(block), /*checksum_verified=*/true);
}

void CudaKvCache::Clear() {
  host_->Clear();
  backend_->Release(&pages_, /*slot=*/-1);
  for (auto& src : page_src_) src.clear();
  device_window_ = 0;
  window_dirty_ = true;
}

}  // namespace

namespace {
CudaModelOptions ModelOptions(const CudaBackendOptions& o) {
  return {.device = o.device, .weights = o.weights, .cuda_graphs = o.cuda_graphs};
}
}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackend(const LlamaModel& host,
                                                                const CudaBackendOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b,
                          CudaBackend::Make(host.config(), host.fingerprint(), options, [&] {
                            return CudaLlamaModel::Upload(host, ModelOptions(options));
                          }));
  return std::unique_ptr<ComputeBackend>(std::move(b));
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeRandomCudaBackend(
    const ModelConfig& config, const CudaBackendOptions& options, uint64_t seed) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b,
                          CudaBackend::Make(config, /*fingerprint=*/seed, options, [&] {
                            return CudaLlamaModel::Random(config, ModelOptions(options), seed);
                          }));
  return std::unique_ptr<ComputeBackend>(std::move(b));
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> LoadCudaBackend(const std::string& model_dir,
                                                                const Device& device,
                                                                CudaBackendOptions options) {
  if (device.kind != Device::Kind::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: device ", device.ToString(), " is not a CUDA device"));
  }
  options.device = device.index;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> host, LlamaModel::Load(model_dir));
  return MakeCudaBackend(*host, options);
}

}  // namespace strata::model::cuda
