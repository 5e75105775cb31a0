// The compute backend seam: devices parse or are refused by name, the CPU backend computes what
// LlamaModel computes (it is the reference), refuses caches of another device, and a CUDA device
// is refused, saying what to use, unless a CUDA loader is registered.
#include "model/compute_backend.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/cpu_backend.h"
#include "model/kv_cache.h"
#include "model/llama.h"

namespace strata::model {
namespace {

const std::string kModel = absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny");

TEST(DeviceTest, ParsesCpuAndCudaDevicesAndNamesWhatItCannotParse) {
  EXPECT_EQ(ParseDevice("cpu")->kind, Device::Kind::kCpu);
  EXPECT_EQ(ParseDevice("cuda")->ToString(), "cuda:0");
  EXPECT_EQ(ParseDevice("cuda:3")->index, 3);
  EXPECT_EQ(ParseDevice("cuda:3")->ToString(), "cuda:3");
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda:1:2"}) {
    absl::StatusOr<Device> d = ParseDevice(bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find(absl::StrCat("'", bad, "'")), std::string::npos)
        << d.status();
  }
}

TEST(ComputeBackendTest, ACudaDeviceIsRefusedSayingWhatToUse) {
  absl::StatusOr<std::unique_ptr<ComputeBackend>> b =
      LoadComputeBackend(kModel, *ParseDevice("cuda:1"));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(b.status().message().find("cuda:1"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("--device cpu"), std::string::npos) << b.status();
}

// A registered CUDA loader gets CUDA devices (and only them); unregistered, the refusal again.
TEST(ComputeBackendTest, ARegisteredCudaLoaderLoadsCudaDevices) {
  std::vector<std::string> asked;
  SetCudaBackendLoader([&](const std::string& dir,
                           const Device& d) -> absl::StatusOr<std::unique_ptr<ComputeBackend>> {
    asked.push_back(absl::StrCat(dir, " on ", d.ToString()));
    return absl::ResourceExhaustedError("the loader ran");
  });
  EXPECT_EQ(LoadComputeBackend(kModel, *ParseDevice("cuda:2")).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(LoadComputeBackend(kModel, Device{}).ok());
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], absl::StrCat(kModel, " on cuda:2"));
  SetCudaBackendLoader(nullptr);
  EXPECT_EQ(LoadComputeBackend(kModel, *ParseDevice("cuda:2")).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST(ComputeBackendTest, TheCpuBackendComputesWhatTheModelComputes) {
  absl::StatusOr<std::unique_ptr<ComputeBackend>> backend = LoadComputeBackend(kModel, Device{});
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->device().ToString(), "cpu");
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(kModel);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*backend)->fingerprint(), (*model)->fingerprint());

  const KvCacheOptions opts{.codec = "kivi:k4v4:g16", .chunk_tokens = 16};
  std::vector<uint32_t> prompt;
  for (uint32_t i = 0; i < 41; ++i) prompt.push_back(1 + (i * 37) % 500);
  auto cache = *(*backend)->NewCache(opts);
  auto ref = *(*model)->NewCache(opts);
  EXPECT_EQ(cache->device().ToString(), "cpu");
  std::vector<uint32_t> layers_seen;
  const std::vector<float> got = *(*backend)->Prefill(prompt, cache.get(), [&](uint32_t layer) {
    layers_seen.push_back(layer);
    return absl::OkStatus();
  });
  const std::vector<float> want = *(*model)->Prefill(prompt, ref.get());
  EXPECT_EQ(got, want);
  EXPECT_EQ(cache->tokens(), ref->tokens());
  EXPECT_EQ(cache->block_bytes(), ref->block_bytes());
  EXPECT_FALSE(layers_seen.empty());
  for (uint32_t l = 0; l < cache->layers(); ++l) {
    ASSERT_EQ(cache->layer_blocks(l).size(), ref->layer_blocks(l).size());
    for (size_t b = 0; b < ref->layer_blocks(l).size(); ++b) {
      EXPECT_TRUE(cache->layer_blocks(l)[b].span() == ref->layer_blocks(l)[b].span());
    }
  }
  // A decode step through the interface, the same as the model's own.
  const uint32_t next = 7;
  const absl::Span<const uint32_t> one(&next, 1);
  KvCache* caches[] = {cache.get()};
  const std::vector<std::vector<float>> step = *(*backend)->StepBatch({&one, 1}, caches);
  SequenceKvCache* refs[] = {ref.get()};
  const std::vector<std::vector<float>> ref_step = *(*model)->StepBatch({&one, 1}, refs);
  EXPECT_EQ(step, ref_step);
}

// A cache of another device, as a GPU backend's would be: the CPU backend refuses it.
class OtherDeviceCache final : public KvCache {
 public:
  Device device() const override { return *ParseDevice("cuda:0"); }
  const KvCacheOptions& options() const override { return options_; }
  uint32_t layers() const override { return 0; }
  uint32_t tokens() const override { return 0; }
  uint32_t window_tokens() const override { return 0; }
  size_t blocks_per_layer() const override { return 0; }
  size_t block_bytes() const override { return 0; }
  double encode_seconds() const override { return 0; }
  const std::vector<SharedBytes>& layer_blocks(uint32_t) const override { return none_; }
  BlockName NameOf(uint32_t, const BlockHash&) const override { return {}; }
  std::vector<uint64_t> LayerCodecFingerprints() const override { return {}; }
  absl::StatusOr<std::vector<SharedBytes>> CompressLayer(uint32_t) override {
    return std::vector<SharedBytes>{};
  }
  absl::Status AdoptBlock(uint32_t, SharedBytes, bool) override { return absl::OkStatus(); }
  absl::Status CommitAdopted() override { return absl::OkStatus(); }
  std::string ExportWindow(uint32_t) const override { return ""; }
  absl::Status ImportWindow(uint32_t, absl::Span<const uint8_t>) override {
    return absl::OkStatus();
  }
  absl::Status CommitWindow() override { return absl::OkStatus(); }
  void Clear() override {}

 private:
  KvCacheOptions options_;
  std::vector<SharedBytes> none_;
};

TEST(ComputeBackendTest, TheCpuBackendRefusesACacheOfAnotherDevice) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(kModel);
  ASSERT_TRUE(model.ok()) << model.status();
  const CpuBackend backend(model->get());
  OtherDeviceCache other;
  const uint32_t token = 1;
  absl::StatusOr<std::vector<float>> p = backend.Prefill({&token, 1}, &other);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("cuda:0"), std::string::npos) << p.status();
  const absl::Span<const uint32_t> one(&token, 1);
  KvCache* caches[] = {&other};
  EXPECT_EQ(backend.StepBatch({&one, 1}, caches).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.Prefill({&token, 1}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::model
