#include "kernels/cuda/compress.h"

#include <cuda_fp16.h>

#include "absl/strings/str_cat.h"

namespace strata::kernels::cuda {
namespace {

// The CPU's group parameters: fp16 scale and zero point, and the reciprocal used to quantize.
__device__ __forceinline__ void Params(float lo, float hi, float qmax, __half* scale,
                                       __half* zero, float* s, float* z, float* inv) {
  *scale = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), qmax));
  *zero = __float2half_rn(lo);
  *s = __half2float(*scale);
  *z = __half2float(*zero);
  *inv = *s > 0.f ? __fdiv_rn(1.0f, *s) : 0.f;
}

__device__ __forceinline__ uint8_t Code(float x, float z, float inv, float qmax) {
  const float y = fmaxf(__fadd_rn(__fmul_rn(__fsub_rn(x, z), inv), 0.5f), 0.f);
  return static_cast<uint8_t>(fminf(truncf(y), qmax));
}

// Packs `codes` [rows][D] (one byte each, in shared memory) into `out` rows of D * bits / 8 bytes.
__device__ void Pack(const uint8_t* codes, int rows, int D, int bits, uint8_t* out) {
  const int row_bytes = D * bits / 8;
  const int per_byte = 8 / bits;
  for (int i = threadIdx.x; i < rows * row_bytes; i += blockDim.x) {
    const int r = i / row_bytes, b = i % row_bytes;
    uint32_t byte = 0;
    for (int j = 0; j < per_byte; ++j) byte |= static_cast<uint32_t>(codes[r * D + b * per_byte + j]) << (j * bits);
    out[static_cast<size_t>(r) * row_bytes + b] = static_cast<uint8_t>(byte);
  }
}

// One block per (chunk, KV head); one thread per channel (blockDim.x == head_dim).
__global__ void CompressKernel(PagedKvLayout L, CompressArgs a) {
  extern __shared__ uint8_t codes[];  // [page_tokens][head_dim]
  const int chunk = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const int T = L.page_tokens, H = L.kv_heads, D = L.head_dim;
  uint8_t* page = a.pages + static_cast<int64_t>(a.page_ids[chunk]) * L.PageBytes();
  const size_t base = static_cast<size_t>(chunk) * T * H * D;
  auto at = [&](const float* x, int t, int c) { return x[base + (static_cast<size_t>(t) * H + h) * D + c]; };

  // Keys: channel d over each group of k_group tokens.
  const float kq = static_cast<float>((1 << L.key_bits) - 1);
  __half* kscales = reinterpret_cast<__half*>(page + L.KeyScalesOf(h));
  __half* kzeros = reinterpret_cast<__half*>(page + L.KeyZerosOf(h));
  for (int g = 0; g < T / L.k_group; ++g) {
    float lo = INFINITY, hi = -INFINITY;
    for (int t = g * L.k_group; t < (g + 1) * L.k_group; ++t) {
      const float x = at(a.k, t, d);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    float s, z, inv;
    Params(lo, hi, kq, &kscales[g * D + d], &kzeros[g * D + d], &s, &z, &inv);
    for (int t = g * L.k_group; t < (g + 1) * L.k_group; ++t) codes[t * D + d] = Code(at(a.k, t, d), z, inv, kq);
  }
  __syncthreads();
  Pack(codes, T, D, L.key_bits, page + L.KeyCodesOf(h));
  __syncthreads();

  // Values: token t over each group of v_group channels; the group's lanes reduce together.
  const float vq = static_cast<float>((1 << L.value_bits) - 1);
  const int groups = D / L.v_group, g = d / L.v_group;
  __half* vscales = reinterpret_cast<__half*>(page + L.ValueScalesOf(h));
  __half* vzeros = reinterpret_cast<__half*>(page + L.ValueZerosOf(h));
  float* red = reinterpret_cast<float*>(codes + T * D);  // [2][head_dim]
  for (int t = 0; t < T; ++t) {
    const float x = at(a.v, t, d);
    red[d] = x;
    red[D + d] = x;
    __syncthreads();
    for (int stride = 1; stride < L.v_group; stride *= 2) {  // min and max within each group
      float lo = red[d], hi = red[D + d];
      const bool active = (d % L.v_group) % (2 * stride) == 0 && d + stride < (g + 1) * L.v_group;
      if (active) {
        lo = fminf(lo, red[d + stride]);
        hi = fmaxf(hi, red[D + d + stride]);
      }
      __syncthreads();
      if (active) {
        red[d] = lo;
        red[D + d] = hi;
      }
      __syncthreads();
    }
    const float lo = red[g * L.v_group], hi = red[D + g * L.v_group];
    __half scale, zero;
    float s, z, inv;
    Params(lo, hi, vq, &scale, &zero, &s, &z, &inv);
    if (d % L.v_group == 0) {
      vscales[t * groups + g] = scale;
      vzeros[t * groups + g] = zero;
    }
    codes[t * D + d] = Code(x, z, inv, vq);
    __syncthreads();
  }
  Pack(codes, T, D, L.value_bits, page + L.ValueCodesOf(h));
}

}  // namespace

absl::Status CompressToPages(const PagedKvLayout& layout, const CompressArgs& args,
                             cudaStream_t stream) {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  if (layout.format != PageFormat::kAffine) {
    return absl::InvalidArgumentError("compress: the layout must be affine");
  }
  if (args.chunks < 1 || args.k == nullptr || args.v == nullptr || args.pages == nullptr ||
      args.page_ids == nullptr) {
    return absl::InvalidArgumentError("compress: chunks >= 1 and every pointer are needed");
  }
  const size_t smem = static_cast<size_t>(layout.page_tokens) * layout.head_dim +
                      2 * layout.head_dim * sizeof(float);
  if (cudaError_t e = cudaFuncSetAttribute(
          CompressKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("compress: ", smem, " bytes of shared memory: ", cudaGetErrorString(e)));
  }
  const dim3 grid(args.chunks, layout.kv_heads);
  CompressKernel<<<grid, layout.head_dim, smem, stream>>>(layout, args);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("compress: launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels::cuda
