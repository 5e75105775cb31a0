// The model's matrix products, y[rows, out] = x[rows, in] . W^T, with W [out, in] row-major.
//
// A decode step multiplies a few rows (one per sequence of the continuous batch) by every
// weight. For those, MatMulRowInvariant computes each output element as one fixed chain of
// fused multiply-adds whatever the other rows are: a sequence's output is then the same bits
// alone or in any batch, and never depends on which others share its step. OpenBLAS cannot
// promise that: its result for a row changes with the number of rows in the call and with the
// row's position (measured on 0.3.21: in a call of 32 rows, every row differs from the same row
// alone). Larger products (prefill) go to OpenBLAS, faster there, with no such promise.
//
// Both run on the calling thread and `pool`'s threads, split by output columns; OpenBLAS is made
// single-threaded (its own idle threads spin after every call and would take the cores that
// attention runs on).
//
// The element (the specification both paths follow, bit for bit): eight partial sums
// a[j] = fma(x[k], w[k], a[j]) over k = k0 + j for k0 = 0, 8, 16, ... (terms beyond `in` taken as
// 0 * 0), then ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)).
//
// Thread-safe; `pool` as ThreadPool::ParallelFor allows (not from inside one of its tasks).
#pragma once

#include "common/thread_pool.h"

namespace strata::model {

// Products of at most this many rows are row-invariant (MatMul takes MatMulRowInvariant).
inline constexpr int kRowInvariantRows = 64;

// y[rows, out] = x[rows, in] . W^T: MatMulRowInvariant up to kRowInvariantRows rows, OpenBLAS
// above. Preconditions: rows, in, out >= 1; y does not overlap x or w.
void MatMul(const float* x, int rows, int in, const float* w, int out, float* y, ThreadPool& pool);
// Whether MatMul found OpenBLAS (opened at first use); without it, products of many rows take
// MatMulRowInvariant too (slower, and rounded differently from a node that has it).
bool MatMulUsesOpenBlas();

// Every row's result independent of the other rows, for any number of rows. Takes the AVX2+FMA
// code where the CPU has it (and CapCpuFeatures does not hide it), the portable code otherwise: the
// two give the same bits.
void MatMulRowInvariant(const float* x, int rows, int in, const float* w, int out, float* y,
                        ThreadPool& pool);
// The portable code alone, single-threaded: the reference the vector code is held to.
void MatMulRowInvariantPortable(const float* x, int rows, int in, const float* w, int out,
                                float* y);

}  // namespace strata::model
