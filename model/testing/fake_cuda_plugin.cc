// Plugins for model/cuda_plugin_test.cc, built three ways (STRATA_FAKE_PLUGIN):
//   ok            the entry, this build's ABI stamp, and a loader that returns the CPU backend from
//                 the plugin's own copy of the Strata code (so that the test drives objects made
//                 across the boundary) or, on cuda:1, an error that echoes what it was given;
//   abi_mismatch  the entry with another stamp;
//   no_entry      no entry at all.
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "model/compute_backend.h"
#include "model/cuda_plugin.h"

#define STRATA_FAKE_OK 1
#define STRATA_FAKE_ABI_MISMATCH 2
#define STRATA_FAKE_NO_ENTRY 3

#if STRATA_FAKE_PLUGIN != STRATA_FAKE_NO_ENTRY
namespace {

absl::StatusOr<std::unique_ptr<strata::model::ComputeBackend>> Load(
    const std::string& model_dir, const strata::model::Device& device,
    const strata::model::CudaPluginOptions& options) {
  if (device.index == 1) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fake plugin: ", model_dir, " on ", device.ToString(),
        " kv_pool_bytes=", options.kv_pool_bytes, " max_sequences=", options.max_sequences,
        " max_step_tokens=", options.max_step_tokens, " cuda_graphs=", options.cuda_graphs));
  }
  return strata::model::LoadComputeBackend(model_dir, strata::model::Device{});
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const strata::model::CudaPluginEntry*
strata_cuda_plugin_v1() {
#if STRATA_FAKE_PLUGIN == STRATA_FAKE_OK
  static const std::string* const abi = new std::string(strata::model::CudaPluginAbi());
#else
  static const std::string* const abi = new std::string("strata-cuda-plugin/0 headers=old");
#endif
  static const strata::model::CudaPluginEntry entry{abi->c_str(), &Load};
  return &entry;
}
#else
extern "C" __attribute__((visibility("default"))) int strata_not_a_plugin() { return 0; }
#endif
