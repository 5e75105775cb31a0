// The CUDA plugin loader (model/cuda_plugin.h): plugins open, are refused by name when they are not
// this build's, and the backends they make work across the boundary. The fake plugins
// (model/testing/fake_cuda_plugin.cc) run everywhere; the real one where this build has CUDA.
#include "model/cuda_plugin.h"

#include <pthread.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/kv_cache.h"

namespace strata::model {
namespace {

const std::string kModel = absl::StrCat(STRATA_SOURCE_DIR, "/models/strata-tiny");

#ifdef STRATA_FAKE_PLUGIN_DIR
std::string Fake(const char* mode) {
  return absl::StrCat(STRATA_FAKE_PLUGIN_DIR, "/libstrata_fake_cuda_plugin_", mode, ".so");
}
#define STRATA_NEEDS_FAKE_PLUGINS() (void)0
#else
std::string Fake(const char*) { return ""; }
#define STRATA_NEEDS_FAKE_PLUGINS() \
  GTEST_SKIP() << "the fake plugins are not built under sanitizers (model/CMakeLists.txt)"
#endif

TEST(CudaPluginTest, TheAbiStampNamesTheHeadersAndTheCompiler) {
  const std::string abi = CudaPluginAbi();
  EXPECT_EQ(abi.rfind("strata-cuda-plugin/1 headers=", 0), 0u) << abi;
  EXPECT_NE(abi.find(" compiler="), std::string::npos) << abi;
  EXPECT_NE(abi.find(" absl="), std::string::npos) << abi;
  EXPECT_EQ(abi, CudaPluginAbi());
}

TEST(CudaPluginTest, TheDefaultPathIsLibBesideTheBinarysFolderOrBesideTheBinary) {
  const std::string path = DefaultCudaPluginPath();
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe");
  EXPECT_TRUE(path == (exe.parent_path().parent_path() / "lib" / kCudaPluginFile).string() ||
              path == (exe.parent_path() / kCudaPluginFile).string())
      << path;
}

TEST(CudaPluginTest, AMissingPluginIsNotFoundSayingWhere) {
  absl::StatusOr<BackendLoader> l = OpenCudaPlugin("/nonexistent/libstrata_cuda.so", {});
  EXPECT_EQ(l.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(l.status().message().find("/nonexistent/libstrata_cuda.so"), std::string::npos)
      << l.status();
  EXPECT_NE(l.status().message().find("--cuda_plugin"), std::string::npos) << l.status();
}

TEST(CudaPluginTest, AFileThatIsNotASharedObjectIsRefusedWithTheLoadersWords) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/not_a_plugin.so");
  {
    FILE* f = fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    fputs("not ELF\n", f);
    fclose(f);
  }
  absl::StatusOr<BackendLoader> l = OpenCudaPlugin(path, {});
  EXPECT_EQ(l.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(l.status().message().find("does not open"), std::string::npos) << l.status();
  EXPECT_NE(l.status().message().find(path), std::string::npos) << l.status();
}

TEST(CudaPluginTest, ASharedObjectWithoutTheEntryIsRefused) {
  STRATA_NEEDS_FAKE_PLUGINS();
  absl::StatusOr<BackendLoader> l = OpenCudaPlugin(Fake("no_entry"), {});
  EXPECT_EQ(l.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(l.status().message().find(kCudaPluginEntry), std::string::npos) << l.status();
}

TEST(CudaPluginTest, APluginOfOtherSourcesIsRefusedNamingBothStamps) {
  STRATA_NEEDS_FAKE_PLUGINS();
  absl::StatusOr<BackendLoader> l = OpenCudaPlugin(Fake("abi_mismatch"), {});
  EXPECT_EQ(l.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(l.status().message().find("strata-cuda-plugin/0 headers=old"), std::string::npos)
      << l.status();
  EXPECT_NE(l.status().message().find(CudaPluginAbi()), std::string::npos) << l.status();
}

// The options reach the plugin, and the backend it makes (the CPU one here, from the plugin's own
// copy of the code) computes through the interface exactly what this binary's computes: prefill
// logits, blocks, a decode step.
TEST(CudaPluginTest, ABackendMadeInsideAPluginComputesAsTheBinarysOwn) {
  STRATA_NEEDS_FAKE_PLUGINS();
  absl::StatusOr<BackendLoader> loader = OpenCudaPlugin(
      Fake("ok"),
      {.kv_pool_bytes = 123, .max_sequences = 7, .max_step_tokens = 9, .cuda_graphs = false});
  ASSERT_TRUE(loader.ok()) << loader.status();
  absl::StatusOr<std::unique_ptr<ComputeBackend>> echo = (*loader)(kModel, *ParseDevice("cuda:1"));
  EXPECT_EQ(echo.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(echo.status().message(),
            absl::StrCat("fake plugin: ", kModel,
                         " on cuda:1 kv_pool_bytes=123 max_sequences=7 max_step_tokens=9 "
                         "cuda_graphs=0"));

  // Registered as the CUDA loader, it serves LoadComputeBackend's CUDA devices.
  SetCudaBackendLoader(*loader);
  absl::StatusOr<std::unique_ptr<ComputeBackend>> plugged =
      LoadComputeBackend(kModel, *ParseDevice("cuda:0"));
  SetCudaBackendLoader(nullptr);
  ASSERT_TRUE(plugged.ok()) << plugged.status();
  absl::StatusOr<std::unique_ptr<ComputeBackend>> own = LoadComputeBackend(kModel, Device{});
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ((*plugged)->fingerprint(), (*own)->fingerprint());

  const KvCacheOptions opts{.codec = "kivi:k4v4:g16", .chunk_tokens = 16};
  std::vector<uint32_t> prompt;
  for (uint32_t i = 0; i < 37; ++i) prompt.push_back(3 + (i * 41) % 450);
  absl::StatusOr<std::unique_ptr<KvCache>> a = (*plugged)->NewCache(opts);
  absl::StatusOr<std::unique_ptr<KvCache>> b = (*own)->NewCache(opts);
  ASSERT_TRUE(a.ok() && b.ok());
  size_t hooks = 0;
  absl::StatusOr<std::vector<float>> got = (*plugged)->Prefill(prompt, a->get(), [&](uint32_t) {
    ++hooks;
    return absl::OkStatus();
  });
  absl::StatusOr<std::vector<float>> want = (*own)->Prefill(prompt, b->get());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(*got, *want);
  EXPECT_GT(hooks, 0u);
  ASSERT_EQ((*a)->blocks_per_layer(), (*b)->blocks_per_layer());
  EXPECT_EQ((*a)->blocks_per_layer(), 2u);
  for (uint32_t l = 0; l < (*a)->layers(); ++l) {
    for (size_t i = 0; i < (*b)->layer_blocks(l).size(); ++i) {
      EXPECT_TRUE((*a)->layer_blocks(l)[i].span() == (*b)->layer_blocks(l)[i].span());
    }
  }
  const uint32_t next = 11;
  const absl::Span<const uint32_t> one(&next, 1);
  KvCache* ca[] = {a->get()};
  KvCache* cb[] = {b->get()};
  EXPECT_EQ(*(*plugged)->StepBatch({&one, 1}, ca), *(*own)->StepBatch({&one, 1}, cb));
  // Errors made inside the plugin come out whole.
  absl::StatusOr<std::unique_ptr<KvCache>> bad = (*plugged)->NewCache({.codec = "nonsense:x"});
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("nonsense"), std::string::npos) << bad.status();
}

#ifdef STRATA_CUDA_PLUGIN
void* Nothing(void*) { return nullptr; }

// Whether a thread with a stack of `bytes` starts (glibc refuses one too small for the static
// thread-local storage of everything loaded).
bool ThreadStarts(size_t bytes) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, bytes);
  pthread_t t;
  const bool ok = pthread_create(&t, &attr, &Nothing, nullptr) == 0;
  if (ok) pthread_join(t, nullptr);
  pthread_attr_destroy(&attr);
  return ok;
}
#endif

// The plugin this build makes (libstrata_cuda.so): it opens (same stamp), and a CUDA device comes
// up, or without a GPU is refused saying so. Opening it leaves the smallest stack a thread could
// start with before still enough (civetweb's small worker stacks): its thread-local storage is not
// carved from every thread's stack, as it was when the binaries linked CUDA.
TEST(CudaPluginTest, ThisBuildsCudaPluginOpensAndLoadsOrSaysThereIsNoGpu) {
#ifndef STRATA_CUDA_PLUGIN
  GTEST_SKIP() << "this build has no CUDA (nvcc not found), so no plugin";
#else
  size_t smallest = 16 * 1024;
  while (smallest < (size_t{8} << 20) && !ThreadStarts(smallest)) smallest += 4096;
  absl::StatusOr<BackendLoader> loader = OpenCudaPlugin(STRATA_CUDA_PLUGIN, {});
  ASSERT_TRUE(loader.ok()) << loader.status();
  EXPECT_TRUE(ThreadStarts(smallest)) << smallest << " bytes of stack no longer start a thread";
  absl::StatusOr<std::unique_ptr<ComputeBackend>> b = (*loader)(kModel, *ParseDevice("cuda:0"));
  if (b.ok()) {
    EXPECT_EQ((*b)->device().ToString(), "cuda:0");
  } else {
    EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
    EXPECT_NE(b.status().message().find("no usable GPU"), std::string::npos) << b.status();
  }
#endif
}

}  // namespace
}  // namespace strata::model
