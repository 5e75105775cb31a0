#include "model/cuda/cublas_library.h"

#include <dlfcn.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace strata::model::cuda {
namespace {

template <typename F>
bool Bind(void* lib, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) absl::StrAppend(missing, missing->empty() ? "" : ", ", name);
  return *fn != nullptr;
}

absl::StatusOr<const CublasLibrary*> Load() {
  std::vector<std::string> candidates = {"libcublas.so.13"};
#ifdef STRATA_CUBLAS_DIR
  candidates.push_back(std::string(STRATA_CUBLAS_DIR) + "/libcublas.so.13");
#endif
  std::string tried;
  void* lib = nullptr;
  for (const std::string& c : candidates) {
    lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* e = dlerror();
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", e != nullptr ? e : c);
  }
  if (lib == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda model: cannot load cuBLAS (", tried,
                     "); install CUDA's cuBLAS, or name its folder in LD_LIBRARY_PATH"));
  }
  auto* api = new CublasLibrary();  // for the process's life, as the library
  std::string missing;
  Bind(lib, "cublasCreate_v2", &api->create, &missing);
  Bind(lib, "cublasDestroy_v2", &api->destroy, &missing);
  Bind(lib, "cublasSetStream_v2", &api->set_stream, &missing);
  Bind(lib, "cublasSetWorkspace_v2", &api->set_workspace, &missing);
  Bind(lib, "cublasGemmEx", &api->gemm_ex, &missing);
  Bind(lib, "cublasGetStatusString", &api->status_string, &missing);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda model: the cuBLAS loaded lacks ", missing));
  }
  return api;
}

}  // namespace

absl::StatusOr<const CublasLibrary*> LoadCublas() {
  static const absl::StatusOr<const CublasLibrary*> library = Load();
  return library;
}

}  // namespace strata::model::cuda
