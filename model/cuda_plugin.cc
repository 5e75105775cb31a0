#include "model/cuda_plugin.h"

#include <dlfcn.h>

#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "model/cuda_plugin_abi.inc"  // generated: STRATA_PLUGIN_HEADERS_SHA256

namespace strata::model {

std::string CudaPluginAbi() {
  return absl::StrCat("strata-cuda-plugin/1 headers=", STRATA_PLUGIN_HEADERS_SHA256,
                      " compiler=", __VERSION__, " libstdc++=", _GLIBCXX_RELEASE,
                      " absl=", ABSL_LTS_RELEASE_VERSION);
}

std::string DefaultCudaPluginPath() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return kCudaPluginFile;  // dlopen's own search (LD_LIBRARY_PATH, the cache)
  const std::filesystem::path dir = exe.parent_path();
  const std::filesystem::path candidates[] = {dir.parent_path() / "lib" / kCudaPluginFile,
                                              dir / kCudaPluginFile};
  for (const std::filesystem::path& p : candidates) {
    if (std::filesystem::exists(p, ec)) return p.string();
  }
  return candidates[0].string();
}

absl::StatusOr<BackendLoader> OpenCudaPlugin(const std::string& path,
                                             const CudaPluginOptions& options) {
  std::error_code ec;
  if (path.find('/') != std::string::npos && !std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(
        "no CUDA plugin at ", path,
        " (a build without nvcc has none; build with CUDA 13 at /usr/local/cuda, or name the "
        "plugin with --cuda_plugin)"));
  }
  // RTLD_LOCAL: the plugin's symbols serve only it. RTLD_NODELETE: its code (vtables of the
  // backends it makes) stays mapped whatever happens to the handle.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA plugin ", path, " does not open: ", why != nullptr ? why : "(no reason given)"));
  }
  using Entry = const CudaPluginEntry* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, kCudaPluginEntry));
  if (entry == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA plugin ", path, " exports no ", kCudaPluginEntry,
                     ": not a Strata CUDA plugin, or one of another plugin version"));
  }
  const CudaPluginEntry* plugin = entry();
  const std::string mine = CudaPluginAbi();
  if (plugin == nullptr || plugin->abi == nullptr || plugin->load == nullptr ||
      mine != plugin->abi) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA plugin ", path,
                     " was built from other sources or by another compiler than this "
                     "binary (plugin: ",
                     plugin != nullptr && plugin->abi != nullptr ? plugin->abi : "none",
                     "; binary: ", mine, "); use the plugin built with this binary"));
  }
  return BackendLoader(
      [load = plugin->load, options](const std::string& model_dir, const Device& device) {
        return load(model_dir, device, options);
      });
}

}  // namespace strata::model
