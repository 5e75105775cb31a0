// The tensor-core instructions the kernels use, as inline PTX (sm_80 and later): mma.sync
// m16n8k16 on fp16 operands with fp32 sums, and ldmatrix (x4, plain and transposed). Fragment
// layouts (lane = 4g + t): A regs {row g, cols 2t..2t+1}, {row g+8, same}, {row g, cols 2t+8..},
// {row g+8, cols 2t+8..}; B regs {k 2t..2t+1, n g}, {k 2t+8.., n g}; C {row g, cols 2t, 2t+1},
// {row g+8, cols 2t, 2t+1}.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace strata::kernels::cuda {

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

__device__ __forceinline__ uint32_t HalfBits2(__half2 h) {
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace strata::kernels::cuda
