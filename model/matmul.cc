#include "model/matmul.h"

#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>

#include "common/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define STRATA_MATMUL_AVX2 1
#define STRATA_MATMUL_TARGET __attribute__((target("avx2,fma")))
#endif

namespace strata::model {
namespace {

// Below this many multiply-adds a product runs on the calling thread alone: handing out tasks
// would cost more than it saves.
constexpr size_t kParallelMacs = size_t{1} << 20;
// Column slices handed to the pool are a multiple of this many columns.
constexpr int kSliceColumns = 16;

// Runs fn(c0, c1) over slices of [0, out) on the pool when the product is large enough.
template <typename Fn>
void ForColumnSlices(int rows, int in, int out, ThreadPool& pool, const Fn& fn) {
  const int per = (out + pool.size() - 1) / pool.size();
  const int cols = (per + kSliceColumns - 1) / kSliceColumns * kSliceColumns;
  const int slices = (out + cols - 1) / cols;
  if (size_t(rows) * out * in < kParallelMacs || slices < 2) {
    fn(0, out);
    return;
  }
  pool.ParallelFor(slices, [&](size_t i) {
    const int c0 = static_cast<int>(i) * cols;
    fn(c0, std::min(out, c0 + cols));
  });
}

// The element of the header's specification.
float DotPortable(const float* x, const float* w, int in) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k0 = 0; k0 < in; k0 += 8) {
    for (int j = 0; j < 8; ++j) {
      const int k = k0 + j;
      a[j] = std::fma(k < in ? x[k] : 0.0f, k < in ? w[k] : 0.0f, a[j]);
    }
  }
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

void ColumnsPortable(const float* x, int rows, int in, const float* w, int out, float* y, int c0,
                     int c1) {
  for (int r = 0; r < rows; ++r) {
    for (int c = c0; c < c1; ++c) {
      y[size_t(r) * out + c] = DotPortable(x + size_t(r) * in, w + size_t(c) * in, in);
    }
  }
}

#if STRATA_MATMUL_AVX2
// The sums of four columns' partial sums, in the specification's order:
// hadd pairs lanes (0+1, 2+3 | 4+5, 6+7), the second hadd adds those pairs, and the two 128-bit
// halves add last.
STRATA_MATMUL_TARGET inline __m128 Reduce4(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// R rows by C columns (C = 4, or 1 for the last columns), the columns' rows of W in registers.
// The loops over r and c are unrolled so that the accumulators stay in registers.
template <int R, int C>
STRATA_MATMUL_TARGET void Block(const float* x, int in, const float* w, float* y, int ldy) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const int full = in / 8 * 8;
  for (int k = 0; k < full; k += 8) {
    __m256 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + size_t(c) * in + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + size_t(r) * in + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (full < in) {  // the masked lanes load 0 and add fma(0, 0, a), as the specification does
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(in - full), lane);
    __m256 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = _mm256_maskload_ps(w + size_t(c) * in + full, mask);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + size_t(r) * in + full, mask);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {
      _mm_storeu_ps(y + size_t(r) * ldy, Reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      y[size_t(r) * ldy] = _mm_cvtss_f32(Reduce4(acc[r][0], acc[r][0], acc[r][0], acc[r][0]));
    }
  }
}

template <int C>
STRATA_MATMUL_TARGET void RowBlocks(const float* x, int rows, int in, const float* w, float* y,
                                    int ldy) {
  int r = 0;
  for (; r + 3 <= rows; r += 3) Block<3, C>(x + size_t(r) * in, in, w, y + size_t(r) * ldy, ldy);
  if (rows - r == 2) Block<2, C>(x + size_t(r) * in, in, w, y + size_t(r) * ldy, ldy);
  if (rows - r == 1) Block<1, C>(x + size_t(r) * in, in, w, y + size_t(r) * ldy, ldy);
}

// Four columns at a time, each through every row (the columns' weights stay in cache while the
// rows pass over them), then the last columns one at a time.
STRATA_MATMUL_TARGET void ColumnsAvx2(const float* x, int rows, int in, const float* w, int out,
                                      float* y, int c0, int c1) {
  int c = c0;
  for (; c + 4 <= c1; c += 4) RowBlocks<4>(x, rows, in, w + size_t(c) * in, y + c, out);
  for (; c < c1; ++c) RowBlocks<1>(x, rows, in, w + size_t(c) * in, y + c, out);
}
#endif

bool UseAvx2() {
#if STRATA_MATMUL_AVX2
  static const bool avx2 = GetCpuFeatures().avx2 && GetCpuFeatures().fma;
  return avx2;
#else
  return false;
#endif
}

}  // namespace

void MatMulRowInvariantPortable(const float* x, int rows, int in, const float* w, int out,
                                float* y) {
  ColumnsPortable(x, rows, in, w, out, y, 0, out);
}

void MatMulRowInvariant(const float* x, int rows, int in, const float* w, int out, float* y,
                        ThreadPool& pool) {
  const bool avx2 = UseAvx2();
  ForColumnSlices(rows, in, out, pool, [&](int c0, int c1) {
#if STRATA_MATMUL_AVX2
    if (avx2) return ColumnsAvx2(x, rows, in, w, out, y, c0, c1);
#endif
    ColumnsPortable(x, rows, in, w, out, y, c0, c1);
  });
  (void)avx2;
}

namespace {

// OpenBLAS, opened at first use rather than linked. Every library a program loads at start puts
// its thread-local storage inside every thread's stack, and OpenBLAS's is 60 KiB: the metrics
// server's threads (civetweb, under prometheus-cpp, makes them with 100 KiB stacks) were left
// about 33 KiB, and a scrape needs about 32 KiB. A library opened later keeps its thread-local
// storage apart, in the threads that use it. Every program linked OpenBLAS through this library,
// the store and the router too, which never multiply matrices.
using Sgemm = decltype(&cblas_sgemm);

// cblas_sgemm, or nullptr where no OpenBLAS could be opened.
Sgemm OpenBlasSgemm() {
  static const Sgemm sgemm = []() -> Sgemm {
    void* lib = nullptr;
    // The build's (the one serving.static_tls and the benchmarks measured), else whichever the
    // system's alternatives name.
    for (const char* name : {STRATA_OPENBLAS_LIBRARY, "libopenblas.so.0"}) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    }
    if (lib == nullptr) {
      std::fprintf(stderr,
                   "strata: OpenBLAS not found (%s): products of many rows run without it\n",
                   dlerror());
      return nullptr;
    }
    // OpenBLAS's threads stay idle from here on: the pool does the splitting.
    if (auto set = reinterpret_cast<decltype(&openblas_set_num_threads)>(
            dlsym(lib, "openblas_set_num_threads"));
        set != nullptr) {
      set(1);
    }
    return reinterpret_cast<Sgemm>(dlsym(lib, "cblas_sgemm"));
  }();
  return sgemm;
}

}  // namespace

bool MatMulUsesOpenBlas() { return OpenBlasSgemm() != nullptr; }

void MatMul(const float* x, int rows, int in, const float* w, int out, float* y, ThreadPool& pool) {
  const Sgemm sgemm = OpenBlasSgemm();
  if (rows <= kRowInvariantRows || sgemm == nullptr) {
    return MatMulRowInvariant(x, rows, in, w, out, y, pool);
  }
  ForColumnSlices(rows, in, out, pool, [&](int c0, int c1) {
    sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, c1 - c0, in, 1.0f, x, in,
          w + size_t(c0) * in, in, 0.0f, y + c0, out);
  });
}

}  // namespace strata::model
