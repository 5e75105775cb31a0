// libstrata_cuda.so's entry (model/cuda_plugin.h): the CUDA backend behind one exported symbol.
#include "model/cuda_plugin.h"

#include "model/cuda/cuda_backend.h"

namespace strata::model::cuda {
namespace {

absl::StatusOr<std::unique_ptr<ComputeBackend>> Load(const std::string& model_dir,
                                                     const Device& device,
                                                     const CudaPluginOptions& options) {
  return LoadCudaBackend(model_dir, device,
                         {.kv_pool_bytes = options.kv_pool_bytes,
                          .max_sequences = options.max_sequences,
                          .max_step_tokens = options.max_step_tokens,
                          .cuda_graphs = options.cuda_graphs});
}

}  // namespace
}  // namespace strata::model::cuda

extern "C" __attribute__((visibility("default"))) const strata::model::CudaPluginEntry*
strata_cuda_plugin_v1() {
  static const std::string* const abi = new std::string(strata::model::CudaPluginAbi());
  static const strata::model::CudaPluginEntry entry{abi->c_str(), &strata::model::cuda::Load};
  return &entry;
}
