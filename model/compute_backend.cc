#include "model/compute_backend.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "model/cpu_backend.h"

namespace strata::model {

std::string Device::ToString() const {
  return kind == Kind::kCpu ? "cpu" : absl::StrCat("cuda:", index);
}

absl::StatusOr<Device> ParseDevice(absl::string_view text) {
  if (text == "cpu") return Device{};
  if (text == "cuda") return Device{.kind = Device::Kind::kCuda, .index = 0};
  if (absl::string_view n = text; absl::ConsumePrefix(&n, "cuda:")) {
    int index = -1;
    if (absl::SimpleAtoi(n, &index) && index >= 0 && index < 1024) {
      return Device{.kind = Device::Kind::kCuda, .index = index};
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", text, "': expected cpu, cuda or cuda:N"));
}

namespace {
absl::Mutex cuda_loader_mu(absl::kConstInit);
BackendLoader* const cuda_loader = new BackendLoader();  // guarded by cuda_loader_mu
}  // namespace

void SetCudaBackendLoader(BackendLoader loader) {
  absl::MutexLock lock(&cuda_loader_mu);
  *cuda_loader = std::move(loader);
}

absl::StatusOr<std::vector<float>> PrefillInPieces(absl::Span<const uint32_t> tokens,
                                                   uint32_t position, uint32_t chunk_tokens,
                                                   uint32_t vocab, const RunPiece& run,
                                                   const ComputeBackend::PieceLogits& piece_logits,
                                                   absl::string_view who) {
  std::vector<float> last;
  size_t done = 0;
  while (done < tokens.size()) {
    // Up to the next chunk boundary of the sequence.
    const size_t to_boundary = chunk_tokens - (position + done) % chunk_tokens;
    const size_t n = std::min(to_boundary, tokens.size() - done);
    absl::StatusOr<std::vector<float>> logits =
        run(tokens.subspan(done, n), /*last_only=*/piece_logits == nullptr);
    if (!logits.ok()) return logits.status();
    if (piece_logits != nullptr) {
      if (logits->size() != n * vocab) {
        return absl::InternalError(
            absl::StrCat(who, ": Prefill got logits of an unexpected size"));
      }
      piece_logits(done, *logits);
      last.assign(logits->end() - static_cast<ptrdiff_t>(vocab), logits->end());
    } else {
      last = *std::move(logits);
    }
    done += n;
  }
  return last;
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> LoadComputeBackend(const std::string& model_dir,
                                                                   const Device& device) {
  if (device.kind == Device::Kind::kCuda) {
    BackendLoader loader;
    {
      absl::MutexLock lock(&cuda_loader_mu);
      loader = *cuda_loader;
    }
    if (loader) return loader(model_dir, device);
    return absl::UnimplementedError(absl::StrCat(
        "device ", device.ToString(),
        ": this binary has no CUDA backend (built without nvcc, or a tool that runs the model on "
        "the CPU only); use --device cpu"));
  }
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(model_dir);
  if (!model.ok()) return model.status();
  return std::make_unique<CpuBackend>(*std::move(model));
}

CpuBackend::CpuBackend(std::unique_ptr<LlamaModel> model)
    : owned_(std::move(model)), model_(owned_.get()) {}

CpuBackend::CpuBackend(const LlamaModel* model) : model_(model) {}

absl::StatusOr<SequenceKvCache*> AsCpuCache(KvCache* cache) {
  if (cache == nullptr) return absl::InvalidArgumentError("the CPU backend: a null cache");
  if (cache->device().kind != Device::Kind::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CPU backend cannot compute over a cache on ", cache->device().ToString()));
  }
  return static_cast<SequenceKvCache*>(cache);  // the only KvCache on the CPU
}

absl::StatusOr<std::unique_ptr<KvCache>> CpuBackend::NewCache(const KvCacheOptions& options) const {
  absl::StatusOr<std::unique_ptr<SequenceKvCache>> cache = model_->NewCache(options);
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<KvCache>(*std::move(cache));
}

absl::StatusOr<std::vector<float>> CpuBackend::Prefill(absl::Span<const uint32_t> tokens,
                                                       KvCache* cache, const LayerHook& hook,
                                                       const PieceLogits& piece_logits) const {
  absl::StatusOr<SequenceKvCache*> c = AsCpuCache(cache);
  if (!c.ok()) return c.status();
  return model_->Prefill(tokens, *c, hook, piece_logits);
}

absl::StatusOr<std::vector<std::vector<float>>> CpuBackend::StepBatch(
    absl::Span<const absl::Span<const uint32_t>> tokens, absl::Span<KvCache* const> caches,
    const LayerHook& hook) const {
  std::vector<SequenceKvCache*> cpu;
  cpu.reserve(caches.size());
  for (KvCache* cache : caches) {
    absl::StatusOr<SequenceKvCache*> c = AsCpuCache(cache);
    if (!c.ok()) return c.status();
    cpu.push_back(*c);
  }
  return model_->StepBatch(tokens, cpu, hook);
}

}  // namespace strata::model
