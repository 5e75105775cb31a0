// The CUDA backend as a plugin: libstrata_cuda.so, opened by a binary asked for a CUDA device.
//
// The serving binaries do not link CUDA. Linking it put CUDA's runtime (and cuBLAS's) thread-local
// storage into every thread's static TLS block, carved out of the thread's stack, and civetweb's
// small worker stacks could no longer start (no /metrics). A library opened with dlopen has its
// thread-local storage allocated per thread on first use instead, so a node that never asks for a
// GPU pays nothing and one that does keeps its small-stack threads.
//
// The plugin carries its own copy of the Strata code it needs (common, kernels, model and the CUDA
// backend, linked with hidden symbols) and exports one C symbol, kCudaPluginEntry. What crosses
// between binary and plugin are C++ objects (ComputeBackend, KvCache, absl::Status, SharedBytes),
// so both sides must be built from the same headers by the same compiler against the same
// libstdc++ and absl: the plugin's ABI stamp (CudaPluginAbi) must equal the binary's, or it is
// refused, saying both. A plugin is never closed (its code runs until the process ends).
//
//   STRATA_ASSIGN_OR_RETURN(BackendLoader loader,
//                           OpenCudaPlugin(DefaultCudaPluginPath(), {.max_sequences = 32}));
//   SetCudaBackendLoader(loader);  // LoadComputeBackend(dir, cuda:N) now goes to the plugin
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/compute_backend.h"

namespace strata::model {

// The serving options of the CUDA backend (model/cuda/cuda_backend.h's CudaBackendOptions, less
// the device, which LoadComputeBackend names).
struct CudaPluginOptions {
  uint64_t kv_pool_bytes = 0;     // device memory for KV pages; 0: 90 % of what is free
  uint32_t max_sequences = 64;    // sequences holding a cache at once
  uint32_t max_step_tokens = 16;  // tokens a sequence may add in one step beyond one chunk
  bool cuda_graphs = true;        // decode steps replayed as CUDA graphs
};

// What the plugin's entry returns.
struct CudaPluginEntry {
  const char* abi;  // the plugin's CudaPluginAbi()
  absl::StatusOr<std::unique_ptr<ComputeBackend>> (*load)(const std::string& model_dir,
                                                          const Device& device,
                                                          const CudaPluginOptions& options);
};

// The one symbol a plugin exports: extern "C" const CudaPluginEntry* strata_cuda_plugin_v1().
inline constexpr char kCudaPluginEntry[] = "strata_cuda_plugin_v1";
inline constexpr char kCudaPluginFile[] = "libstrata_cuda.so";

// This build's ABI stamp: the hash of the headers of common/, kernels/ and model/, the compiler,
// libstdc++ and absl versions. The same string in a binary and a plugin built from one tree.
std::string CudaPluginAbi();

// Where a binary looks for the plugin: `lib/libstrata_cuda.so` beside the binary's folder (the
// build tree's and an install's layout: bin/../lib), else beside the binary itself. The first
// that exists; the first candidate when none does (the error then names it).
std::string DefaultCudaPluginPath();

// Opens the plugin at `path` and returns the loader that makes CUDA backends through it with
// `options`. kNotFound when there is no file there (saying that this build may have no CUDA);
// kFailedPrecondition when it does not open (dlerror's words), exports no entry, or was built
// from other headers or by another compiler (both stamps named).
absl::StatusOr<BackendLoader> OpenCudaPlugin(const std::string& path,
                                             const CudaPluginOptions& options);

}  // namespace strata::model
