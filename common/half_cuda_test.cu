// Holds Strata's CPU half/bfloat16 conversions to the GPU's conversion instructions, bit for bit,
// over every 16-bit value and a sweep of floats. Skips (and says why) where no GPU is present.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/half.h"
#include "common/testing/cuda_device.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

__global__ void WidenKernel(const uint16_t* in, float* half_out, float* bf16_out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  half_out[i] = __half2float(__ushort_as_half(in[i]));
  bf16_out[i] = __bfloat162float(__ushort_as_bfloat16(in[i]));
}

__global__ void NarrowKernel(const float* in, uint16_t* half_out, uint16_t* bf16_out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  half_out[i] = __half_as_ushort(__float2half_rn(in[i]));
  bf16_out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

template <typename T>
struct DeviceArray {
  T* p = nullptr;
  explicit DeviceArray(size_t n) { cudaMalloc(&p, n * sizeof(T)); }
  ~DeviceArray() { cudaFree(p); }
};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(HalfCudaTest, WideningMatchesTheGpuForAll65536Values) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  constexpr int n = 65536;
  std::vector<uint16_t> in(n);
  for (int i = 0; i < n; ++i) in[i] = static_cast<uint16_t>(i);
  DeviceArray<uint16_t> d_in(n);
  DeviceArray<float> d_half(n), d_bf16(n);
  ASSERT_CUDA(cudaMemcpy(d_in.p, in.data(), n * 2, cudaMemcpyHostToDevice));
  WidenKernel<<<n / 256, 256>>>(d_in.p, d_half.p, d_bf16.p, n);
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> half_out(n), bf16_out(n);
  ASSERT_CUDA(cudaMemcpy(half_out.data(), d_half.p, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(bf16_out.data(), d_bf16.p, n * 4, cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) {
    const float h = HalfBitsToFloat(in[i]);
    const float b = BFloat16BitsToFloat(in[i]);
    if (std::isnan(h)) {
      EXPECT_TRUE(std::isnan(half_out[i])) << i;
    } else {
      EXPECT_EQ(Bits(half_out[i]), Bits(h)) << i;
    }
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(bf16_out[i])) << i;
    } else {
      EXPECT_EQ(Bits(bf16_out[i]), Bits(b)) << i;
    }
  }
}

TEST(HalfCudaTest, NarrowingMatchesTheGpuOnMidpointsAndRandomFloats) {
  std::string why;
  if (!HaveCudaDevice(&why)) GTEST_SKIP() << "skipped, no GPU: " << why;
  std::vector<float> in;
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every half midpoint and its neighbours
    const double lo = HalfBitsToFloat(static_cast<uint16_t>(h));
    const double hi = h + 1 == 0x7c00 ? 65536.0 : HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    in.push_back(mid);
    in.push_back(std::nextafter(mid, 0.0f));
    in.push_back(std::nextafter(mid, INFINITY));
    in.push_back(-mid);
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 1 << 20; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    in.push_back(f);
  }
  const int n = static_cast<int>(in.size());
  DeviceArray<float> d_in(n);
  DeviceArray<uint16_t> d_half(n), d_bf16(n);
  ASSERT_CUDA(cudaMemcpy(d_in.p, in.data(), n * 4, cudaMemcpyHostToDevice));
  NarrowKernel<<<(n + 255) / 256, 256>>>(d_in.p, d_half.p, d_bf16.p, n);
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> half_out(n), bf16_out(n);
  ASSERT_CUDA(cudaMemcpy(half_out.data(), d_half.p, n * 2, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(bf16_out.data(), d_bf16.p, n * 2, cudaMemcpyDeviceToHost));
  int nonzero = 0;
  for (int i = 0; i < n; ++i) {
    nonzero += half_out[i] != 0;
    if (std::isnan(in[i])) {
      EXPECT_EQ(half_out[i] & 0x7c00, 0x7c00) << i;
      EXPECT_NE(half_out[i] & 0x3ff, 0) << i;
      continue;
    }
    ASSERT_EQ(half_out[i], FloatToHalfBits(in[i])) << i << " " << in[i];
    ASSERT_EQ(bf16_out[i], FloatToBFloat16Bits(in[i])) << i << " " << in[i];
  }
  EXPECT_GT(nonzero, n / 2);  // the kernel really wrote results
}

}  // namespace
}  // namespace strata
