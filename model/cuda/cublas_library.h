// cuBLAS, loaded with dlopen the first time a model is put on a GPU, rather than linked: a
// process that links it gets libcublasLt's 94 KB of thread-local storage carved out of every
// thread's stack, and threads with small stacks then cannot start (civetweb's, under the nodes'
// Prometheus endpoint: a node linking cuBLAS could not serve /metrics even on the CPU). Loaded
// this way the storage is allocated per thread on use, and a CPU-only node never loads it.
//
// The functions the model uses, with cuBLAS's own signatures (cublas_v2.h's _v2 entry points).
#pragma once

#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace strata::model::cuda {

struct CublasLibrary {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  // The C entry point (cublas_api.h's; the C++ header adds an inline overload beside it).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

// The library, loaded once (libcublas.so.13 through the loader's search path, then CUDA's
// folder this build was made with); thread-safe. kFailedPrecondition naming what dlopen said
// when there is none.
absl::StatusOr<const CublasLibrary*> LoadCublas();

}  // namespace strata::model::cuda
