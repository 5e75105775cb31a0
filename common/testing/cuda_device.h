// For the GPU tests: whether a CUDA device can be used here, and if not, why (the CUDA runtime's
// message: no driver, a driver older than the runtime, no device), for their skip messages.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace strata {

inline bool HaveCudaDevice(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);
    return false;
  }
  if (n == 0) *why = "no CUDA device";
  return n > 0;
}

}  // namespace strata
